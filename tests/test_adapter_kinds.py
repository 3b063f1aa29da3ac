"""The adapter kinds beyond plain LoRA against peft, both ways: DoRA (`LoraConfig(use_dora=True)`:
outputs both ways (a peft folder into zoo, a zoo folder into `PeftModel` and
`AutoPeftModel*`), merged weights against peft's `merge_and_unload`, gradients against
peft's autograd, on Llama, GPT-2 and BERT; a bfloat16 and an int8 frozen base;
merge/unmerge); PiSSA and OLoRA initialisations (the same branch and residual base from
the same weight; adapters both ways, as they are (the residual recomputed from the
original base on load) and converted to adapters of the original base
(`path_initial_model_for_weight_conversion`)); embedding and head LoRA; trainable tokens;
the clear errors of each."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
import transformers
from helpers import UNIT_ROUNDOFF, Reference, assert_as_accurate, largest
from test_peft import (
    BATCH,
    SEQ,
    TOKENS,
    assert_close,
    hf_folder,
    hf_outputs,
    is_adapter,
    no_peft_warnings,
    perturb,
)

import zoo
from zoo.lora import LoraConfig, add_lora, cast_frozen, load_adapter, merge, save_adapter, unload, unmerge

pytestmark = pytest.mark.numerics

TASK = {"llama": "CAUSAL_LM", "gpt2": "CAUSAL_LM", "bert": "FEATURE_EXTRACTION"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


# --------------------------------------------------------------------------- DoRA

# family → (transformers class, peft AutoPeftModel class, peft targets, zoo targets, gradient targets)
DORA_FAMILIES = {
    "llama": ("LlamaForCausalLM", "AutoPeftModelForCausalLM", "all-linear", ("q_proj", "v_proj", "down"), None),
    # c_attn (q | k | v fused) both ways; gradients on the unfused projections (peft's one
    # A of c_attn is zoo's three A's only where they are equal).
    "gpt2": ("GPT2LMHeadModel", "AutoPeftModelForCausalLM", ["c_attn", "c_fc"], ("c_attn", "c_proj"),
             ["c_fc", "c_proj"]),
    "bert": ("BertModel", "AutoPeftModelForFeatureExtraction", "all-linear", ("query", "value", "dense"), None),
}  # fmt: skip
TOLERANCE = 1e-5  # of the largest value: issue 27's bound
MEASURED: dict[str, float] = {}  # what docs/lora.md's table reports (`pytest -s` prints it)


@pytest.fixture(scope="module", autouse=True)
def report():
    """The largest differences measured, by kind (`pytest -s` shows them: docs/lora.md's table)."""
    yield
    for what, diff in sorted(MEASURED.items()):
        print(f"{what}: {diff:.1e}")


def relative(got, want, what: str, tolerance: float = TOLERANCE) -> float:
    """max|got − want| / max|want|, recorded under `what`, at most `tolerance`."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = largest(got - want) / largest(want)
    MEASURED[what] = max(diff, MEASURED.get(what, 0.0))
    assert diff <= tolerance, f"{what}: {diff:.3g} of the largest value > {tolerance}"
    return diff


@eqx.filter_jit
def _forward(model, tokens):
    return model(tokens)


def outputs(model):
    return np.asarray(_forward(model, jnp.asarray(TOKENS)))


def hf_run(model):
    out = model(input_ids=torch.tensor(TOKENS), attention_mask=torch.ones(BATCH, SEQ, dtype=torch.long))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


LOSS_WEIGHTS = np.random.default_rng(7).standard_normal((BATCH, SEQ, 64)).astype(np.float32)


def zoo_gradients(model, config):
    """The gradients of `sum(outputs · LOSS_WEIGHTS)` with respect to the adapter, as the
    tensors of a saved adapter (peft's names and layout)."""
    params, static = eqx.partition(model, zoo.lora.trainable(model, config))
    return eqx.combine(_gradients(params, static), static)


@eqx.filter_jit  # one program (op by op: ~100 small ones, and each eager call's scans compiled anew)
@jax.grad
def _gradients(params, static):
    out = eqx.combine(params, static)(jnp.asarray(TOKENS))
    return jnp.sum(out * LOSS_WEIGHTS[..., : out.shape[-1]])


def peft_gradients(model):
    """The same loss's gradients in peft (torch autograd), by adapter file key."""
    model.zero_grad()
    out = hf_run(model)
    (out * torch.tensor(LOSS_WEIGHTS[..., : out.shape[-1]])).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        if (
            "lora_" in name or "trainable_tokens_delta" in name
        ) and p.grad is not None:  # none for BERT's pooler: last_hidden_state skips it
            key = name.replace(".default", "")
            grads[key.removesuffix(".weight") if "magnitude" in key else key] = p.grad.numpy()
    return grads


def zoo_dora(base, targets, seed=1):
    """DoRA branches with every leaf non-trivial: A, B random; the magnitude moved off its init."""
    config = LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False, use_dora=True)
    model = add_lora(base, config, key=jax.random.key(seed))
    leaves = lambda m: [node.lora_magnitude_vector for node in _dora_layers(m)]
    rng = np.random.default_rng(seed)
    new = [v * (1 + 0.2 * rng.standard_normal(v.shape).astype(np.float32)) for v in leaves(model)]
    return eqx.tree_at(leaves, model, new), config


def _dora_layers(model):
    from zoo._tree import node_at

    return [node_at(model, p) for p, _ in zoo.lora.modules(model, zoo.lora.LoraLinear).values()]


def exported(model, folder):
    """The merged zoo model as Hugging Face writes it: file tensors by name."""
    zoo.hf.save_pretrained(model, folder)
    return safetensors.numpy.load_file(f"{folder}/model.safetensors")


def check_dora(family, root, tmp_path):
    cls, auto, peft_targets, zoo_targets, grad_targets = DORA_FAMILIES[family]
    folder = hf_folder(family, root)
    base = zoo.hf.from_pretrained(folder)
    hf_class = getattr(transformers, cls)

    # zoo → peft: PeftModel on the HF model, AutoPeftModel from the folder alone.
    model, config = zoo_dora(base, zoo_targets)
    save_adapter(model, config, tmp_path / "z")
    values = json.loads((tmp_path / "z/adapter_config.json").read_text())
    assert values["use_dora"] is True
    keys = safetensors.numpy.load_file(tmp_path / "z/adapter_model.safetensors")
    assert any(k.endswith(".lora_magnitude_vector") for k in keys)
    ours = outputs(model)
    assert not np.allclose(ours, outputs(base), atol=1e-3)  # the adapter does something
    with _no_warning() as record:
        opened = peft.PeftModel.from_pretrained(hf_class.from_pretrained(folder), tmp_path / "z")
        auto_model = getattr(peft, auto).from_pretrained(tmp_path / "z")
    no_peft_warnings(record)
    for name, m in (("PeftModel", opened), (auto, auto_model)):
        reference = hf_outputs(m)
        assert_close(ours, reference, f"{family} DoRA zoo → {name}")
        relative(ours, reference.f32, f"DoRA {family} outputs zoo → peft")

    # Merged weights: zoo's merge against peft's merge_and_unload, every tensor.
    ours_merged = exported(merge(model), tmp_path / "merged")
    theirs = {k: v.detach().numpy() for k, v in opened.merge_and_unload().state_dict().items()}
    compared = [k for k in ours_merged if k in theirs]
    assert len(compared) >= len(ours_merged) - 1, sorted(set(ours_merged) - set(theirs))
    for k in compared:
        relative(ours_merged[k], theirs[k], f"DoRA {family} merged weights")
    np.testing.assert_allclose(outputs(unmerge(merge(model, unload=False))), ours, rtol=0, atol=1e-5 * largest(ours))

    # peft → zoo.
    torch.manual_seed(3)
    made = peft.get_peft_model(
        hf_class.from_pretrained(folder),
        peft.LoraConfig(r=2, lora_alpha=8, target_modules=peft_targets, use_dora=True, task_type=TASK[family]),
    )
    perturb(made, 3, is_adapter)  # A, B and the magnitudes
    made.save_pretrained(tmp_path / "p")
    loaded, loaded_config = load_adapter(base, tmp_path / "p")
    assert loaded_config.use_dora
    reference = hf_outputs(made)
    assert_close(outputs(loaded), reference, f"{family} DoRA peft → zoo")
    relative(outputs(loaded), reference.f32, f"DoRA {family} outputs peft → zoo")
    save_adapter(loaded, loaded_config, tmp_path / "again")  # and back: the same model
    again, _ = load_adapter(base, tmp_path / "again")
    np.testing.assert_array_equal(outputs(again), outputs(loaded))

    # Gradients: zoo's against peft's autograd, every adapter tensor.
    if grad_targets is not None:
        made = peft.get_peft_model(
            hf_class.from_pretrained(folder),
            peft.LoraConfig(r=2, lora_alpha=8, target_modules=grad_targets, use_dora=True, task_type=TASK[family]),
        )
        perturb(made, 4, is_adapter)
        made.save_pretrained(tmp_path / "g")
        loaded, loaded_config = load_adapter(base, tmp_path / "g")
    compare_gradients(made, loaded, loaded_config, tmp_path / "grads", f"DoRA {family} gradients")


def compare_gradients(made, loaded, config, folder, what):
    """zoo's gradients of `loaded` against peft's autograd on `made` (the same adapter), every tensor."""
    theirs = peft_gradients(made)
    save_adapter(zoo_gradients(loaded, config), config, folder)
    ours = safetensors.numpy.load_file(folder / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        relative(ours[k], theirs[k], what)


def compare_opened(ours, adapter, hf_class, folder, auto, what, **options):
    """`ours` against the adapter folder opened by `PeftModel` (on the HF model in `folder`)
    and by `AutoPeftModel*` (`auto`), each as accurate as peft's own and within `relative`."""
    for name, m in (
        ("PeftModel", peft.PeftModel.from_pretrained(hf_class.from_pretrained(folder), adapter)),
        (auto, getattr(peft, auto).from_pretrained(adapter)),
    ):
        reference = hf_outputs(m)
        assert_close(ours, reference, f"{what}, zoo → {name}")
        relative(ours, reference.f32, what, **options)
    return m


class _no_warning:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        record = self._ctx.__enter__()
        warnings.simplefilter("always")
        return record

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def test_dora_llama_both_ways_merged_and_gradients(root, tmp_path):
    check_dora("llama", root, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_dora_family_both_ways_merged_and_gradients(family, root, tmp_path):
    check_dora(family, root, tmp_path)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_dora_on_a_narrow_frozen_base_matches_peft_on_that_base(dtype, root, tmp_path):
    """A bfloat16 or int8 frozen base (`cast_frozen`): zoo's outputs and merged weights
    equal peft's DoRA on the Hugging Face model holding the same (widened) base weights."""
    folder = hf_folder("llama", root)
    model, config = zoo_dora(zoo.hf.from_pretrained(folder), ("q_proj", "v_proj", "down"))
    narrow = cast_frozen(model, jnp.dtype(dtype), config=config)
    q = narrow.layers.layers.attention.q_proj
    assert q.lora_magnitude_vector.dtype == jnp.float32  # trained: kept float32
    assert isinstance(q.base, zoo.nn.QuantizedLinear) if dtype == "int8" else q.base.weight.dtype == jnp.bfloat16
    save_adapter(narrow, config, tmp_path / "a")
    zoo.hf.save_pretrained(unload(cast_frozen(narrow, jnp.float32, config=config)), tmp_path / "base")
    opened = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "a"
    )
    ours = outputs(narrow)
    relative(ours, hf_outputs(opened).f32, f"DoRA llama {dtype} base outputs zoo → peft")
    merged = exported(merge(narrow), tmp_path / "merged")
    theirs = {k: v.detach().numpy() for k, v in opened.merge_and_unload().state_dict().items()}
    for k in merged:
        if merged[k].dtype == np.float32:  # int8: the merged layer is float32, as peft's dequantised merge
            relative(merged[k], theirs[k], f"DoRA llama {dtype} base merged weights")
        else:  # bfloat16 stays bfloat16 (peft casts back to the weight's dtype too): one rounding apart
            rounded = theirs[k].astype(merged[k].dtype).astype(np.float32)
            assert largest(merged[k].astype(np.float32) - rounded) <= 2**-8 * largest(theirs[k]), k
    if dtype == "bfloat16":
        np.testing.assert_allclose(outputs(unmerge(merge(narrow, unload=False))), ours, atol=1e-2 * largest(ours))


def test_dora_errors_and_flag(root, tmp_path):
    folder = hf_folder("gpt2", root)
    base = zoo.hf.from_pretrained(folder)
    # Part of a fused module: peft's magnitude covers all of c_attn's outputs.
    model, config = zoo_dora(base, ("q_proj", "v_proj"))
    with pytest.raises(ValueError, match=r"DoRA branches on 2 of the 3 parts of transformer.h.0.attn.c_attn"):
        save_adapter(model, config, tmp_path / "part")
    # A DoRA adapter into a model whose branches are plain LoRA (and back).
    model, config = zoo_dora(base, ("c_attn",))
    save_adapter(model, config, tmp_path / "dora")
    plain = add_lora(base, LoraConfig(r=2, lora_alpha=4, target_modules=("c_attn",)), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"use_dora=True but this model's LoRA branches have use_dora=False"):
        load_adapter(plain, tmp_path / "dora")
    # The command line's --lora takes use_dora and writes it back.
    from zoo.train._text import lora_text, parse_lora

    parsed = parse_lora("r=4,use_dora=true", {})
    assert parsed.use_dora and "use_dora=true" in lora_text(parsed)
    assert parse_lora(lora_text(parsed), {}) == parsed
    with pytest.raises(Exception, match="use_dora must be true or false"):
        parse_lora("use_dora=maybe", {})


def test_dora_magnitude_is_placed_on_its_output_axis():
    from helpers import preset_mesh, tiny_decoder

    mesh, rules = preset_mesh("fsdp+tp", 8), zoo.rules("fsdp+tp")
    config = LoraConfig(r=2, target_modules=("q_proj", "o_proj"), use_dora=True)
    single = tiny_decoder(jax.random.key(0))
    placed = add_lora(zoo.shard(single, rules, mesh), config, key=jax.random.key(1))
    reference = add_lora(single, config, key=jax.random.key(1))
    layout = zoo.shard(eqx.filter_eval_shape(lambda: reference), rules, mesh)  # zoo.shard's placement, no copy
    for name in ("q_proj", "o_proj"):
        got, want, value = (getattr(m.layers.layers.attention, name).lora_magnitude_vector
                            for m in (placed, layout, reference))  # fmt: skip
        assert got.sharding == want.sharding, (name, got.sharding, want.sharding)
        np.testing.assert_allclose(got, value, rtol=1e-6)
    assert zoo.lora.trainable(placed, config).layers.layers.attention.q_proj.lora_magnitude_vector is True


# --------------------------------------------------------------------------- PiSSA and OLoRA

# family → (transformers class, AutoPeftModel class, zoo targets, peft targets, a target's zoo path, its HF module)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "AutoPeftModelForCausalLM", ("q_proj", "down"), ["q_proj", "down_proj"],
              lambda m: m.layers.layers.attention.q_proj, lambda h: h.model.layers[1].self_attn.q_proj),
    # peft's olora_init takes a Conv1D's [in, out] weight as if it were [out, in]: PiSSA only.
    "gpt2": ("GPT2LMHeadModel", "AutoPeftModelForCausalLM", ("c_fc", "c_proj"), ["c_fc", "c_proj"],
             lambda m: m.layers.layers.mlp.up, lambda h: h.transformer.h[1].mlp.c_fc),
    "bert": ("BertModel", "AutoPeftModelForFeatureExtraction", ("query", "value"), ["query", "value"],
             lambda m: m.layers.layers.attention.q_proj, lambda h: h.encoder.layer[1].attention.self.query),
}  # fmt: skip
# Adapters as they are apply to a residual each side recomputes by its own float32 SVD / QR.
AS_IS = 1e-4


