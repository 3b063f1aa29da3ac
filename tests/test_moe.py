"""Mixtures of experts: Mixtral and Qwen3-MoE both ways against transformers (logits, the
export bit for bit, greedy tokens, the router's load-balancing loss), what each refuses by
name, the two token dispatches, the training step under `tp` and `ep` (one gradient
all-reduce outside every loop; the update = 1 device's; `dp` and `ep` on 4 devices are
pinned in tests/test_presets.py), and the router's load-balancing loss in the training
loss (= transformers' `outputs.loss`; per device and microbatch in the step)."""

import dataclasses
import functools
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
import torch
import transformers
from helpers import assert_rounding_close, data_mesh, largest, lm_batch
from test_families import SEQ, SMALL, VOCAB, _check, _hf_logits, _masks, _torch, forward
from test_generate import _hf_greedy

import zoo
from zoo.models import Transformer, TransformerConfig

# torch on one thread (conftest.torch_one_thread): its references are tiny models.
pytestmark = pytest.mark.usefixtures("torch_one_thread")

EXPERTS = {"num_experts_per_tok": 2}
CASES = {
    # Mixtral: top-2 of 4 experts, the top-2 weights renormalised.
    "mixtral": (transformers.MixtralConfig, SMALL | EXPERTS | {"num_local_experts": 4}),
    # Qwen3-MoE: q/k norms, head_dim 16 ≠ 32/4, experts 24 wide (intermediate_size 48 is its
    # dense width, unused), the top-2 weights as the softmax gives them (norm_topk_prob off).
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        SMALL | EXPERTS | {"num_experts": 4, "moe_intermediate_size": 24, "head_dim": 16, "norm_topk_prob": False},
    ),
}
# The load-balancing loss against transformers': sums over 2 layers x 24 tokens of products
# of a softmax (a few roundings each).
AUX_SUMS = {"terms": 2 * 3 * SEQ, "depth": 6}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each case as a tiny random transformers model on disk (weights perturbed)."""
    out = {}
    for i, (name, (cls, values)) in enumerate(CASES.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(cls(**values, attn_implementation="eager")).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        out[name] = directory
    return out


def _open_hf(directory):
    """The transformers model, its experts run one by one (its "eager" experts: torch's
    grouped matmul has no float64 kernel for the float64 reference)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(3, VOCAB, (3, SEQ)).astype(np.int32)


