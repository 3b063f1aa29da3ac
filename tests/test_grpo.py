"""GRPO's objective (issue 47 items 1-2): each loss type equals TRL 1.16's own loss code
(`GRPOTrainer._compute_loss`) on the same model, completions, advantages and old /
reference log-probabilities; the advantages equal TRL's formula; and the loss, a global
sum over a global count, gives the one-device gradients on any microbatches and devices
with one gradient all-reduce outside every loop."""

from __future__ import annotations

import contextlib
import functools
import types
from collections import defaultdict

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import data_mesh, max_abs_diff, tree_allclose
from test_peft import DECODER

import zoo

PROMPT, COMPLETION, ROWS, VOCAB = 3, 6, 6, 32
LLAMA = {**DECODER, "max_position_embeddings": PROMPT + COMPLETION}
TEMPERATURE = 0.7


def rollout(seed=0, rows=ROWS, prompt=PROMPT, completion=COMPLETION, vocab=VOCAB):
    """Prompts of `prompt` tokens, completions of 1..`completion` tokens right-padded with 0
    (as TRL lays them out: `prompt_ids`, `completion_ids`, `completion_mask`), and random
    advantages."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, vocab, (rows, prompt))
    lengths = rng.integers(1, completion + 1, rows)
    lengths[0] = completion  # one full-length completion
    mask = (np.arange(completion)[None] < lengths[:, None]).astype(np.int64)
    completions = np.where(mask == 1, rng.integers(1, vocab, (rows, completion)), 0)
    return {"prompt_ids": prompts, "completion_ids": completions, "completion_mask": mask,
            "advantages": rng.normal(size=rows).astype(np.float32)}  # fmt: skip


def zoo_batch(r, old=None, ref=None):
    """TRL's rollout `r` in zoo's GRPO layout: one row of prompt then completion, the
    log-probabilities at zoo's positions (position t scores token t + 1)."""
    rows, prompt = r["prompt_ids"].shape
    batch = {
        "tokens": np.concatenate([r["prompt_ids"], r["completion_ids"]], axis=1).astype(np.int32),
        "completion": np.concatenate([np.zeros_like(r["prompt_ids"]), r["completion_mask"]], axis=1).astype(np.int32),
        "advantages": r["advantages"],
    }
    for name, logps in (("old_logps", old), ("ref_logps", ref)):
        if logps is not None:
            full = np.zeros((rows, batch["tokens"].shape[1] - 1), np.float32)
            full[:, prompt - 1 :] = logps
            batch[name] = full
    return {k: jnp.asarray(v) for k, v in batch.items()}


# --------------------------------------------------------------------------- TRL's loss code


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the peft LoRA Llama with TRL's fused head at TEMPERATURE, the same in zoo)."""
    pytest.importorskip("torch")
    from helpers import peft_lora_llama

    return peft_lora_llama(
        tmp_path_factory.mktemp("grpo"), LLAMA, temperature=TEMPERATURE, outputs=("log_probs", "entropy")
    )


class _Accelerator:
    device = "cpu"
    num_processes = 1
    is_main_process = True
    autocast = staticmethod(contextlib.nullcontext)

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = reduce = staticmethod(lambda x, reduction=None: x)


def trl_trainer(peft_model, **settings):
    """A stand-in `self` for TRL 1.16's `GRPOTrainer` methods: the settings `_compute_loss`
    reads, in eval mode (no gradient accumulation)."""
    from trl import GRPOTrainer

    s = {"loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "importance_sampling_level": "token",
         "max_completion_length": 512, "delta": None, "use_bias_correction_kl": True} | settings  # fmt: skip
    trainer = types.SimpleNamespace(
        model=peft_model, accelerator=_Accelerator(), aux_loss_enabled=False, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, use_vllm=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, loss_type=s["loss_type"], beta=s["beta"], epsilon_low=s["epsilon"],
        epsilon_high=s["epsilon_high"] if s["epsilon_high"] is not None else s["epsilon"],
        importance_sampling_level=s["importance_sampling_level"], max_completion_length=s["max_completion_length"],
        args=types.SimpleNamespace(delta=s["delta"], use_bias_correction_kl=s["use_bias_correction_kl"]),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )  # fmt: skip
    trainer._get_per_token_logps_and_entropies = GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer)
    return trainer


