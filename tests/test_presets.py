"""Every model × every sharding preset, at M ≥ 2 microbatches on a mesh with data ≥ 2:
the update equals the single-device one, and every collective of the compiled step is
pinned exactly (kind, in or out of loops, mesh axes, bytes) in
tests/data/preset_collectives.json.

Each (model, preset, mode) compiles once (module-scoped cache); the program that is read is
the one that runs. The pinned lists are also the "collectives per step" table of
docs/models.md: `test_docs_table_is_the_pinned_data` fails when they disagree, and prints
the table to paste.
"""

import collections
import functools
import json
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_rounding_close,
    classification_batch,
    largest,
    lm_batch,
    mse_per_example,
    on_host,
    preset_mesh,
    regression_batch,
    tiny_decoder,
    tiny_encoder_classifier,
    tree_bytes,
)

import zoo

N, M = 4, 2  # 4 devices: data=4, or data=2 × model=2 for the tensor-parallel presets
BATCH = 16  # divisible by every data size × M
LR = 0.5
# A step on a mesh vs the plain one-device step: the same sums in another order
# (helpers.rounding_bound). The longest is the loss's and gradients' sum over the batch's
# 16 x 8 tokens; the decoders' and encoder's forward is 2 layers of ~6 chained sums plus the
# head (the MLP's: 3 layers of a matmul and a norm's 2), the gradients twice that.
SUMS = {"terms": BATCH * 8, "depth": 2 * (2 * 6 + 1)}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ("q_proj", "v_proj", "down")}


def tiny_mlp(key):
    import zoo

    return zoo.nn.MLP(8, 4, 16, 3, activation=jnp.tanh, norm="layernorm", scan=True, key=key)


def mlp_batch(key, size):
    return regression_batch(key, size, 8, 4)


def lora_decoder(key):
    import zoo

    return zoo.lora.add_lora(tiny_decoder(key), zoo.lora.LoraConfig(**LORA), key=jax.random.fold_in(key, 1))


def qk_norm_decoder(key):
    """The decoder with Qwen3's q/k norms (`qk_norm`): scales of `head_dim` replicated while
    the heads they scale are split over `model`."""
    return tiny_decoder(key, qk_norm=True)


def olmo2_norms_decoder(key):
    """The decoder with OLMo 2's norms: on each sub-layer's output only (`norm_placement=
    "output"`), and q/k RMSNorms over the whole projections (`qk_norm_scope="projection"`),
    whose scales are split over `model` with the heads and whose mean of squares sums
    across them under tp."""
    return tiny_decoder(key, qk_norm=True, qk_norm_scope="projection", norm_placement="output")


def patterned_decoder(key):
    """The decoder whose two layers differ (`TransformerConfig`'s per-layer patterns): layer
    0 global with RoPE at base 10k, layer 1 sliding (a window of 3, shorter than the batch's
    8 tokens) without RoPE (SmolLM3's NoPE), its base 500 scanned all the same; RoPE on 2
    of each head's 4 dimensions (Phi-4-mini's partial rotary: a slice within a head, which
    tp does not split); layer 0's frequencies divided by 8 (Gemma 3's linear RoPE scaling of
    its global layers, a per-layer factor). The pattern is data the scan reads beside the
    parameters, not a leaf: the collectives are the decoder's."""
    return tiny_decoder(
        key, sliding_window=3, sliding_layers=(False, True), rope_layers=(True, False), rope_thetas=(1e4, 5e2),
        partial_rotary_factor=0.5, rope_factors=(8.0, 1.0),
    )  # fmt: skip


def gemma2_decoder(key):
    """The decoder with Gemma 2's layers: norms before and after each sub-layer
    (`norm_placement="sandwich"`), a window of 3 on layer 0 only, attention scores and
    logits soft-capped and scores scaled by `query_pre_attn_scalar` (static settings, no
    leaf: the extra norms' leaves are the only change the collectives see)."""
    return tiny_decoder(
        key, norm_placement="sandwich", sliding_window=3, sliding_layers=(True, False), attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, query_pre_attn_scalar=12.0,
    )  # fmt: skip


def moe_decoder(key):
    """The decoder with a mixture of experts in every layer (top-2 of 4 SwiGLU experts, 24
    wide): the one model whose `expert` axis the `ep` preset splits over `model`."""
    return tiny_decoder(key, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=24)