@eqx.filter_jit
def _router_loss(model, tokens, mask):
    """The load-balancing loss of the router's choices over the real tokens: one program
    (for both masks), not one per op."""
    _, choice = model.with_router(tokens, mask=mask)
    return zoo.nn.load_balancing_loss(choice.probs, choice.chosen, mask)


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(CASES))
def test_load_export_generate_and_router_loss_match_transformers(name, hf_dirs, tokens, tmp_path):
    model = zoo.hf.from_pretrained(hf_dirs[name])
    config = model.config
    assert (config.family, config.num_experts, config.num_experts_per_tok) == (name, 4, 2)
    assert config.norm_topk_prob == (name == "mixtral")
    zoo.hf.save_pretrained(model, tmp_path)
    hf, exported = _open_hf(hf_dirs[name]), _open_hf(tmp_path)  # the source, and zoo's export reopened
    assert type(exported) is type(hf)
    for kind, mask in _masks().items():
        t = np.where(mask, tokens, 0).astype(np.int32)
        got = forward(model, jnp.asarray(t), jnp.asarray(mask))
        diffs = {what: _check(got, _hf_logits(m, t, mask), mask, f"{name} {kind} {what}") for what, m in
                 (("load", hf), ("export", exported))}  # fmt: skip
        print(f"MAX DIFF {name} {kind}: " + " ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
        # The router's load-balancing loss over the real tokens: transformers' aux_loss.
        with torch.no_grad():
            want = hf(_torch(t), attention_mask=_torch(mask), output_router_logits=True).aux_loss.item()
        aux = _router_loss(model, jnp.asarray(t), jnp.asarray(mask))
        assert_rounding_close(aux, want, **AUX_SUMS, what=f"{name} {kind} aux_loss")
    # The export is the source's tensors again, bit for bit (one per expert, as transformers writes).
    source = safetensors.numpy.load_file(str(hf_dirs[name] / "model.safetensors"))
    written = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert sorted(written) == sorted(source)
    assert any(".experts.3." in k for k in written)
    for k in written:
        np.testing.assert_array_equal(written[k], source[k], err_msg=k)
    # Greedy decoding (a left-padded batch: the key/value cache, the decode loop) = transformers'.
    mask = _masks()["left"]
    prompts = np.where(mask, tokens, 0).astype(np.int32)
    np.testing.assert_array_equal(
        np.asarray(zoo.generate(model, prompts, mask=mask, max_new_tokens=4)), _hf_greedy(hf, prompts, mask, 4)
    )


@pytest.mark.parametrize("name", list(CASES))
def test_fused_expert_files_load_as_the_per_expert_ones(name, hf_dirs, tmp_path):
    """transformers 5's own layout (`save_original_format=False`: `mlp.experts.gate_up_proj`
    `[experts, 2·width, hidden]`, `mlp.experts.down_proj`; Mixtral's router as `mlp.gate`),
    which transformers reads too, loads into the same arrays as the per-expert files."""
    hf = _open_hf(hf_dirs[name])
    hf.save_pretrained(tmp_path, save_original_format=False)
    fused = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused and not any(".experts.0." in k for k in fused)
    got, want = (zoo.hf.from_pretrained(d) for d in (tmp_path, hf_dirs[name]))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _config(cls, **values):
    return cls(**values).to_dict()


@pytest.mark.parametrize(
    ("name", "values", "match"),
    [
        ("qwen3_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2.*decoder_sparse_step=1 and mlp_only_layers"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\].*one kind of layer"),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window=True.*set it false"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1.*set it to 0"),
    ],
)
def test_what_is_not_built_is_refused_by_name(name, values, match):
    cls, base = CASES[name]
    with pytest.raises(ValueError, match=match):
        zoo.hf.get_family(name).config_from_hf(_config(cls, **base | values))


def test_configs_both_ways_and_models_built_from_scratch_are_claimed():
    for name, (cls, values) in CASES.items():
        family = zoo.hf.get_family(name)
        config = family.config_from_hf(_config(cls, **values))
        written = family.config_to_hf(config)
        assert family.config_from_hf(written) == config
        assert zoo.hf.family_of(dataclasses.replace(config, family=None)).name == name
        assert cls(**written).to_dict()["num_experts_per_tok"] == 2  # transformers reads what zoo writes
    cls, values = CASES["mixtral"]
    moe = zoo.hf.get_family("mixtral").config_from_hf(_config(cls, **values))
    with pytest.raises(ValueError, match=r"num_experts=4 \(llama's feed-forward is dense; Mixtral and Qwen3-MoE"):
        zoo.hf.get_family("llama").config_to_hf(moe)
    dense = dataclasses.replace(moe, num_experts=None)
    assert zoo.hf.family_of(dataclasses.replace(dense, family=None)).name == "llama"
    with pytest.raises(ValueError, match="num_experts=None .*mixture of experts: set num_experts"):
        zoo.hf.get_family("mixtral").config_to_hf(dense)


def _moe_config(**overrides):
    values = dict(
        vocab_size=32, d_model=16, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=32, max_len=8,
        positions="rope", activation="swiglu", norm="rmsnorm", tie_embeddings=False, use_bias=False,
        num_experts=4, num_experts_per_tok=2, moe_mlp_dim=24,
    )  # fmt: skip
    return TransformerConfig(**values | overrides)


@functools.cache  # built once per file: the tests only read it
def _moe_model(**overrides):
    return Transformer(_moe_config(**overrides), key=jax.random.key(0))


def sgd_reference(model, batch, lr, trainable=eqx.is_inexact_array):
    """One device's mean next-token loss of `model` on `batch`, its `trainable` leaves
    (`eqx.partition`'s first part) and those leaves after an SGD step of rate `lr` (one
    program: the update too, not an op per leaf shape)."""
    params, frozen = eqx.partition(model, trainable)

    def mean_loss(p):
        total, count = zoo.models.next_token_loss(eqx.combine(p, frozen), batch)
        return total.sum() / count.sum()

    @eqx.filter_jit
    def sgd(p):
        loss, grads = jax.value_and_grad(mean_loss)(p)
        return loss, jax.tree.map(lambda w, g: w - lr * g, p, grads)

    loss, want = sgd(params)
    return loss, params, want


def test_sorted_dispatch_equals_dense_and_is_refused_under_a_mesh():
    """`ragged_dot` over tokens sorted by expert computes what the dense all-experts
    einsum does (the same products; the sums over experts in another order)."""
    dense, grouped = _moe_model(), _moe_model(moe_dispatch="sorted")
    batch = lm_batch(jax.random.key(1), 4, vocab=32)
    a = forward(dense, batch["tokens"], batch["mask"])
    b = forward(grouped, batch["tokens"], batch["mask"])
    assert_rounding_close(a, b, terms=48, depth=2 * 6 + 1)
    mesh = data_mesh(2)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="dispatch='sorted'.*Use dispatch='dense' under a mesh"):
        sharded = zoo.shard(grouped, zoo.rules("dp"), mesh)
        tokens = jax.device_put(batch["tokens"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
        forward(sharded, tokens, None)
    with pytest.raises(ValueError, match="moe_dispatch must be 'dense' or 'sorted'"):
        _moe_config(moe_dispatch="ragged")
    with pytest.raises(ValueError, match="SwiGLU experts: set activation='swiglu', got 'gelu'"):
        _moe_config(activation="gelu")
    with pytest.raises(ValueError, match="num_experts_per_tok=5 routes each token to more experts than the 4"):
        _moe_config(num_experts_per_tok=5)


# (preset, mesh): tp on data 2 x model 2, ep on 2 devices all on `model` (the experts split
# in two, the batch whole on each). dp (data 4) and ep on data 2 x model 2 are
# tests/test_presets.py's decoder+moe rows, pinned there.
LAYOUTS = {"tp": ("tp", (2, 2)), "ep": ("ep", (1, 2))}


@functools.cache  # one reference program for both layouts: the same model, batch and rate
def _one_device_step():
    """`(model, batch, lr, sgd_reference(...))` of the step tests."""
    model, batch, lr = _moe_model(), lm_batch(jax.random.key(1), 8, vocab=32), 0.5
    return model, batch, lr, sgd_reference(model, batch, lr)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step_has_one_gradient_all_reduce_outside_loops_and_equals_one_device(layout):
    """The MoE decoder under `tp` (data=2 x model=2: the experts' width split over `model`)
    and `ep` (data=1 x model=2: the stacked experts split over `model`, expert
    parallelism), 2 microbatches, checked against the preset's budget on its mesh: the
    compiled step's only reduction over `data` is one all-reduce outside every loop,
    carrying every gradient and the loss sums (none with one data device); the loop holds
    activation traffic over `model` only, and under `ep` nothing reduces a gradient over
    `model`; its SGD update equals the single-device one within rounding."""
    preset, (data, width) = LAYOUTS[layout]
    model, batch, lr, (loss, params, want) = _one_device_step()
    mesh = jax.make_mesh((data, width), ("data", "model"), devices=jax.devices()[: data * width])
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules(preset), mesh)
        if preset == "ep":
            assert jax.typeof(sharded.layers.layers.mlp.up.weight).sharding.spec[1] == "model"
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(lr), microbatches=2, preset=preset)
        opt_state = step.init(sharded)
        compiled = step.compile(sharded, opt_state, batch)  # raises if over the preset's budget
        new_model, _, got_loss = compiled(sharded, opt_state, batch)
    assert step.budget_verdict.startswith(f"within the {preset} budget"), step.budget_verdict
    colls = zoo.collectives(compiled)
    on_data = [(c.kind, c.in_loop, c.mesh_axes) for c in colls if "data" in c.mesh_axes]
    assert on_data == [("all-reduce", False, ("data",))] * (data > 1), zoo.report(colls)
    assert all(c.mesh_axes == ("model",) for c in colls if "data" not in c.mesh_axes), zoo.report(colls)
    if preset == "ep":
        assert colls and all(c.in_loop for c in colls), zoo.report(colls)
    sums = {"terms": 8 * 8, "depth": 2 * (2 * 6 + 1)}
    assert_rounding_close(got_loss, loss, **sums)
    start = jax.tree.leaves(params)
    step_size = max(largest(np.asarray(w, np.float64) - np.asarray(p)) for w, p in zip(jax.tree.leaves(want), start))
    for g, w in zip(jax.tree.leaves(eqx.filter(new_model, eqx.is_array)), jax.tree.leaves(want), strict=True):
        assert_rounding_close(g, w, **sums, scale=max(largest(w), step_size))