def trained(model, seed=5):
    """`model` with its branches moved as training would (A and B, every layer)."""
    branches, rest = eqx.partition(model, zoo.lora.trainable(model))
    rng = np.random.default_rng(seed)
    moved = jax.tree.map(lambda x: x + 0.05 * largest(x) * rng.standard_normal(x.shape).astype(np.float32), branches)
    return eqx.combine(moved, rest)


def torch_weight(layer):
    """A torch layer's weight as zoo holds it, `[in, out]` (a Conv1D's is already)."""
    w = layer.weight.detach().numpy()
    return w if type(layer).__name__ == "Conv1D" else w.T


def float64_init(weight, init, scaling, r=2):
    """peft's PiSSA / OLoRA of a `[in, out]` weight in float64 (numpy): (A `[in, r]`, B `[r, out]`, residual)."""
    wt = weight.astype(np.float64).T
    if init == "pissa":
        v, s, uh = np.linalg.svd(wt, full_matrices=False)
        root = np.sqrt(s[:r] / scaling)
        a_t, b_t = root[:, None] * uh[:r], v[:, :r] * root[None]
    else:
        q, rr = np.linalg.qr(wt)
        a_t, b_t = rr[:r], q[:, :r]
    return a_t.T, b_t.T, weight - scaling * (b_t @ a_t).T