def lora_trainable(model):
    return zoo.lora.trainable(model, zoo.lora.LoraConfig(**LORA))


# name: (make model, make batch, loss, trainable filter or None)
MODELS = {
    "mlp": (tiny_mlp, mlp_batch, mse_per_example, None),
    "decoder": (tiny_decoder, lm_batch, zoo.models.next_token_loss, None),
    "encoder": (tiny_encoder_classifier, classification_batch, zoo.models.classification_loss, None),
    "decoder+lora": (lora_decoder, lm_batch, zoo.models.next_token_loss, lora_trainable),
    "decoder+qk_norm": (qk_norm_decoder, lm_batch, zoo.models.next_token_loss, None),
    "decoder+olmo2_norms": (olmo2_norms_decoder, lm_batch, zoo.models.next_token_loss, None),
    "decoder+pattern": (patterned_decoder, lm_batch, zoo.models.next_token_loss, None),
    "decoder+gemma2": (gemma2_decoder, lm_batch, zoo.models.next_token_loss, None),
    "decoder+moe": (moe_decoder, lm_batch, zoo.models.next_token_loss, None),
}
# Every preset in explicit mode; shard_map mode where parameters are replicated off `data`
# inside the loop (dp, and fsdp-once gathered before it), by pairwise cover
# (`SHARD_MAP_CASES`).
PRESET_MODES = [
    ("dp", "explicit"),
    ("dp", "shard_map"),
    ("fsdp", "explicit"),
    ("fsdp-once", "explicit"),
    ("fsdp-once", "shard_map"),
    ("tp", "explicit"),
    ("fsdp+tp", "explicit"),
    ("zero1", "explicit"),
    ("ep", "explicit"),
    ("ep+fsdp", "explicit"),
]
# The q/k-norm decoder differs from the decoder in two replicated leaves per layer: the
# presets that place them differently from the heads they scale (dp: the base case). The
# OLMo 2-norms decoder in its norms' leaves and places: the same presets.
QK_NORM_PRESETS = ("dp", "fsdp", "tp")
# The patterned decoder scans its per-layer settings beside the parameters it shares with
# the decoder, the Gemma 2 decoder adds two norms a layer: the same presets.
PATTERN_PRESETS = QK_NORM_PRESETS
# `ep` splits only a mixture of experts' experts: on any other model it is `dp` with a
# `model` axis repeating the same work (zoo train refuses it), so it runs the MoE decoder
# alone; the MoE decoder runs it and `dp` (its other presets: tests/test_moe.py's `tp`, the
# budget of each checked once by hand, docs/models.md).
MOE_PRESETS = ("dp", "ep", "ep+fsdp")
# shard_map mode: each of its two presets and each of the two models it runs (the decoder,
# the encoder) once, so every (model, mode) and (preset, mode) pair meets (2 steps, not the
# product's 4); explicit mode runs every model under every preset and pins the bytes that
# shard_map mode must match.
SHARD_MAP_CASES = {("decoder", "dp"), ("encoder", "fsdp-once")}
CASES = [(model, preset, mode) for model in MODELS for preset, mode in PRESET_MODES
         if (mode == "explicit" or (model, preset) in SHARD_MAP_CASES)
         and (model not in ("decoder+qk_norm", "decoder+olmo2_norms") or preset in QK_NORM_PRESETS)
         and (model not in ("decoder+pattern", "decoder+gemma2") or preset in PATTERN_PRESETS)
         and (model == "decoder+moe") >= preset.startswith("ep") and (model != "decoder+moe" or preset in MOE_PRESETS)]  # fmt: skip


def case_id(model, preset, mode):
    return f"{model}-{preset}" + ("-shard_map" if mode == "shard_map" else "")


def test_every_preset_is_covered():
    assert {preset for preset, _ in PRESET_MODES} == set(zoo.RULE_PRESETS)


