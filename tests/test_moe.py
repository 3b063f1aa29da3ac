"""Mixtures of experts: Mixtral and Qwen3-MoE both ways against transformers (logits, the
export bit for bit, greedy tokens, the router's load-balancing loss), what each refuses by
name, the two token dispatches, and the training step under `dp` (one gradient all-reduce
outside every loop; 2 devices' update = 1 device's)."""

import dataclasses

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
        _, choice = eqx.filter_jit(lambda m, t, k: m.with_router(t, mask=k))(model, jnp.asarray(t), jnp.asarray(mask))
        aux = zoo.nn.load_balancing_loss(choice.probs, choice.chosen, jnp.asarray(mask))
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


def test_sorted_dispatch_equals_dense_and_is_refused_under_a_mesh():
    """`ragged_dot` over tokens sorted by expert computes what the dense all-experts
    einsum does (the same products; the sums over experts in another order)."""
    dense = Transformer(_moe_config(), key=jax.random.key(0))
    grouped = Transformer(_moe_config(moe_dispatch="sorted"), key=jax.random.key(0))
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
    with pytest.raises(ValueError, match="SwiGLU experts"):
        _moe_config(activation="gelu")


def test_dp_step_has_one_gradient_all_reduce_outside_loops_and_equals_one_device():
    """The MoE decoder under `dp`, 2 devices, 2 microbatches: the compiled step's only
    collective is one all-reduce over `data`, outside every loop, carrying every gradient
    and the loss sums; its SGD update equals the single-device one within rounding."""
    model = Transformer(_moe_config(), key=jax.random.key(0))
    batch = lm_batch(jax.random.key(1), 8, vocab=32)
    lr = 0.5
    params, _ = eqx.partition(model, eqx.is_inexact_array)

    def mean_loss(p):
        total, count = zoo.models.next_token_loss(p, batch)
        return total.sum() / count.sum()

    loss, grads = eqx.filter_jit(jax.value_and_grad(mean_loss))(params)
    want = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    mesh = data_mesh(2)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(lr), microbatches=2, preset="dp")
        opt_state = step.init(sharded)
        compiled = step.compile(sharded, opt_state, batch)
        new_model, _, got_loss = compiled(sharded, opt_state, batch)
    colls = zoo.collectives(compiled)
    assert [(c.kind, c.in_loop, c.mesh_axes) for c in colls] == [("all-reduce", False, ("data",))], zoo.report(colls)
    trainable = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    assert colls[0].bytes - trainable in (4, 8), zoo.report(colls)
    sums = {"terms": 8 * 8, "depth": 2 * (2 * 6 + 1)}
    assert_rounding_close(got_loss, loss, **sums)
    start = jax.tree.leaves(params)
    step_size = max(largest(np.asarray(w, np.float64) - np.asarray(p)) for w, p in zip(jax.tree.leaves(want), start))
    for g, w in zip(jax.tree.leaves(eqx.filter(new_model, eqx.is_array)), jax.tree.leaves(want), strict=True):
        assert_rounding_close(g, w, **sums, scale=max(largest(w), step_size))
