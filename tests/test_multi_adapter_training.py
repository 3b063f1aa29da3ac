"""Several adapters trained in one step over one frozen base (issue 27 item 5): each row
of the batch trains its own adapter (`zoo.lora.routed`), equal to training each adapter
alone on its own rows; saved as one peft folder per adapter."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_rounding_close, data_mesh, largest, lm_batch, tiny_decoder

import zoo
from zoo.lora import LoraConfig, adapter, adapter_norms, add_lora, clip_per_adapter, routed, stack_adapters, trainable

# Three adapters of different ranks, scalings and targets (every leaf perturbed:
# init_lora_weights=False gives B random too).
CONFIGS = {
    "a": LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), init_lora_weights=False),
    "b": LoraConfig(r=2, lora_alpha=3, target_modules=("down", "q_proj"), init_lora_weights=False),
    "c": LoraConfig(r=3, lora_alpha=6, target_modules="all-linear", init_lora_weights=False),
}
BATCH, DEVICES, MICRO = 12, 2, 2
LR = 0.1  # 0.5 is past where this tiny model's 10 SGD steps stay well-conditioned
# Rounding (helpers.rounding_bound) as tests/test_lora.py's tiny decoder: the loss and
# gradient sums run over one step's 12 x 8 tokens, 2 layers of ~6 chained sums plus the head.
GRADIENTS = {"terms": BATCH * 8, "depth": 2 * (2 * 6 + 1)}


@functools.cache
def singles():
    base = tiny_decoder(jax.random.key(0))
    return {n: add_lora(base, c, key=jax.random.key(i + 1)) for i, (n, c) in enumerate(CONFIGS.items())}


def batches(steps: int) -> list[dict[str, np.ndarray]]:
    """`steps` batches, each row's adapter drawn at random (every adapter present in each,
    with uneven counts of rows and of tokens)."""
    rng = np.random.default_rng(0)
    out = []
    for t in range(steps):
        b = {k: np.asarray(v) for k, v in lm_batch(jax.random.key(100 + t), BATCH).items()}
        index = np.concatenate([np.arange(3), rng.integers(0, 3, BATCH - 3)])
        b["adapter"] = rng.permutation(index).astype(np.int32)
        b["adapter_norm"] = adapter_norms(b["adapter"], b["mask"][:, 1:].sum(axis=1), len(CONFIGS))
        out.append(b)
    return out


def k_run(optimizer, steps: int):
    """All adapters in one step on DEVICES devices x MICRO microbatches."""
    model = stack_adapters(singles())
    mesh = data_mesh(DEVICES)
    with jax.set_mesh(mesh):
        model = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(routed(zoo.models.next_token_loss), optimizer, microbatches=MICRO,
                             trainable=trainable(model), preset="dp")  # fmt: skip
        opt = step.init(model)
        models, losses = [], []
        for b in batches(steps):
            model, opt, loss = step(model, opt, b)
            models.append(model)
            losses.append(float(loss))
    return models, losses


def alone_run(name: str, optimizer, steps: int):
    """Adapter `name` alone, on its own rows of each batch, one device, one microbatch."""
    model = singles()[name]
    k = list(CONFIGS).index(name)
    step = zoo.TrainStep(zoo.models.next_token_loss, optimizer, trainable=trainable(model))
    opt = step.init(model)
    models, losses = [], []
    for b in batches(steps):
        # Its rows, then the others' as padding (mask 0: no target counts): one shape, one compile.
        order = np.argsort(b["adapter"] != k, kind="stable")
        rows = {"tokens": b["tokens"][order], "mask": b["mask"][order] & (b["adapter"][order] == k)[:, None]}
        model, opt, loss = step(model, opt, rows)
        models.append(model)
        losses.append(float(loss))
    return models, losses


OPTIMIZERS = {
    "sgd": (lambda: optax.sgd(LR), lambda: optax.sgd(LR)),
    # A limit below the gradients' norms: every step clips each adapter at its own norm.
    "clip+sgd": (lambda: optax.chain(clip_per_adapter(0.05), optax.sgd(LR)),
                 lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(LR))),
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), lambda: optax.adamw(1e-2, weight_decay=0.1)),
}  # fmt: skip
# ~100 s each on 2 cores: AdamW (elementwise, as SGD) runs with the slow tests.
OPTIMIZER_CASES = ["sgd", "clip+sgd", pytest.param("adamw", marks=pytest.mark.slow)]


STEPS = 10
DIFFS: dict[str, float] = {}  # the measured differences, printed with -s


@pytest.mark.numerics
@pytest.mark.parametrize("opt", OPTIMIZER_CASES)
def test_k_adapters_in_one_step_equal_each_adapter_trained_alone(opt):
    """SGD (and per-adapter clipping, and AdamW, elementwise: its moments stacked per
    adapter), after 1 and after 10 steps: each adapter of the K-adapter run (2 devices x
    2 microbatches) equals that adapter trained alone on its rows (one device), within
    float32 rounding; the step's loss is the sum of the adapters' own losses."""
    together, losses = k_run(OPTIMIZERS[opt][0](), STEPS)
    alone_losses = np.zeros(STEPS)
    for name in CONFIGS:
        alone, own = alone_run(name, OPTIMIZERS[opt][1](), STEPS)
        alone_losses += own
        for steps in (1, STEPS):
            got = eqx.filter(adapter(together[steps - 1], name), trainable(alone[0]))
            want = eqx.filter(alone[steps - 1], trainable(alone[0]))
            # Each step adds one gradient's rounding (lr x it, below the adapters' scale).
            assert_tree_rounding_close(got, want, terms=GRADIENTS["terms"], depth=steps * GRADIENTS["depth"],
                                       what=f"{opt} {steps} steps, adapter {name}")  # fmt: skip
            diff = max(
                largest(np.asarray(g) - np.asarray(w)) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))
            )
            DIFFS[f"{opt}/{steps}/{name}"] = diff
    print({k: f"{v:.2g}" for k, v in DIFFS.items() if k.startswith(opt)})
    np.testing.assert_allclose(losses, alone_losses, rtol=1e-5)


def test_clip_per_adapter_clips_each_adapter_at_its_own_norm():
    # A gradient of ones on every adapter's own entries (zero in the padding, as real ones).
    ones = {
        n: jax.tree.map(lambda x: jnp.ones_like(x) if eqx.is_inexact_array(x) else x, m) for n, m in singles().items()
    }
    model = stack_adapters(ones)
    params = eqx.filter(model, trainable(model))
    grads = params
    clipped, _ = clip_per_adapter(1.0).update(grads, clip_per_adapter(1.0).init(params))
    for name in CONFIGS:
        norm = optax.tree.norm(eqx.filter(adapter(clipped, name), eqx.is_array))
        assert abs(float(norm) - 1.0) < 1e-6, (name, float(norm))
    with pytest.raises(ValueError, match="outside the stacked adapters"):
        clip_per_adapter(1.0).update({"head": jnp.ones(3)}, optax.EmptyState())


def test_adapter_norms_weigh_each_adapter_by_its_own_count():
    norms = adapter_norms(np.array([0, 0, 1, -1, 2]), np.array([3.0, 1.0, 2.0, 4.0, 0.0]), 3)
    # total 10: adapter 0 counts 4, adapter 1 counts 2, adapter 2 counts nothing, -1 the bare base.
    np.testing.assert_array_equal(norms, np.array([2.5, 2.5, 5.0, 0.0, 0.0], np.float32))
    with pytest.raises(ValueError, match="out of range"):
        adapter_norms(np.array([0, 3]), None, 3)
    with pytest.raises(ValueError, match="no 'adapter' field"):
        routed(zoo.models.next_token_loss)(stack_adapters(singles()), {"tokens": np.zeros((2, 8), np.int32)})


def test_pinned_k_adapter_steps_reduce_all_k_adapters_once_and_nothing_of_the_base():
    """tests/data/step_collectives.json's 3-adapter steps (recompiled and compared by
    tests/test_compiled_steps.py): under dp one all-reduce outside every loop, carrying
    three times the one-adapter step's gradient bytes (same targets and rank) plus the
    loss's 8 B; under fsdp-once no reduction in a loop, the adapters' bytes and scalars."""
    import json
    from pathlib import Path

    pinned = json.loads((Path(__file__).parent / "data" / "step_collectives.json").read_text())
    one = pinned["transformer+lora/dp/data=8/explicit"]
    dp = pinned["transformer+3adapters/dp/data=8/explicit"]
    assert len(one) == 1 and len(dp) == 1 and not dp[0]["in_loop"] and dp[0]["kind"] == "all-reduce"
    adapter_bytes = one[0]["bytes"] - 8  # the inspect LoRA's trainable bytes
    assert dp[0]["bytes"] == 3 * adapter_bytes + 8
    once = pinned["transformer+3adapters/fsdp-once/data=8/explicit"]
    reduces = [r for r in once if r["kind"] in ("all-reduce", "reduce-scatter")]
    assert not [r for r in once if r["in_loop"]]
    # + the loss's 8 B and the per-adapter norms' partial sums (split gradients: 3 x 8 B)
    assert sum(r["bytes"] for r in reduces) == 3 * adapter_bytes + 8 + 3 * 8


@pytest.mark.numerics
def test_each_adapter_saves_as_its_own_peft_folder_with_the_same_outputs(tmp_path):
    """Two adapters of different configs on a tiny random Llama (transformers): each
    `save_adapter(adapter(model, name), config, folder)` opens in peft
    (`PeftModel.from_pretrained`) with the outputs zoo's routed rows of that adapter give."""
    import peft
    import transformers
    from test_peft import TOKENS, assert_close, hf_folder, hf_outputs

    folder = hf_folder("llama", str(tmp_path / "hf"))
    base = zoo.hf.from_pretrained(folder)
    configs = {
        "q": LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), init_lora_weights=False),
        "all": LoraConfig(r=2, lora_alpha=3, target_modules="all-linear", init_lora_weights=False),
    }
    model = stack_adapters({n: add_lora(base, c, key=jax.random.key(i)) for i, (n, c) in enumerate(configs.items())})
    forward = eqx.filter_jit(lambda m, tokens, index: zoo.lora.route(m, index)(tokens))
    for k, (name, config) in enumerate(configs.items()):
        zoo.lora.save_adapter(adapter(model, name), config, tmp_path / name)
        ours = np.asarray(forward(model, jnp.asarray(TOKENS), jnp.full(len(TOKENS), k, jnp.int32)))
        hf = transformers.LlamaForCausalLM.from_pretrained(folder)
        opened = peft.PeftModel.from_pretrained(hf, tmp_path / name)
        assert_close(ours, hf_outputs(opened), f"adapter {name} in peft")