@functools.cache
def reference(model_name):
    """The judge: plain jax on one device, whole batch, then one SGD update."""
    make_model, make_batch, loss_fn, trainable = MODELS[model_name]
    # On the host: each mesh layout then places them without compiling (helpers.on_host).
    model = on_host(make_model(jax.random.key(0)))
    batch = on_host(make_batch(jax.random.key(1), BATCH))
    params, frozen = eqx.partition(model, eqx.is_inexact_array if trainable is None else trainable(model))

    def mean_loss(p, frozen, batch):
        out = loss_fn(eqx.combine(p, frozen), batch)
        return out[0].sum() / out[1].sum() if isinstance(out, tuple) else out.mean()

    # The update in the same program (op by op it compiled two operations per leaf shape);
    # the host arrays are its arguments (zoo's losses take no numpy constants).
    @eqx.filter_jit
    def loss_and_update(p, frozen, batch):
        loss, grads = jax.value_and_grad(mean_loss)(p, frozen, batch)
        return loss, jax.tree.map(lambda p, g: p - LR * g, p, grads)

    loss, updated = loss_and_update(params, frozen, batch)
    return model, batch, loss, eqx.combine(updated, frozen)


@functools.cache
def run(model_name, preset, mode, compiler_options=None):
    """One compiled step, run once: (updated model, loss, collectives, trainable params, mesh)."""
    model, batch, _, _ = reference(model_name)
    _, _, loss_fn, trainable = MODELS[model_name]
    mesh = preset_mesh(preset, N)
    options = zoo.preset(preset).step_options
    if trainable is not None:
        options["trainable"] = trainable(model)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules(preset), mesh)
        step = zoo.TrainStep(loss_fn, optax.sgd(LR), microbatches=M, mode=mode, **options)
        opt_state = step.init(sharded)
        if compiler_options is not None:  # only read, never run
            lowered = step.lower(sharded, opt_state, batch)
            return zoo.collectives(lowered.compile(compiler_options=dict(compiler_options)))
        compiled = step.compile(sharded, opt_state, batch)
        new_model, _, loss = compiled(sharded, opt_state, batch)
    # Read outside the mesh context: the inspector takes the mesh from the program.
    return new_model, loss, zoo.collectives(compiled), step.partition(sharded)[0], mesh


def signature(colls) -> list[str]:
    """The pinned form of a program's collectives, one row per distinct op:
    `kind loop|outside axes bytes xCOUNT`, in a fixed order."""
    rows = collections.Counter(
        (c.kind, "loop" if c.in_loop else "outside", ",".join(c.mesh_axes) or "-", c.bytes) for c in colls
    )
    return [f"{kind} {where} {axes} {size} x{n}" for (kind, where, axes, size), n in sorted(rows.items())]


# The pinned collectives of each (model, preset) step, explicit mode (shard_map mode must
# match it). Regenerate with `python tests/test_presets.py --pin` after a deliberate change,
# and say why in the commit.
PINNED = pathlib.Path(__file__).parent / "data" / "preset_collectives.json"
EXPECTED = json.loads(PINNED.read_text())


@pytest.mark.parametrize("model_name, preset, mode", CASES, ids=[case_id(*c) for c in CASES])
def test_update_equals_single_device(model_name, preset, mode):
    _, _, ref_loss, ref_updated = reference(model_name)
    new_model, loss, *_ = run(model_name, preset, mode)
    assert_rounding_close(loss, ref_loss, **SUMS)
    # SGD: new = old - lr * grads, so equal updates mean equal gradients: lr x a gradient's
    # rounding, at the scale of the leaf or of the largest step lr * |g| in the model (a
    # gradient that cancels, e.g. the encoder's key bias, exactly 0 in exact arithmetic,
    # sums terms of its neighbours' sizes, not of its own).
    model = reference(model_name)[0]
    want, start = (jax.tree.leaves(eqx.filter(t, eqx.is_array)) for t in (ref_updated, model))
    step = max(largest(np.asarray(w, np.float64) - np.asarray(p)) for w, p in zip(want, start, strict=True))
    got = jax.tree.leaves(eqx.filter(new_model, eqx.is_array))
    for g, w in zip(got, want, strict=True):
        assert_rounding_close(g, w, **SUMS, scale=max(largest(w), step))


@pytest.mark.parametrize("model_name, preset, mode", CASES, ids=[case_id(*c) for c in CASES])
def test_collectives_are_pinned(model_name, preset, mode):
    _, _, colls, _, mesh = run(model_name, preset, mode)
    assert mesh.shape["data"] >= 2 and M >= 2  # else "outside the loop" could not fail
    assert signature(colls) == EXPECTED[case_id(model_name, preset, "explicit")], zoo.report(colls)