def trl_logps(peft_model, r, *, adapters=True):
    """TRL's per-token completion log-probabilities `[rows, completion]` of `r`, through
    its own `_get_per_token_logps_and_entropies` (the fused head at TEMPERATURE); with
    `adapters=False`, of the base (TRL's reference for a peft model)."""
    import torch

    trainer = trl_trainer(peft_model)
    ids = torch.tensor(np.concatenate([r["prompt_ids"], r["completion_ids"]], axis=1))
    mask = torch.tensor(np.concatenate([np.ones_like(r["prompt_ids"]), r["completion_mask"]], axis=1))
    context = contextlib.nullcontext() if adapters else peft_model.disable_adapter()
    with torch.no_grad(), context:
        logps, _, _ = trainer._get_per_token_logps_and_entropies(peft_model, ids, mask, r["completion_ids"].shape[1])
    return logps.numpy()


def trl_loss(peft_model, r, old, ref, **settings):
    """TRL 1.16's `GRPOTrainer._compute_loss` itself on rollout `r`: (loss, logged metrics)."""
    import torch
    from trl import GRPOTrainer

    trainer = trl_trainer(peft_model, **settings)
    inputs = {
        "prompt_ids": torch.tensor(r["prompt_ids"]), "prompt_mask": torch.ones_like(torch.tensor(r["prompt_ids"])),
        "completion_ids": torch.tensor(r["completion_ids"]), "completion_mask": torch.tensor(r["completion_mask"]),
        "advantages": torch.tensor(r["advantages"]),
        "num_items_in_batch": torch.tensor(float(r["completion_mask"].sum())),
    }  # fmt: skip
    if old is not None:
        inputs["old_per_token_logps"] = torch.tensor(old)
    if ref is not None:
        inputs["ref_per_token_logps"] = torch.tensor(ref)
    with torch.no_grad():
        loss = GRPOTrainer._compute_loss(trainer, peft_model, inputs)
    return float(loss), {k: v[0] for k, v in trainer._metrics["eval"].items()}


LOSS_CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo+kl": dict(loss_type="bnpo", beta=0.04),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=8),
    "dapo+clip-higher+kl": dict(loss_type="dapo", beta=0.04, epsilon_high=0.28),
    "gspo+kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "dapo+delta+kl-uncorrected": dict(loss_type="dapo", delta=1.1, beta=0.1, use_bias_correction_kl=False),
}


# Each loss type on a reused rollout; on policy (ratio 1) once with the KL and once without.
TRL_CASES = [(case, True) for case in LOSS_CASES] + [("grpo", False), ("dapo+clip-higher+kl", False)]