@pytest.mark.numerics
def test_attention_lora_both_ways_with_peft_and_expert_target_modules_refused(hf_dirs, tokens, tmp_path):
    """LoRA on a Mixtral's attention: zoo's adapter opened by peft, peft's loaded by zoo, the
    same logits; merged and exported, transformers opens it. Naming the experts in
    `target_modules` (they are 3-D parameters: peft's `target_parameters`,
    tests/test_expert_lora.py) is refused, never silently left untrained."""
    import peft

    from zoo.lora import LoraConfig, add_lora, load_adapter, save_adapter

    base = zoo.hf.from_pretrained(hf_dirs["mixtral"])
    mask = np.ones(tokens.shape, bool)
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = LoraConfig(r=2, lora_alpha=4, target_modules=attention, init_lora_weights=False)
    adapted = add_lora(base, config, key=jax.random.key(1))
    save_adapter(adapted, config, tmp_path / "z")
    opened = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "z", experts_implementation="eager").eval()
    _check(forward(adapted, tokens, mask), _hf_logits(opened, tokens, mask), mask, "mixtral attention LoRA zoo → peft")
    hf = _open_hf(hf_dirs["mixtral"])
    torch.manual_seed(3)
    # alpha 4, not zoo's default 8: zoo's scale must come from the file. The adapter is then
    # shaped as zoo's above: one compiled forward serves both.
    made = peft.get_peft_model(
        hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=attention, init_lora_weights=False)
    )
    made.save_pretrained(tmp_path / "p")
    loaded, _ = load_adapter(base, tmp_path / "p")
    assert len(zoo.lora.modules(loaded, zoo.lora.LoraLinear)) == 4
    want = _hf_logits(made.eval(), tokens, mask)
    _check(forward(loaded, tokens, mask), want, mask, "mixtral attention LoRA peft → zoo")
    zoo.hf.save_pretrained(zoo.lora.merge(loaded), tmp_path / "merged")
    _check(_hf_logits(_open_hf(tmp_path / "merged"), tokens, mask).f64, want, mask, "mixtral merged export")
    for targets in (["q_proj", "up"], ["w1"], ["down"]):
        with pytest.raises(ValueError, match=r"stacked expert projections .*layers\.layers\.mlp\..*target_parameters"):
            add_lora(base, LoraConfig(r=2, target_modules=targets), key=jax.random.key(1))
    assert "layers.layers.mlp.router" not in zoo.lora.modules(
        add_lora(base, LoraConfig(r=2, target_modules="all-linear"), key=jax.random.key(1)), zoo.lora.LoraLinear
    )