def check_init(family, init, root, tmp_path):
    cls, auto, zoo_targets, peft_targets, zoo_layer, hf_layer = FAMILIES[family]
    folder = hf_folder(family, root)
    hf_class = getattr(transformers, cls)
    original = zoo.hf.from_pretrained(folder)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=zoo_targets, init_lora_weights=init)
    initial = add_lora(original, config, key=jax.random.key(0))

    # The same branch and residual as peft's for the same weight (layer 1 of the stack).
    made = peft.get_peft_model(
        hf_class.from_pretrained(folder),
        peft.LoraConfig(r=2, lora_alpha=4, target_modules=peft_targets, init_lora_weights=init, task_type=TASK[family]),
    )
    ours, theirs = zoo_layer(initial), hf_layer(made.base_model.model)
    a, b = np.asarray(ours.lora_A[1]), np.asarray(ours.lora_B[1])
    a_ref, b_ref = theirs.lora_A.default.weight.detach().numpy().T, theirs.lora_B.default.weight.detach().numpy().T
    signs = np.sign(np.sum(a * a_ref, axis=0))  # singular vectors / QR columns: each up to a sign
    weight = torch_weight(hf_layer(hf_class.from_pretrained(folder)))
    exact = float64_init(weight, init, config.scaling)
    # The residual W - s·BA of a float32 SVD / QR is backward stable: within a modest multiple
    # of n·u·‖W‖₂ of the exact one (n the larger side), whichever library ran it; allowed: 8×.
    # peft's own error can be far smaller by luck: under `make test-numerics`' AVX2-only
    # kernels, Llama's 16×16 layer: peft 1.7e-7, zoo 2.0e-6 = 2.9·n·u·‖W‖₂.
    backward = 8 * max(weight.shape) * UNIT_ROUNDOFF * float(np.linalg.norm(weight.astype(np.float64), 2))
    # PiSSA's A and B are singular vectors scaled by √(σ/s): a backward error ε moves them by
    # up to ε / (the smallest gap between σ_1..σ_r+1) times that scale (Wedin's theorem).
    sv = np.linalg.svd(weight.astype(np.float64), compute_uv=False)
    vectors = backward / np.min(-np.diff(sv[: config.r + 1])) * np.sqrt(sv[0] / config.scaling)
    vectors = vectors if init == "pissa" else 0.0
    for value, peft_value, exact_value, what, floor in (
        (np.asarray(ours.base.weight[1]), torch_weight(theirs.base_layer), exact[2], "residual base", backward),
        (a * signs, a_ref, exact[0] * np.sign(np.sum(exact[0] * a_ref, axis=0)), "A", vectors),
        (b * signs[:, None], b_ref, exact[1] * np.sign(np.sum(exact[0] * a_ref, axis=0))[:, None], "B", vectors),
    ):
        # As accurate as peft's float32 decomposition (both are a float32 SVD / QR of the weight).
        assert_as_accurate(
            value, Reference(peft_value, exact_value), floor=floor, what=f"{init} {family} initial {what}"
        )
        relative(value, peft_value, f"{init} {family} initial A, B, residual base", tolerance=1e-3)
    np.testing.assert_allclose(outputs(initial), outputs(original), atol=1e-5 * largest(outputs(original)))

    # zoo → peft: as it is (peft decomposes the original base again), and converted.
    save_adapter(initial, config, tmp_path / "initial")
    model = trained(initial)
    save_adapter(model, config, tmp_path / "as_is")
    assert json.loads((tmp_path / "as_is/adapter_config.json").read_text())["init_lora_weights"] == init
    save_adapter(model, config, tmp_path / "converted", path_initial_model_for_weight_conversion=tmp_path / "initial")
    values = json.loads((tmp_path / "converted/adapter_config.json").read_text())
    assert values["init_lora_weights"] is True and values["r"] == 4 and values["lora_alpha"] == 8
    expected = outputs(model)
    assert not np.allclose(expected, outputs(original), atol=1e-3)
    opened = peft.PeftModel.from_pretrained(hf_class.from_pretrained(folder), tmp_path / "as_is")
    relative(expected, hf_outputs(opened).f32, f"{init} {family} outputs zoo → peft (as is)", tolerance=AS_IS)
    compare_opened(
        expected, tmp_path / "converted", hf_class, folder, auto, f"{init} {family} outputs zoo → peft (converted)"
    )
    # ... and back into zoo, onto the original base: as it is and converted.
    for folder_name in ("as_is", "converted"):
        loaded, _ = load_adapter(original, tmp_path / folder_name)
        relative(outputs(loaded), expected, f"{init} {family} zoo → zoo ({folder_name})", tolerance=AS_IS)

    # peft → zoo: as peft saves it (zoo decomposes the original base), and converted.
    torch.manual_seed(3)
    perturb(made, 3, is_adapter)
    made.save_pretrained(tmp_path / "peft_as_is")
    reference = hf_outputs(made)
    loaded, loaded_config = load_adapter(original, tmp_path / "peft_as_is")
    assert loaded_config.init_lora_weights == init
    # zoo's residual is its own float32 decomposition, peft's its own: they differ by as much as
    # each differs from the exact one (asserted above), so the outputs by a few times 1e-6.
    relative(outputs(loaded), reference.f32, f"{init} {family} outputs peft → zoo (as is)", tolerance=AS_IS)
    # peft's conversion needs its own initial adapter: a fresh model made from the same weights.
    fresh = peft.get_peft_model(
        hf_class.from_pretrained(folder),
        peft.LoraConfig(r=2, lora_alpha=4, target_modules=peft_targets, init_lora_weights=init, task_type=TASK[family]),
    )
    fresh.save_pretrained(tmp_path / "peft_initial")
    made.save_pretrained(
        tmp_path / "peft_converted", path_initial_model_for_weight_conversion=tmp_path / "peft_initial"
    )
    loaded, loaded_config = load_adapter(original, tmp_path / "peft_converted")
    assert loaded_config.r == 4 and loaded_config.init_lora_weights is True
    relative(outputs(loaded), reference.f32, f"{init} {family} outputs peft → zoo (converted)")


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_init_llama(init, root, tmp_path):
    check_init("llama", init, root, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,init", [("gpt2", "pissa"), ("bert", "pissa"), ("bert", "olora")])
def test_init_families(family, init, root, tmp_path):
    check_init(family, init, root, tmp_path)


def test_init_errors_and_flag(root, tmp_path):
    with pytest.raises((ValueError, TypeError), match="init_lora_weights"):
        LoraConfig(init_lora_weights="svd")
    with pytest.raises(ValueError, match=r"pissa_niter_K is a randomized SVD.*'pissa' computes the exact SVD"):
        LoraConfig(init_lora_weights="pissa_niter_4")  # type: ignore[arg-type]
    folder = hf_folder("gpt2", root)
    base = zoo.hf.from_pretrained(folder)
    # PiSSA / OLoRA decompose a float base: an int8 one is refused, saying what to do.
    config = LoraConfig(r=2, target_modules=("c_fc",), init_lora_weights="pissa")
    plain = add_lora(base, LoraConfig(r=2, target_modules=("c_fc",)), key=jax.random.key(0))
    int8 = zoo.lora.unload(zoo.lora.cast_frozen(plain, jnp.int8))
    with pytest.raises(ValueError, match="which is int8: add the branches to the float model"):
        add_lora(int8, config, key=jax.random.key(0))
    # Parts of a fused module: saved as they are, peft would decompose the fused weight.
    fused = LoraConfig(r=2, target_modules=("c_attn",), init_lora_weights="olora")
    model = add_lora(base, fused, key=jax.random.key(0))
    with pytest.raises(
        ValueError, match="parts of transformer.h.0.attn.c_attn.*path_initial_model_for_weight_conversion"
    ):
        save_adapter(model, fused, tmp_path / "fused")
    # Converted, with the initial model itself (its parts cannot be saved as they are).
    save_adapter(trained(model), fused, tmp_path / "fused", path_initial_model_for_weight_conversion=model)
    loaded, loaded_config = load_adapter(base, tmp_path / "fused")  # converted: rank 4 per part, the original base
    relative(outputs(loaded), outputs(trained(model)), "olora gpt2 c_attn converted, zoo → zoo")
    opened = peft.PeftModel.from_pretrained(transformers.GPT2LMHeadModel.from_pretrained(folder), tmp_path / "fused")
    relative(outputs(trained(model)), hf_outputs(opened).f32, "olora gpt2 outputs zoo → peft (c_attn, converted)")
    with pytest.raises(ValueError, match="cannot read .*save the adapter there right after add_lora"):
        save_adapter(model, fused, tmp_path / "x", path_initial_model_for_weight_conversion=tmp_path / "nowhere")
    # A peft adapter whose base peft changed in a way zoo cannot recompute.
    peft.get_peft_model(
        transformers.GPT2LMHeadModel.from_pretrained(folder),
        peft.LoraConfig(r=2, target_modules=["c_fc"], init_lora_weights="pissa_niter_2", task_type="CAUSAL_LM"),
    ).save_pretrained(tmp_path / "niter")
    with pytest.raises(ValueError, match="pissa_niter_2.*path_initial_model_for_weight_conversion"):
        load_adapter(base, tmp_path / "niter")
    # The command line's --lora takes init_lora_weights and writes it back.
    from zoo.train._text import lora_text, parse_lora

    parsed = parse_lora("r=4,init_lora_weights=pissa", {})
    assert parsed.init_lora_weights == "pissa" and parse_lora(lora_text(parsed), {}) == parsed
    assert parse_lora("init_lora_weights=true", {}).init_lora_weights is True
    with pytest.raises(Exception, match="init_lora_weights must be one of"):
        parse_lora("init_lora_weights=svd", {})


# --------------------------------------------------------------------------- embedding and head

# case → (family, zoo targets, peft targets, ensure_weight_tying, gradients compared)
EMBEDDING = {
    # Llama's untied head: a Linear branch on lm_head, an embedding branch on embed_tokens.
    "llama": ("llama", ["embed_tokens", "lm_head", "q_proj"], ["embed_tokens", "lm_head", "q_proj"], False, True),
    # GPT-2's head is the token embedding: tied, one weight (peft's ensure_weight_tying).
    "gpt2-tied": ("gpt2", ["wte", "lm_head", "c_fc"], ["wte", "lm_head", "c_fc"], True, False),
    # Only the embedding named: the tied head keeps scoring the base table, as in peft.
    "gpt2-input": ("gpt2", ["token_embedding", "c_fc"], ["wte", "c_fc"], False, True),
    "bert": ("bert", ["word_embeddings", "query"], ["word_embeddings", "query"], False, True),
}


def check_embedding(case, root, tmp_path):
    family, zoo_targets, peft_targets, tie, gradients = EMBEDDING[case]
    cls, auto = FAMILIES[family][:2]
    hf_class = getattr(transformers, cls)
    folder = hf_folder(family, root)
    base = zoo.hf.from_pretrained(folder)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=zoo_targets, init_lora_weights=False,
                        ensure_weight_tying=tie)  # fmt: skip
    model = trained(add_lora(base, config, key=jax.random.key(1)))
    assert isinstance(model.token_embedding if family != "bert" else model.embeddings.word_embeddings,
                      zoo.lora.LoraEmbedding)  # fmt: skip
    save_adapter(model, config, tmp_path / "z")
    tensors = safetensors.numpy.load_file(tmp_path / "z/adapter_model.safetensors")
    assert any(k.endswith(".lora_embedding_A") for k in tensors) and any(
        k.endswith(".lora_embedding_B") for k in tensors
    )
    values = json.loads((tmp_path / "z/adapter_config.json").read_text())
    assert values["ensure_weight_tying"] is tie
    ours = outputs(model)
    m = compare_opened(ours, tmp_path / "z", hf_class, folder, auto, f"embedding/head {case} outputs zoo → peft")
    # Merged: zoo's exported weights against peft's merge_and_unload (a tied head stays tied).
    merged = zoo.lora.merge(model)
    if tie:
        assert merged.lm_head is None  # still one weight
    ours_merged = exported(merged, tmp_path / "merged")
    theirs = {k: v.detach().numpy() for k, v in m.merge_and_unload().state_dict().items()}
    for k in ours_merged:
        if k not in theirs:
            continue
        if tie and k == "transformer.wte.weight":
            # peft 0.21.2 merges the tied table twice (the embedding's branch, then the head's tied
            # copy into the same Parameter): W + 2Δ, and its merged model's outputs change.
            # zoo merges the one weight once: its merged model computes the adapter's outputs.
            table = np.asarray(base.token_embedding.weight)[: theirs[k].shape[0]]
            relative(2 * (ours_merged[k] - table), theirs[k] - table, f"embedding/head {case} merged Δ (peft: 2Δ)")
            continue
        relative(ours_merged[k], theirs[k][: ours_merged[k].shape[0]], f"embedding/head {case} merged weights")
    if case != "gpt2-input":  # there, as in peft, merging the one table adapts the tied head too
        relative(outputs(merged), ours, f"embedding/head {case} merged model outputs vs unmerged")
    if tie:
        reopened = hf_class.from_pretrained(tmp_path / "merged")
        assert reopened.lm_head.weight.data_ptr() == reopened.transformer.wte.weight.data_ptr()  # the tie kept

    # peft → zoo.
    torch.manual_seed(3)
    made = peft.get_peft_model(
        hf_class.from_pretrained(folder),
        peft.LoraConfig(
            r=2, lora_alpha=8, target_modules=peft_targets, ensure_weight_tying=tie, task_type=TASK[family]
        ),
    )
    perturb(made, 3, is_adapter)
    if tie:  # perturbing each tied tensor once more moved the head's and the embedding's apart: re-tie
        made = peft.get_peft_model(
            hf_class.from_pretrained(folder),
            peft.LoraConfig(r=2, lora_alpha=8, target_modules=peft_targets, ensure_weight_tying=tie,
                            task_type=TASK[family]),
        )  # fmt: skip
        with torch.no_grad():
            for n, p in made.named_parameters():
                if "lora_embedding" in n:
                    p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    made.save_pretrained(tmp_path / "p")
    loaded, loaded_config = load_adapter(base, tmp_path / "p")
    if tie:  # peft's tied branches (transposed views) refuse the float64 copy: float32 only
        made.eval()
        with torch.no_grad():
            reference = hf_run(made).numpy()
    else:
        reference = hf_outputs(made)
        assert_close(outputs(loaded), reference, f"{case} embedding LoRA peft → zoo")
        reference = reference.f32
    relative(outputs(loaded), reference, f"embedding/head {case} outputs peft → zoo")
    if gradients:
        compare_gradients(made, loaded, loaded_config, tmp_path / "grads", f"embedding/head {case} gradients")