@pytest.mark.numerics
@pytest.mark.parametrize(
    "case,reused", TRL_CASES, ids=[f"{c}-{'old-logps' if r else 'on-policy'}" for c, r in TRL_CASES]
)
def test_each_loss_type_equals_trls(models, case, reused):
    """On a rollout reused over updates (old log-probabilities moved by up to ±0.5 nats, so
    ratios leave the clip range both ways) and on policy (no old log-probabilities: ratio
    1). The KL's reference is the base: TRL's `disable_adapter`, zoo's
    `zoo.lora.disabled_adapters` inside the loss (and, in one case, log-probabilities
    computed once and given in the batch)."""
    peft_model, lora = models
    settings = LOSS_CASES[case]
    r = rollout(seed=1)
    now = trl_logps(peft_model, r)
    old = None
    if reused:
        old = (now + np.random.default_rng(2).uniform(-0.5, 0.5, now.shape) * r["completion_mask"]).astype(np.float32)
    ref = trl_logps(peft_model, r, adapters=False) if settings.get("beta") else None
    want_loss, want = trl_loss(peft_model, r, old, ref, **settings)

    ours = {k if k != "use_bias_correction_kl" else "kl_correction": v for k, v in settings.items()}
    objective = zoo.models.GRPOLoss(**ours, temperature=TEMPERATURE, reference=zoo.lora.disabled_adapters)
    got = jax.jit(objective.metrics)(lora, zoo_batch(r, old=old))
    assert abs(float(got["loss"]) - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (float(got["loss"]), want_loss)
    for name in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
        assert (name in got) == (name in want), name
        if name in want:
            assert abs(float(got[name]) - want[name]) <= 1e-5, (name, float(got[name]), want[name])
    if reused:
        assert want["clip_ratio/region_mean"] > 0  # the clipping is exercised, not only the identity
    # The reference given as log-probabilities computed once is the in-loss reference.
    if ref is not None and case == "bnpo+kl":
        given = jax.jit(objective.metrics)(lora, zoo_batch(r, old=old, ref=ref))
        assert abs(float(given["loss"]) - want_loss) <= 1e-5 * max(1.0, abs(want_loss))


def test_the_log_probabilities_are_trls_at_the_sampling_temperature(models):
    peft_model, lora = models
    r = rollout(seed=3)
    objective = zoo.models.GRPOLoss(temperature=TEMPERATURE)
    ours = np.asarray(jax.jit(objective.token_logps)(lora, zoo_batch(r)["tokens"]))[:, PROMPT - 1 :]
    want = trl_logps(peft_model, r)
    mask = r["completion_mask"] == 1
    assert np.max(np.abs(ours[mask] - want[mask])) <= 1e-5
    at_one = np.asarray(jax.jit(zoo.models.GRPOLoss().token_logps)(lora, zoo_batch(r)["tokens"]))[:, PROMPT - 1 :]
    assert np.max(np.abs(at_one[mask] - want[mask])) > 1e-2  # the temperature matters


# --------------------------------------------------------------------------- advantages


def trl_advantages(rewards_per_func, weights, num_generations, scale_rewards):
    """TRL 1.16's advantage block of `_generate_and_score_completions`
    (`multi_objective_aggregation="sum_then_normalize"`), its lines on torch tensors, with
    its own `nanstd`."""
    import torch
    from trl.trainer.utils import nanstd

    rewards_per_func = torch.tensor(rewards_per_func)
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0).numpy(), rewards.numpy()


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_equal_trls(scale_rewards):
    pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    per_func = rng.normal(size=(12, 2)).astype(np.float32)
    per_func[1, 0] = np.nan  # one function does not apply to one completion
    per_func[5] = np.nan  # no function scores this completion
    per_func[8:12, 1] = 1.0  # a group whose second reward is constant
    weights = [1.0, 0.5]
    got, total = zoo.models.group_advantages(per_func, 4, weights=weights, scale_rewards=scale_rewards)
    want, want_total = trl_advantages(per_func, weights, 4, scale_rewards)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.isnan(total), np.isnan(want_total))
    assert got[5] == 0.0 and np.all(np.abs(got[:4]) > 0)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((np.zeros(6), 1), {}, "num_generations must be an int >= 2"),
        ((np.zeros(7), 2), {}, "a multiple of num_generations 2, got shape \\(7, 1\\)"),
        ((np.zeros((4, 2)), 2), {"weights": [1.0]}, "one number per reward function \\(2\\)"),
        ((np.zeros(4), 2), {"scale_rewards": "std"}, "scale_rewards must be one of"),
    ],
)
def test_group_advantages_refuse_bad_input(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        zoo.models.group_advantages(*args, **kwargs)


def test_reward_table_calls_each_function_as_trl_does():
    prompts, completions = ["2+2=", "2+2=", "1+1=", "1+1="], ["4", "5", "2", "two"]

    def exact(prompts, completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    def digits_only(prompts, completions, **columns):
        return [None if not c.isdigit() else 0.5 for c in completions]

    table = zoo.models.reward_table([exact, digits_only], prompts, completions, answer=["4", "4", "2", "2"])
    np.testing.assert_array_equal(table[:, 0], [1, 0, 1, 0])
    np.testing.assert_array_equal(np.isnan(table[:, 1]), [False, False, False, True])
    advantages, total = zoo.models.group_advantages(table, 2, weights=[1.0, 2.0])
    np.testing.assert_allclose(total, [2, 1, 2, 0])
    assert advantages[0] > 0 > advantages[1] and advantages[2] > 0 > advantages[3]
    named = zoo.models.reward_table({"a": exact, "b": exact}, prompts, completions, answer=["4"] * 4)
    assert named.shape == (4, 2)

    # Booleans count as 1 / 0, as TRL's torch.tensor(rewards, dtype=float32) reads them (refused before).
    def matches(prompts, completions, answer):
        return [c == a for c, a in zip(completions, answer)]

    booleans = zoo.models.reward_table(matches, prompts, completions, answer=["4", "4", "2", "2"])
    np.testing.assert_array_equal(booleans[:, 0], [1, 0, 1, 0])


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (lambda prompts, completions: [1.0], "reward function '<lambda>' returned 1 values for 2 completions"),
        (
            lambda prompts, completions: [1.0, float("nan")],
            "returned nan for completion 1; return a finite number, or None",
        ),
        (lambda prompts, completions: [1.0, "high"], "returned 'high' for completion 1; return a number"),
        (lambda prompts, completions: 1.0, "returned float for 2 completions"),
        (lambda prompts, completions: 1 / 0, "reward function '<lambda>' raised ZeroDivisionError: division by zero"),
        (lambda prompts, completions, answer: [0, 0], "raised TypeError: .*missing 1 required .*answer"),
    ],
    ids=["count", "nan", "text", "scalar", "raises", "missing-column"],
)
def test_reward_table_names_the_function_that_misbehaves(function, message):
    with pytest.raises(ValueError, match=message) as e:
        zoo.models.reward_table(function, ["p", "p"], ["a", "b"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_type": "ppo"}, "loss_type must be one of"),
        ({"loss_type": "dapo", "importance_sampling_level": "sequence"}, "goes with loss_type='grpo'"),
        ({"beta": float("nan")}, "beta must be a finite number >= 0"),
        ({"temperature": 0.0}, "temperature must be a finite number > 0"),
        ({"delta": 0.5}, "delta must be a finite number > 1"),
        ({"max_completion_length": 0}, "max_completion_length must be an int >= 1"),
    ],
)
def test_grpo_loss_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        zoo.models.GRPOLoss(**kwargs)