def test_serving_engine_decodes_as_generate_with_and_without_an_attention_adapter():
    """`zoo.serve.Engine` on a mixture of experts: a bare request and one with an attention
    LoRA adapter decode the tokens `zoo.generate` does with the base and the adapted model."""
    from zoo.serve import Engine, Request

    base = _moe_model(max_len=16)
    config = zoo.lora.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = zoo.lora.add_lora(base, config, key=jax.random.key(2))
    engine = Engine(base, slots=2, adapters={"a": adapted}, max_lora_rank=2)
    prompt = [3, 5, 7, 9]
    handles = {name: engine.submit(Request(prompt=prompt, max_tokens=5, adapter=name)) for name in (None, "a")}
    engine.run_until_done()
    for name, model in ((None, base), ("a", adapted)):
        want = np.asarray(zoo.generate(model, np.array([prompt]), max_new_tokens=5))[0, len(prompt) :]
        assert [t.id for t in handles[name].tokens] == want.tolist(), name


@pytest.mark.parametrize("name", list(CASES))
def test_training_loss_adds_the_router_loss_as_transformers(name, hf_dirs, tokens, tmp_path):
    """With `output_router_logits` (read from config.json, written back), `next_token_loss`
    is transformers' `outputs.loss` with labels: the mean next-token cross-entropy plus
    `router_aux_loss_coef` times `aux_loss` (one microbatch, one device: one group of
    rows); without it, the cross-entropy alone, as transformers' default."""
    on = {"output_router_logits": True, "router_aux_loss_coef": 0.3}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dirs[name], attn_implementation="eager", experts_implementation="eager", **on
    ).eval()
    mask = _masks()["right"]
    t = np.where(mask, tokens, 0).astype(np.int32)
    batch = {"tokens": jnp.asarray(t), "mask": jnp.asarray(mask)}
    with torch.no_grad():
        out = hf(_torch(t), attention_mask=_torch(mask), labels=_torch(np.where(mask, t, -100)))
    assert out.aux_loss.item() > 1.0  # the term is not negligible: 0.3 x aux_loss
    hf.save_pretrained(tmp_path)
    model = zoo.hf.from_pretrained(tmp_path)
    assert (model.config.output_router_logits, model.config.router_aux_loss_coef) == (True, 0.3)
    assert zoo.hf.get_family(name).config_to_hf(model.config)["output_router_logits"] is True
    loss = eqx.filter_jit(lambda m, b: [x.sum() for x in zoo.models.next_token_loss(m, b)])
    total, count = loss(model, batch)
    sums = {"terms": 3 * SEQ * VOCAB, "depth": 2 * 6 + 2}
    assert_rounding_close(total / count, out.loss.item(), **sums, what=f"{name} loss + coef * aux_loss")
    # The default (output_router_logits false): the cross-entropy alone, transformers' loss then.
    off = zoo.hf.from_pretrained(hf_dirs[name])
    assert not off.config.output_router_logits
    with torch.no_grad():
        plain = hf(_torch(t), attention_mask=_torch(mask), labels=_torch(np.where(mask, t, -100)),
                   output_router_logits=False).loss.item()  # fmt: skip
    total, count = loss(off, batch)
    assert_rounding_close(total / count, plain, **sums, what=f"{name} loss without the router's")