@pytest.mark.parametrize("case", ["llama", "gpt2-tied"])
def test_embedding_and_head_lora(case, root, tmp_path):
    check_embedding(case, root, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["gpt2-input", "bert"])
def test_embedding_lora_families(case, root, tmp_path):
    check_embedding(case, root, tmp_path)


def test_embedding_lora_errors(root):
    base = zoo.hf.from_pretrained(hf_folder("gpt2", root))
    with pytest.raises(ValueError, match=r"DoRA wraps Linear layers only, and 'token_embedding' is an Embedding"):
        add_lora(base, LoraConfig(r=2, target_modules=["wte", "c_fc"], use_dora=True), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"'pissa' decomposes Linear weights; 'token_embedding' is an Embedding"):
        add_lora(base, LoraConfig(r=2, target_modules=["wte"], init_lora_weights="pissa"), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"head is its token embedding: set ensure_weight_tying=True"):
        add_lora(base, LoraConfig(r=2, target_modules=["wte", "lm_head"]), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"the tied 'lm_head' is the token embedding; target it too"):
        add_lora(
            base, LoraConfig(r=2, target_modules=["c_fc", "lm_head"], ensure_weight_tying=True), key=jax.random.key(0)
        )
    # Trainable: the embedding's branch; the base table stays frozen.
    config = LoraConfig(r=2, target_modules=["wte"])
    train = zoo.lora.trainable(add_lora(base, config, key=jax.random.key(0)), config)
    assert train.token_embedding.lora_embedding_A is True and train.token_embedding.base.weight is False