def test_a_kl_term_without_a_reference_is_refused_with_the_fix():
    objective = zoo.models.GRPOLoss(beta=0.1)
    batch = zoo_batch(rollout(rows=2, completion=4, prompt=3))
    with pytest.raises(ValueError, match="needs a reference: .*disabled_adapters"):
        # Traced, as a compiled step calls it (eagerly, every operation of the forward compiles).
        eqx.filter_eval_shape(objective.loss, _base_decoder(), batch)


# --------------------------------------------------------------------------- the step


@functools.cache
def _base_decoder():
    """The tiny decoder, built once in one compiled program (eagerly, each initialiser
    compiles); read, never changed."""
    from helpers import tiny_decoder

    return eqx.filter_jit(tiny_decoder)(jax.random.key(0))


@functools.cache
def _lora_decoder():
    config = zoo.lora.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    model = eqx.filter_jit(zoo.lora.add_lora)(_base_decoder(), config, key=jax.random.key(1))  # one program
    return model, zoo.lora.trainable(model, config)


def _step_batch():
    """Eight completions of unequal lengths (the token means differ per microbatch), old
    log-probabilities off the policy's so some ratios are clipped."""
    r = rollout(seed=5, rows=8, prompt=3, completion=5)
    batch = zoo_batch(r)
    old = np.random.default_rng(6).uniform(-0.15, 0.15, batch["tokens"][:, 1:].shape).astype(np.float32)
    return batch | {"old_logps": jnp.asarray(old)}