def _groups_reference(model, batch, devices, microbatches):
    """The step's loss with the router's term, on one device, from `load_balancing_loss`
    of each group of rows one device holds in one microbatch (the step's row order:
    device d's rows are the d-th block of the batch, microbatch m the m-th block of
    those), each weighted by its target count; and (auxiliary) the step's `aux_loss`
    metric: those groups' losses so weighted, without the coefficient."""
    tokens, mask = batch["tokens"], batch["mask"]
    logits, choice = model.with_router(tokens, mask=mask)
    nll = zoo.models.cross_entropy(logits[:, :-1], tokens[:, 1:])
    counts = mask[:, 1:].astype(jnp.float32)
    total, aux_total = jnp.sum(nll * counts), 0.0
    rows = tokens.shape[0] // (devices * microbatches)
    for d in range(devices):
        for m in range(microbatches):
            start = (d * microbatches + m) * rows
            group = slice(start, start + rows)
            aux = zoo.nn.load_balancing_loss(choice.probs[:, group], choice.chosen[:, group], mask[group])
            total = total + model.config.router_aux_loss_coef * aux * jnp.sum(counts[group])
            aux_total = aux_total + aux * jnp.sum(counts[group])
    return total / jnp.sum(counts), aux_total / jnp.sum(counts)