@pytest.mark.parametrize("model_name, preset, mode", CASES, ids=[case_id(*c) for c in CASES])
def test_collectives_sit_where_the_preset_says(model_name, preset, mode):
    """What each preset promises, stated without bytes (the pin above holds those)."""
    _, _, colls, trainable, _ = run(model_name, preset, mode)
    in_loop = [c for c in colls if c.in_loop]
    on_data = [c for c in colls if "data" in c.mesh_axes]
    reductions = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter")]
    data_reductions_outside = [c for c in reductions if c.mesh_axes == ("data",) and not c.in_loop]
    # Every op names its axes, and none mixes data with model.
    assert all(c.mesh_axes in (("data",), ("model",)) for c in colls), zoo.report(colls)
    # Outside the loops, one reduction over `data`: the gradients (the ones not reduced in
    # the loop) and the loss sums.
    assert len(data_reductions_outside) == 1, zoo.report(colls)
    if preset in ("dp", "fsdp-once", "zero1"):
        # Nothing in the loop; the one reduction carries every trainable gradient + loss sums.
        assert not in_loop, zoo.report(colls)
        assert data_reductions_outside[0].bytes - tree_bytes(trainable) in (4, 8), zoo.report(colls)
    if preset == "dp":
        assert len(colls) == 1, zoo.report(colls)
    if preset in ("fsdp-once", "zero1"):
        assert {c.kind for c in colls} == {"all-gather", "all-reduce"}, zoo.report(colls)
    if preset == "tp":
        # In the loop only tensor parallelism's own collectives, over `model`.
        assert in_loop and all(c.mesh_axes == ("model",) for c in in_loop), zoo.report(colls)
        assert on_data == data_reductions_outside, zoo.report(colls)
    if preset == "ep":
        # In the loop only expert parallelism's activation traffic over `model` (the sum over
        # the experts split across it, and its backward); over `data` the one reduction.
        assert in_loop and all(c.mesh_axes == ("model",) for c in in_loop), zoo.report(colls)
        assert on_data == data_reductions_outside, zoo.report(colls)
        # It carries each device's gradients: its half of the experts, the rest whole.
        per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(trainable))
        assert per_device < tree_bytes(trainable), "the experts are not split"
        assert data_reductions_outside[0].bytes - per_device in (4, 8), zoo.report(colls)
    if preset in ("fsdp", "fsdp+tp"):
        # Per-use FSDP: gradient reductions over `data` in the loop, gathers somewhere.
        assert any(c.mesh_axes == ("data",) for c in in_loop if c in reductions), zoo.report(colls)
        assert zoo.count(on_data, "all-gather") >= 1


@pytest.mark.parametrize("preset", ["fsdp+tp"])
def test_fast_compile_options_change_no_collective(preset):
    """The suite compiles with LLVM's backend optimisation off (tests/conftest.py sets
    `--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true` when the
    backend starts). The collectives it pins are those of XLA's default options. fsdp+tp's
    step holds every kind, place and axis of collective the presets make (all-gathers over
    `data` in and outside the loop, all-reduces over `data` in and outside it, over `model`
    in it): dp's, tp's and fsdp-once's among them."""
    _, _, fast, _, _ = run("decoder", preset, "explicit")
    default = run("decoder", preset, "explicit", compiler_options=DEFAULT_OPTIONS)
    keys = [[(c.kind, c.in_loop, c.bytes, c.mesh_axes) for c in colls] for colls in (fast, default)]
    assert keys[0] == keys[1]
    assert keys[0] and any(c.mesh_axes for c in fast)


# XLA's own defaults (DebugOptions), which the suite's fast flags override.
DEFAULT_OPTIONS = (("xla_backend_optimization_level", 3), ("xla_llvm_disable_expensive_passes", False))


def test_fsdp_once_holds_full_copy_only_for_the_step():
    """fsdp-once keeps parameters and optimizer state split at rest: after a step every
    leaf is still sharded over `data` along its embed axis."""
    model, batch, _, _ = reference("decoder")
    mesh = preset_mesh("fsdp-once", N)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("fsdp-once"), mesh)
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.adam(1e-3), microbatches=M, gather="once")
        new_model, opt_state, _ = step(sharded, step.init(sharded), batch)
    specs = zoo.partition_specs(model, zoo.rules("fsdp-once"))
    for leaf, spec in zip(jax.tree.leaves(eqx.filter(new_model, eqx.is_array)), jax.tree.leaves(specs)):
        assert leaf.sharding.spec == spec
    mu = opt_state[0].mu
    assert mu.token_embedding.weight.sharding.spec == specs.token_embedding.weight