@functools.cache
def _grads(loss_type, preset, microbatches):
    model, trainable = _lora_decoder()
    batch = _step_batch()
    loss_fn = zoo.models.GRPOLoss(
        loss_type=loss_type, beta=0.04, max_completion_length=5, reference=zoo.lora.disabled_adapters
    )
    if preset is None:
        step = zoo.TrainStep(loss_fn, optax.sgd(0.1), microbatches=microbatches, trainable=trainable)
        loss, grads = step.loss_and_grads(model, batch)
        return float(loss), step.partition(jax.tree.map(np.asarray, grads))[0], None
    # One compiled training step gives the loss, the gradients and the collectives: its
    # optimizer keeps the gradients as its state (a trace of decay 0: g + 0 · 0 = g exactly),
    # the step's gradients being `loss_and_grads`' (TrainStep._train_step calls it).
    mesh = data_mesh(2)
    with jax.set_mesh(mesh):
        placed = zoo.shard(model, zoo.rules(preset), mesh)
        step = zoo.TrainStep(
            loss_fn, optax.trace(decay=0.0), microbatches=microbatches, trainable=trainable, preset=preset
        )
        opt_state = step.init(placed)
        compiled = step.compile(placed, opt_state, batch)
        _, opt_state, loss = compiled(placed, opt_state, batch)
    colls = zoo.collectives(compiled, mesh=mesh)
    return float(loss), jax.tree.map(np.asarray, opt_state.trace), colls


@pytest.mark.parametrize(
    "loss_type,preset,microbatches", [("dapo", "dp", 2), ("grpo", "fsdp-once", 2), ("dr_grpo", "dp", 4)]
)
def test_microbatches_and_devices_give_the_one_device_gradients_with_one_all_reduce(loss_type, preset, microbatches):
    """The promise applied to RL: a step of M microbatches over 2 devices = one device, one
    microbatch (loss and gradients, float32 rounding), its gradient all-reduce once,
    outside every loop. `dapo` is the case TRL gets wrong per microbatch: its token mean
    divides by the global token count, and the mean of per-microbatch means differs."""
    want_loss, want, _ = _grads(loss_type, None, 1)
    loss, grads, colls = _grads(loss_type, preset, microbatches)
    assert want_loss != 0.0 and max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want)) > 1e-4
    assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    assert tree_allclose(grads, want, rtol=1e-4, atol=1e-6), max_abs_diff(grads, want)
    reductions = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter")]
    assert [c.in_loop for c in reductions] == [False], zoo.report(colls)
    assert not any(c.in_loop for c in colls), zoo.report(colls)
    if loss_type == "dapo":  # the per-microbatch normalisation would not be the same loss
        model, _ = _lora_decoder()
        batch = _step_batch()
        objective = zoo.models.GRPOLoss(loss_type="dapo", beta=0.04, reference=zoo.lora.disabled_adapters)
        sums, tokens = eqx.filter_jit(objective.loss)(model, batch)  # one program, not one per operation
        parts = np.array_split(np.arange(8), 2 * microbatches)  # per device and microbatch
        per_microbatch = np.mean([float(sums[p].sum() / tokens[p].sum()) for p in parts])
        assert abs(per_microbatch - want_loss) > 1e-3


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_a_batch_with_no_completion_tokens_gives_loss_zero_not_nan(loss_type):
    """dapo and bnpo divide by the global token count: a batch whose completions are all
    empty (every one truncated and masked, say) gives loss 0 and zero gradients, as TRL's
    clamped count does, not 0/0; the optimizer's state stays finite."""
    model, trainable = _lora_decoder()
    batch = _step_batch()
    batch = batch | {"completion": jnp.zeros_like(batch["completion"])}
    loss_fn = zoo.models.GRPOLoss(loss_type=loss_type, max_completion_length=5)
    step = zoo.TrainStep(loss_fn, optax.adamw(0.1), microbatches=2, trainable=trainable)
    loss, grads = step.loss_and_grads(model, batch)
    assert float(loss) == 0.0
    assert all(float(np.max(np.abs(g))) == 0.0 for g in jax.tree.leaves(step.partition(grads)[0]))
    assert float(eqx.filter_jit(loss_fn.metrics)(model, batch)["loss"]) == 0.0  # one program, not one per operation