# --------------------------------------------------------------------------- trainable tokens

TOKEN_IDS = [3, 9, 20]  # rows TOKENS uses


@pytest.mark.parametrize("family,targets", [("llama", ["q_proj"]), ("gpt2", ["c_fc"])])  # GPT-2: the tied head too
def test_trainable_tokens(family, targets, root, tmp_path):
    assert set(TOKEN_IDS) <= set(TOKENS.ravel().tolist())
    cls, auto = FAMILIES[family][:2]
    hf_class = getattr(transformers, cls)
    folder = hf_folder(family, root)
    base = zoo.hf.from_pretrained(folder)
    config = LoraConfig(r=2, target_modules=targets, init_lora_weights=False, trainable_token_indices=TOKEN_IDS)
    model = trained(add_lora(base, config, key=jax.random.key(1)))
    layer = model.token_embedding
    assert isinstance(layer, zoo.lora.TrainableTokens) and layer.tie_head == (family == "gpt2")
    np.testing.assert_array_equal(layer.trainable_tokens_original, np.asarray(base.token_embedding.weight)[TOKEN_IDS])
    assert zoo.lora.trainable(model, config).token_embedding.base.weight is False
    save_adapter(model, config, tmp_path / "z")
    tensors = safetensors.numpy.load_file(tmp_path / "z/adapter_model.safetensors")
    hf_name = zoo.lora.hf_module_name(base, "token_embedding")
    key = f"base_model.model.{hf_name}.token_adapter.trainable_tokens_delta"
    assert tensors[key].shape == (3, 16) and not any("lm_head" in k for k in tensors)  # only the listed rows
    ours = outputs(model)
    m = compare_opened(ours, tmp_path / "z", hf_class, folder, auto, f"trainable tokens {family} outputs zoo → peft")
    merged = zoo.lora.merge(model)
    theirs = {k: v.detach().numpy() for k, v in m.merge_and_unload().state_dict().items()}
    for k, value in exported(merged, tmp_path / "merged").items():
        relative(value, theirs[k], f"trainable tokens {family} merged weights")
    relative(outputs(merged), ours, f"trainable tokens {family} merged model outputs vs unmerged")
    # peft → zoo, and gradients against peft's autograd (the tied head's use included).
    torch.manual_seed(3)
    made = peft.get_peft_model(
        hf_class.from_pretrained(folder),
        peft.LoraConfig(r=2, lora_alpha=8, target_modules=targets, trainable_token_indices=TOKEN_IDS,
                        task_type="CAUSAL_LM"),
    )  # fmt: skip
    perturb(made, 3, lambda n: is_adapter(n) or "trainable_tokens_delta" in n)
    made.save_pretrained(tmp_path / "p")
    loaded, loaded_config = load_adapter(base, tmp_path / "p")
    assert loaded_config.trainable_token_indices == tuple(TOKEN_IDS)
    made.eval()
    with torch.no_grad():
        reference = hf_run(made).numpy()
    relative(outputs(loaded), reference, f"trainable tokens {family} outputs peft → zoo")
    compare_gradients(made, loaded, loaded_config, tmp_path / "grads", f"trainable tokens {family} gradients")