def test_bf16_compute_keeps_the_gradient_all_reduce_in_float32():
    """Mixed precision: activations in bfloat16, but the one all-reduce carries float32
    gradients (its bytes are the float32 parameter bytes plus the two loss scalars)."""
    model = on_host(tiny_decoder(jax.random.key(0), dtype="bfloat16"))
    batch = on_host(lm_batch(jax.random.key(1), 8))
    mesh = preset_mesh("dp", 4)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(0.1), microbatches=2)
        compiled = step.compile(sharded, step.init(sharded), batch)
        new_model, _, loss = compiled(sharded, step.init(sharded), batch)
    colls = zoo.collectives(compiled, mesh=mesh)
    assert len(colls) == 1 and not colls[0].in_loop
    assert colls[0].bytes == tree_bytes(model) + 8
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(eqx.filter(new_model, eqx.is_array)))
    assert np.isfinite(loss)


# --- docs/models.md's table is this data ---

DOCS = pathlib.Path(__file__).parent.parent / "docs" / "models.md"
TABLE_START = "<!-- collectives table: generated from tests/data/preset_collectives.json (python tests/test_presets.py --docs) -->"
TABLE_END = "<!-- end collectives table -->"


def docs_table() -> str:
    """The markdown table of EXPECTED: per model and preset, collectives in and out of loops,
    counted by kind and mesh axes, with their total bytes."""

    def cell(rows, where):
        groups = collections.defaultdict(lambda: [0, 0])
        for row in rows:
            kind, at, axes, size, n = row.split()
            if at == where:
                groups[(kind, axes)][0] += int(n[1:])
                groups[(kind, axes)][1] += int(n[1:]) * int(size)
        return (
            "; ".join(
                f"{n} {kind}{'s' if n > 1 else ''} `{axes}` ({size:,} B)"
                for (kind, axes), (n, size) in sorted(groups.items())
            )
            or "—"
        )

    lines = ["| model | preset | mesh | in loops | outside loops |", "|---|---|---|---|---|"]
    for name, rows in EXPECTED.items():
        model, preset = re.fullmatch(
            r"(mlp|decoder\+lora|decoder\+qk_norm|decoder\+olmo2_norms|decoder\+pattern|decoder\+gemma2|decoder\+moe|decoder|encoder)-(.+)",
            name,
        ).groups()
        mesh = ",".join(f"{k}={v}" for k, v in preset_mesh(preset, N).shape.items())
        lines.append(f"| {model} | `{preset}` | {mesh} | {cell(rows, 'loop')} | {cell(rows, 'outside')} |")
    return "\n".join(lines)


def docs_text_table() -> str:
    text = DOCS.read_text()
    assert TABLE_START in text and TABLE_END in text, f"{DOCS} lost its table markers"
    return text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()


def test_docs_table_is_the_pinned_data():
    assert docs_text_table() == docs_table(), (
        f"docs/models.md's collectives table differs from the pinned data; run "
        f"`python tests/test_presets.py --docs` or paste:\n{docs_table()}"
    )
    assert set(EXPECTED) == {case_id(*c) for c in CASES if c[2] == "explicit"}


if __name__ == "__main__":
    import sys

    jax.config.update("jax_num_cpu_devices", 8)  # as tests/conftest.py: before the backend starts
    if "--pin" in sys.argv:  # recompile every case and rewrite the pinned file
        pinned = {case_id(*c): signature(run(*c)[2]) for c in CASES if c[2] == "explicit"}
        PINNED.write_text(json.dumps(pinned, indent=1) + "\n")
        print(f"rewrote {PINNED}; run with --docs to update docs/models.md")
    if "--docs" in sys.argv:  # reads EXPECTED as it was imported: run --pin and --docs apart
        text = DOCS.read_text()
        DOCS.write_text(text.replace(docs_text_table(), docs_table()))
        print(f"rewrote the table in {DOCS}")