@functools.cache  # both presets split the batch over 2 data devices: one reference program
def _grouped_reference(devices):
    """`(model, batch, lr, params, loss, aux, want, plain)`: the router-loss model, its
    batch and rate, its trainable leaves, `_groups_reference`'s loss and aux with `devices`
    groups per microbatch, the leaves after its SGD step, and the summed cross-entropy of
    the same weights without the term."""
    # A weight far above transformers' 0.001, so that another grouping of the rows (the
    # whole microbatch, or the whole batch) moves the loss well past the rounding bound.
    model = _moe_model(output_router_logits=True, router_aux_loss_coef=5.0)
    batch = lm_batch(jax.random.key(1), 8, vocab=32)
    lr = 0.5
    params, static = eqx.partition(model, eqx.is_inexact_array)
    grouped = jax.value_and_grad(lambda p: _groups_reference(eqx.combine(p, static), batch, devices, 2), has_aux=True)

    @eqx.filter_jit
    def sgd(p):
        (loss, aux), grads = grouped(p)
        return loss, aux, jax.tree.map(lambda w, g: w - lr * g, p, grads)

    loss, aux, want = sgd(params)
    plain, _ = eqx.filter_jit(lambda m: [x.sum() for x in zoo.models.next_token_loss(m, batch)])(
        _moe_model()  # the same weights, the term off
    )
    return model, batch, lr, params, loss, aux, want, plain


@pytest.mark.parametrize(("preset", "devices"), [("dp", 2), ("ep", 2)])
def test_router_loss_per_device_keeps_one_all_reduce_and_equals_its_reference(preset, devices):
    """The router's term in the step with 2 microbatches: each data device's rows of each
    microbatch are one group (transformers' per-forward, per-device loss), so the compiled
    step's only collective over `data` is still the one all-reduce outside every loop (no
    statistics summed across devices in the loop; under `dp` nothing else, under `ep` on
    data 2 x model 2 the experts' traffic over `model` in the loop), and its loss and SGD
    update equal those of that loss computed group by group on one device (4 groups: 2
    data devices x 2 microbatches). Its fourth output, the `aux_loss` metric
    (`next_token_loss(..., metrics=True)`), rides in that one all-reduce and equals those
    groups' load-balancing losses weighted alike."""
    model, batch, lr, params, loss, aux, want, plain = _grouped_reference(devices)
    assert abs(float(loss) - float(plain) / float(batch["mask"][:, 1:].sum())) > 0.1  # the term is there
    width = 2 if preset == "ep" else 1
    mesh = jax.make_mesh((devices, width), ("data", "model"), devices=jax.devices()[: devices * width])
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules(preset), mesh)
        loss_fn = functools.partial(zoo.models.next_token_loss, metrics=True)
        step = zoo.TrainStep(loss_fn, optax.sgd(lr), microbatches=2, preset=preset)
        opt_state = step.init(sharded)
        compiled = step.compile(sharded, opt_state, batch)  # within the preset's budget, or raises
        new_model, _, got_loss, metrics = compiled(sharded, opt_state, batch)
    assert step.budget_verdict.startswith(f"within the {preset} budget"), step.budget_verdict
    assert abs(float(aux) - 2.0) < 1.0  # top-2 routing: the loss is about 2 when balanced
    assert_rounding_close(metrics["aux_loss"], aux, terms=2 * 8 * 8, depth=6)
    colls = zoo.collectives(compiled)
    on_data = [(c.kind, c.in_loop, c.mesh_axes) for c in colls if c.mesh_axes != ("model",)]
    assert on_data == [("all-reduce", False, ("data",))] * (devices > 1), zoo.report(colls)
    assert len(colls) > len(on_data) if preset == "ep" else len(colls) == len(on_data), zoo.report(colls)
    assert all(c.in_loop for c in colls if c.mesh_axes == ("model",)), zoo.report(colls)
    sums = {"terms": 8 * 8, "depth": 2 * (2 * 6 + 1) + 4}
    assert_rounding_close(got_loss, loss, **sums)
    start = jax.tree.leaves(params)
    step_size = max(largest(np.asarray(w, np.float64) - np.asarray(p)) for w, p in zip(jax.tree.leaves(want), start))
    for g, w in zip(jax.tree.leaves(eqx.filter(new_model, eqx.is_array)), jax.tree.leaves(want), strict=True):
        assert_rounding_close(g, w, **sums, scale=max(largest(w), step_size))