def test_trainable_tokens_errors(root):
    base = zoo.hf.from_pretrained(hf_folder("llama", root))
    with pytest.raises(
        ValueError, match=r"trainable_token_indices \[32, 40\] are out of range for the vocabulary of 32"
    ):
        add_lora(
            base, LoraConfig(target_modules=["q_proj"], trainable_token_indices=[1, 32, 40]), key=jax.random.key(0)
        )
    with pytest.raises((ValueError, TypeError), match="trainable_token_indices"):
        LoraConfig(trainable_token_indices=[1, 1])
    with pytest.raises(ValueError, match="trainable_token_indices and a LoRA branch on 'token_embedding' at once"):
        add_lora(base, LoraConfig(target_modules=["embed_tokens"], trainable_token_indices=[1]), key=jax.random.key(0))
    # The command line's --lora takes the new fields and writes them back.
    from zoo.train._text import lora_text, parse_lora

    parsed = parse_lora("targets=wte+lm_head,ensure_weight_tying=true,trainable_token_indices=3+9", {})
    assert parsed.trainable_token_indices == (3, 9) and parsed.ensure_weight_tying
    assert parse_lora(lora_text(parsed), {}) == parsed
    with pytest.raises(Exception, match="token ids joined by"):
        parse_lora("trainable_token_indices=a+b", {})