def test_zoo_train_refuses_ep_for_a_model_without_experts(tmp_path):
    """`--rules ep` splits a mixture of experts' experts over `model`; a dense model has
    none, so its `model` devices would repeat the same work: refused in one line (exit 2),
    before any step compiles."""
    from helpers import zoo_main

    flags = ["--rules", "ep", "--devices", "4", "--mesh", "data=2,model=2", "--steps", "1"]
    rc, _, err = zoo_main("train", "transformer", *flags, "--output", tmp_path / "run")
    assert rc == 2, err
    assert "--rules ep splits a mixture of experts' experts over 'model', but the transformer has no experts" in err
    assert "use dp, fsdp or tp" in err and len(err.strip().splitlines()) == 1


def test_a_training_run_logs_the_router_loss_per_step(tmp_path):
    """`zoo train` on a mixture of experts training its router's loss writes that loss per
    step as its own key (`aux_loss`, transformers' name) beside the training loss in
    metrics.jsonl. A run without the term (transformers' default) writes none: checked on
    the Mixtral run of tests/test_expert_lora.py::test_zoo_finetune_trains_expert_lora_that_peft_opens
    (its config.json leaves output_router_logits false), which trains one anyway."""
    from helpers import zoo_main
    from tiny_runs import TINY

    experts = "num_experts=4,moe_mlp_dim=24,activation=swiglu"
    out = tmp_path / "run"
    flags = ["--model-config", f"{experts},output_router_logits=true", *TINY, "--steps", "2", "--output", out]
    rc, _, err = zoo_main("train", "transformer", *flags)
    assert rc == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    # top-2 of 4 experts: about 2 when the router spreads the tokens evenly
    assert all(1.0 < r["aux_loss"] < 4.0 for r in train), train


def test_ep_for_a_dense_model_names_the_missing_experts_first(tmp_path, llama_dir):
    """`--rules ep` with the default mesh (no `model` axis) on a dense model: the error is
    that the model has no experts (what a mesh with a `model` axis would only lead to next),
    for a model from scratch and a dense Hugging Face folder alike; a mixture of experts
    still hears about the mesh."""
    from helpers import zoo_main

    for args in (["train", "transformer"], ["finetune", "transformer", "--init", llama_dir]):
        rc, _, err = zoo_main(*args, "--rules", "ep", "--steps", "1", "--output", tmp_path / "run")
        assert rc == 2 and "has no experts" in err and "use dp, fsdp or tp" in err and "lacks" not in err, err
    moe = ["train", "transformer", "--model-config", "num_experts=4,activation=swiglu", "--rules", "ep"]
    rc, _, err = zoo_main(*moe, "--steps", "1", "--output", tmp_path / "m")
    assert rc == 2 and "lacks 'model'" in err, err
    # The axes ep does use are named: its experts lie on `model` (an `expert` axis is a guess).
    rc, _, err = zoo_main(*moe, "--devices", "2", "--mesh", "data=1,expert=2", "--output", tmp_path / "m")
    assert rc == 2 and "or pick rules that use them (--rules ep splits over ['data', 'model'])" in err, err
