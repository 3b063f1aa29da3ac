"""GRPO as a run (issue 47 items 3-5): the serving engine as the rollout worker (its
log-probabilities are the training forward's; a policy update compiles nothing), reward
functions from files, `zoo finetune --objective grpo` raising the reward of a tiny Llama
and resuming bit-identically, and the bad inputs refused in one line."""

from __future__ import annotations

import functools
import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_rounding_close, tiny_decoder, zoo_main
from tiny_runs import read_jsonl, write_jsonl

import zoo
from zoo.serve import Engine, Request

TEMPERATURE = 0.7


@functools.cache
def _policy(key):
    """(the base, it with random LoRA branches): each built in one compiled program
    (eagerly, each initialiser compiles), once per key; read, never changed."""
    base = eqx.filter_jit(tiny_decoder)(jax.random.key(0), max_len=16)
    config = zoo.lora.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    return base, eqx.filter_jit(zoo.lora.add_lora)(base, config, key=jax.random.key(key))


def _completions(engine, seed):
    handles = [
        engine.submit(Request([3, 5, 7], max_tokens=8, temperature=TEMPERATURE, seed=seed + k, adapter="policy"))
        for k in range(4)
    ]
    engine.run_until_done()
    return handles


# The tiny decoder's logits (helpers.tiny_decoder: sums <= 32 wide, 2 layers of ~6 chained
# sums and the head, as test_generate.SUMS), its LoRA branch's add and the log-softmax.
LOGP_SUMS = {"terms": 32, "depth": 2 * 6 + 3}


@eqx.filter_jit  # as a training step runs it (eagerly, every operation of the forward compiles)
def _token_logps(model, tokens):
    return zoo.models.GRPOLoss(temperature=TEMPERATURE).token_logps(model, tokens)


def _pairs(model, handles):
    """Each completion token's `sampled_logprob` and the training forward's
    (`GRPOLoss.token_logps` at the sampling temperature), as two arrays."""
    served, trained = [], []
    for h in handles:
        tokens = jnp.asarray([[3, 5, 7, *h.ids]], jnp.int32)
        trained.append(np.asarray(_token_logps(model, tokens))[0, 2:])
        served.append(np.array([t.sampled_logprob for t in h.tokens], np.float32))
    return np.concatenate(served), np.concatenate(trained)


def _gap(model, handles):
    served, trained = _pairs(model, handles)
    return float(np.max(np.abs(served - trained)))


def test_the_engines_log_probabilities_are_the_training_forwards_and_a_policy_update_compiles_nothing():
    """Rollouts from `zoo.serve.Engine`: each completion token's log-probability at the
    sampling temperature equals the training forward's (`GRPOLoss.token_logps`, float32
    rounding), before and after the policy's adapter is rewritten in its slot
    (`Engine.update_adapter`), which compiles no program."""
    base, policy = _policy(1)
    engine = Engine(base, slots=4, max_len=16, adapters={"policy": policy}, max_adapters=1, max_lora_rank=2)
    assert_rounding_close(*_pairs(policy, _completions(engine, 0)), **LOGP_SUMS, what="log-probabilities")
    compiled = dict(engine.compiles)
    _, update = _policy(7)
    engine.update_adapter("policy", update)
    after = _completions(engine, 0)
    assert_rounding_close(*_pairs(update, after), **LOGP_SUMS, what="log-probabilities after the update")
    assert _gap(policy, after) > 1e-3  # the new weights were served, not the old
    assert engine.compiles == compiled
    with pytest.raises(ValueError, match="NaN or inf"):
        engine.update_adapter("policy", jax.tree.map(lambda x: x * jnp.nan if x.dtype == jnp.float32 else x, update))


def test_an_engine_leaves_a_model_placed_on_a_one_device_mesh_usable():
    """The engine reads its model's device without emptying the device set jax caches in a
    `NamedSharding` (`devices().pop()` did: the model's arrays then named no device and
    every later program over them failed)."""
    base, _ = _policy(1)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:1])
    placed = zoo.shard(base, zoo.rules("dp"), mesh)
    Engine(placed, slots=1, max_len=16)
    assert placed.token_embedding.weight.devices() == {jax.devices()[0]}
    assert np.isfinite(np.asarray(placed(jnp.zeros((1, 4), jnp.int32)))).all()


# --------------------------------------------------------------------------- the run

REWARDS = '''
def target_words(prompts, completions, target, **columns):
    """How many words of the completion are the record's target word."""
    return [float(c.split().count(t)) for c, t in zip(completions, target)]


def not_a_number(prompts, completions, completion_ids, **columns):
    """NaN; asks for TRL's completion_ids (each completion's token ids) by name."""
    assert all(0 < len(ids) <= 8 and all(isinstance(i, int) for i in ids) for ids in completion_ids), completion_ids
    return [float("nan")] * len(completions)


def only_cats(prompts, completions, **columns):
    """Scores the completions holding "cat"; the others: None (does not apply)."""
    return [1.0 if "cat" in c.split() else None for c in completions]
'''
GRPO = [
    "--objective", "grpo", "--num-generations", "4", "--batch-size", "16", "--max-completion-length", "8",
    "--seq-len", "16", "--lr", "0.1", "--schedule", "constant", "--lora", "r=8,alpha=16,targets=all-linear+lm_head", "--devices", "1",
    "--microbatches", "2", "--quiet",
]  # fmt: skip


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """A prompts file (three words each, the rewarded word as an extra column) and the
    reward functions' file."""
    from tiny_runs import WORDS

    folder = tmp_path_factory.mktemp("grpo")
    rng = np.random.default_rng(0)
    records = [{"prompt": " ".join(rng.choice(WORDS, 3)), "target": "cat"} for _ in range(24)]
    (folder / "rewards.py").write_text(REWARDS)
    return write_jsonl(folder / "prompts.jsonl", records), folder / "rewards.py"


def _finetune(llama_dir, prompts, out, *flags):
    data, rewards = prompts
    return zoo_main(
        "finetune", "transformer", "--init", llama_dir, "--data", data, "--reward", f"{rewards}:target_words",
        "--output", out, *GRPO, *flags,
    )  # fmt: skip


def test_zoo_finetune_grpo_raises_the_reward_and_resumes_bit_identically(llama_dir, prompts, tmp_path):
    """`zoo finetune --objective grpo` on a tiny Llama whose reward counts a target word
    (an extra column of the prompts file, passed by name): the reward of the last steps is
    near its maximum (8: every completion token), far above the first step's; TRL's
    metrics are logged per step and per evaluation; the adapter is exported; and a run
    resumed from its middle checkpoint rolls out the same completions and ends with the
    same adapter, bit for bit (the rollouts are a function of the step and the policy)."""
    whole = tmp_path / "whole"
    rc, _, err = _finetune(
        llama_dir, prompts, whole, "--steps", "10", "--checkpoint-every", "5", "--tensorboard", whole / "tb"
    )
    assert rc == 0, err
    rows = read_jsonl(whole / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    rewards = [r["reward"] for r in train]
    assert rewards[0] < 2 and np.mean(rewards[-3:]) > 6, rewards
    for key in ("reward_std", "rewards/target_words/mean", "completions/mean_length", "completions/clipped_ratio"):
        assert key in train[0], sorted(train[0])
    for key in ("entropy", "clip_ratio/region_mean"):  # the objective's, under the policy each step updates
        assert key in train[0], sorted(train[0])
    assert train[-1]["entropy"] < train[0]["entropy"]  # sharpened onto the rewarded word
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals[-1]["eval_reward"] > evals[0]["eval_reward"] + 3
    for key in ("eval_entropy", "eval_clip_ratio/region_mean", "eval_sample"):
        assert key in evals[-1], sorted(evals[-1])
    from test_train_api import _tensorboard_scalars

    scalars = _tensorboard_scalars(whole / "tb")
    assert scalars["reward"] == {r["step"]: pytest.approx(r["reward"]) for r in train}
    assert {"rewards/target_words/mean", "eval_reward", "eval_rewards/target_words/mean"} <= set(scalars)
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["reward_rose"] and summary["seconds"]["rollouts"] > 0
    assert summary["collectives"]["gradient_reductions"] == 0  # one device
    assert "lm_head" in json.loads((whole / "adapter" / "adapter_config.json").read_text())["target_modules"]
    _peft_opens_with_zoos_logits(llama_dir, whole / "adapter")

    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    rc, _, err = _finetune(llama_dir, prompts, resumed, "--steps", "10", "--resume-step", "5", "--overwrite")
    assert rc == 0, err
    again = [r for r in read_jsonl(resumed / "metrics.jsonl") if r["kind"] == "train" and r["step"] > 5]
    assert [r["reward"] for r in again] == rewards[5:]
    assert [r["loss"] for r in again] == [r["loss"] for r in train[5:]]
    for name in ("adapter_model.safetensors",):
        assert (resumed / "adapter" / name).read_bytes() == (whole / "adapter" / name).read_bytes()


def _peft_opens_with_zoos_logits(llama_dir, adapter):
    """peft opens the run's adapter (its output head's branch too) on the transformers
    model with zoo's logits, as an SFT run's (test_cli_data's contract)."""
    import peft
    import torch
    import transformers
    from helpers import assert_as_accurate, torch_reference
    from tiny_runs import VOCAB

    tokens = np.array([[1, 6, 8, 10, 12, 6, 14]], np.int32)
    model, _ = zoo.lora.load_adapter(zoo.hf.from_pretrained(llama_dir), adapter)
    ours = np.asarray(eqx.filter_jit(model)(tokens))[..., : len(VOCAB)]  # one program, not one per operation
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    peft_model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    theirs = torch_reference(lambda m: m(torch.from_numpy(tokens.astype(np.int64))).logits, peft_model)
    assert_as_accurate(ours, theirs, what="the GRPO adapter vs peft")


@pytest.mark.parametrize(
    "flags,records,message",
    [
        (["--reward", "{folder}/missing.py:f"], None, "no such file"),
        (["--reward", "{rewards}:nope"], None, "has no 'nope'"),
        (["--reward", "{rewards}"], None, "write it as FILE.py:NAME"),
        (["--num-generations", "1"], None, "num-generations must be an integer >= 2"),
        (["--batch-size", "6"], None, "multiple of --num-generations 4"),
        (["--batch-size", "100"], None, "fewer than a step's 25"),
        (["--seq-len", "4"], None, "leaving no room for a completion"),
        (["--objective", "sft"], None, "holds prompts alone"),
        ([], [{"prompt": "the cat", "completion": "sat"}], "completes prompts and rewards"),
    ],
)
def test_bad_grpo_input_is_refused_in_one_line_before_any_folder(llama_dir, prompts, tmp_path, flags, records, message):
    """A reward file that is missing or lacks the function, a group of one, a batch that
    is no multiple of the group, a prompt longer than the context, prompts for another
    objective or another objective's records: one line naming the fix, exit code 2, and no
    run folder made."""
    data, rewards = prompts
    if records is not None:
        data = write_jsonl(tmp_path / "other.jsonl", records)
    flags = [f.format(folder=tmp_path, rewards=rewards) for f in flags]
    out = tmp_path / "run"
    rc, _, err = zoo_main(
        "finetune", "transformer", "--init", llama_dir, "--data", data, "--reward", f"{rewards}:target_words",
        "--output", out, *GRPO, "--steps", "2", *flags,
    )  # fmt: skip
    assert rc == 2, err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_a_reward_returning_nan_is_named_and_stops_the_run(llama_dir, prompts, tmp_path):
    """A reward function returning NaN is named, with its fix (None for 'not applicable'),
    at the first rollout; nothing is trained."""
    data, rewards = prompts
    out = tmp_path / "run"
    rc, _, err = zoo_main(
        "finetune", "transformer", "--init", llama_dir, "--data", data, "--reward", f"{rewards}:not_a_number",
        "--output", out, *GRPO, "--steps", "2",
    )  # fmt: skip
    assert rc == 2, err
    assert "reward function 'not_a_number' returned nan" in err and "None" in err, err
    assert not (out / "metrics.jsonl").exists() or not [
        r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"
    ]


def test_grpo_without_lora_is_refused_with_the_command_that_has_it(llama_dir, prompts, tmp_path):
    """`zoo train` trains every weight, and GRPO's rollouts serve a LoRA adapter beside the
    frozen base: refused in one line naming `zoo finetune`."""
    data, _ = prompts
    out = tmp_path / "run"
    rc, _, err = zoo_main(
        "train", "transformer", "--init", llama_dir, "--data", data, "--objective", "grpo", "--output", out,
        "--devices", "1", "--steps", "2", "--quiet",
    )  # fmt: skip
    assert rc == 2 and "zoo finetune" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_a_rollout_reused_for_several_steps_resumes_in_the_middle_of_its_block(llama_dir, prompts, tmp_path):
    """`--num-iterations 2` (TRL's μ): each rollout serves two optimizer steps, the second
    clipped against the sampling policy's log-probabilities (the engine's); only the first
    step of a block samples (its row has the rollout metrics). A checkpoint in the middle of
    a block holds that rollout, so a run resumed there reuses it and ends with the
    uninterrupted run's adapter, bit for bit. Without the evaluation before training
    (`--no-eval-before`, resumed too), the reward's rise is not judged."""
    whole = tmp_path / "whole"
    flags = (
        "--steps",
        "4",
        "--checkpoint-every",
        "3",
        "--num-iterations",
        "2",
        "--eval-every",
        "0",
        "--no-eval-before",
    )
    rc, out, err = _finetune(llama_dir, prompts, whole, *flags)
    assert rc == 0, err
    assert "reward rose: not judged (no evaluation before training: --no-eval-before; held-out mean reward" in out, out
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["eval_before"] is None and summary["reward_rose"] is None and summary["loss_fell"] is None
    train = [r for r in read_jsonl(whole / "metrics.jsonl") if r["kind"] == "train"]
    assert ["reward" in r for r in train] == [True, False, True, False]
    assert all("clip_ratio/region_mean" in r for r in train)
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    rc, _, err = _finetune(llama_dir, prompts, resumed, *flags, "--resume-step", "3", "--overwrite")
    assert rc == 0, err
    again = [r for r in read_jsonl(resumed / "metrics.jsonl") if r["kind"] == "train" and r["step"] > 3]
    assert [r["loss"] for r in again] == [r["loss"] for r in train[3:]]
    name = "adapter_model.safetensors"
    assert (resumed / "adapter" / name).read_bytes() == (whole / "adapter" / name).read_bytes()


def test_reward_flags_repeat_into_one_list():
    """`--reward` and `--reward-weights` may be repeated (TRL's several reward functions),
    each use adding to the comma-separated list the config holds."""
    from zoo._cli._main import build_parsers
    from zoo._cli._train import config_of_flags

    parser = build_parsers()[1]["finetune"]
    args = parser.parse_args(
        ["transformer", "--objective", "grpo", "--reward", "a.py:f", "--reward", "b.py:g,c.py:h"]
        + ["--reward-weights", "1", "--reward-weights", "0.5,2"]
    )
    config, _ = config_of_flags(args, "finetune")
    assert config.grpo.rewards() == ["a.py:f", "b.py:g", "c.py:h"] and config.grpo.weights() == [1.0, 0.5, 2.0]


def test_completions_no_reward_function_scored_are_warned_of_once(llama_dir, prompts, tmp_path):
    """A completion every reward function returned None for gets advantage 0 and teaches
    nothing: the run says so once on stderr (TRL warns), not at every rollout."""
    data, rewards = prompts
    rc, _, err = zoo_main(
        "finetune", "transformer", "--init", llama_dir, "--data", data, "--reward", f"{rewards}:only_cats",
        "--output", tmp_path / "run", *GRPO, "--steps", "2",
    )  # fmt: skip
    assert rc == 0, err
    assert err.count("zoo: warning: every reward function returned None for") == 1, err
    assert "they get advantage 0 and teach nothing" in err, err


def test_a_step_no_reward_function_scored_logs_nulls_without_numpys_warnings():
    """Every reward None (TRL's "does not apply"): the step's reward metrics are null; numpy's
    "Mean of empty slice" RuntimeWarnings (four, with their source lines) reached the
    terminal of every such step, though `np.errstate` was meant to keep them out."""
    import types
    import warnings

    from zoo.train._grpo import Rollouts

    rollouts = types.SimpleNamespace(
        settings=types.SimpleNamespace(num_generations=2, scale_rewards="group"), rewards=["nones"]
    )
    table, totals = np.full((4, 1), np.nan, np.float32), np.full(4, np.nan, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = Rollouts._metrics(rollouts, table, totals, np.full(4, 3), np.zeros(4, bool))
    assert out["reward"] is None and out["rewards/nones/mean"] is None and out["frac_reward_zero_std"] == 1.0


def test_a_grpo_runs_step_on_two_devices_holds_one_all_reduce_within_its_budget(llama_dir, prompts):
    """`zoo.train.inspect` of a GRPO run (nothing sampled: a batch of its shapes) on 2
    devices and 2 microbatches: one gradient all-reduce over data, outside every loop, and
    the dp preset's budget holds."""
    from zoo.train import DataConfig, GRPOConfig, RunConfig

    data, rewards = prompts
    config = RunConfig(
        model="transformer", init=str(llama_dir), objective="grpo", devices=2, microbatches=2, batch_size=16,
        data=DataConfig(source=str(data), seq_len=16), lora=zoo.lora.LoraConfig(r=8, lora_alpha=16),
        grpo=GRPOConfig(reward=[cat_words], num_generations=4, max_completion_length=8),  # a function, from Python
    )  # fmt: skip
    inspection = zoo.train.inspect(config, command="finetune")
    assert sorted(inspection.batch) == ["advantages", "completion", "tokens"]
    reductions = [c for c in inspection.collectives if c.kind in ("all-reduce", "reduce-scatter")]
    assert [(c.in_loop, c.mesh_axes) for c in reductions] == [(False, ("data",))], zoo.report(inspection.collectives)
    budget, sizes = inspection.budget()
    assert not budget.breaches(inspection.collectives, sizes)


def cat_words(prompts, completions, **columns):
    """A reward given to `GRPOConfig` as a function: how many words are "cat"."""
    return [float(c.split().count("cat")) for c in completions]


def test_reward_functions_given_from_python_are_kept_by_name_and_found_again():
    """`GRPOConfig(reward=[function, "FILE.py:NAME"])`: a function is kept as MODULE:NAME
    (config.json's text, what a resume compares), found as itself in this process and by
    import in a later one; a lambda cannot be imported, and a later process says so."""
    from zoo.train import GRPOConfig, RunConfig
    from zoo.train._grpo import load_rewards
    from zoo.train._settings import REWARD_FUNCTIONS

    config = RunConfig(model="transformer", objective="grpo", grpo=GRPOConfig(reward=[cat_words, "r.py:f"]))
    assert config.to_dict()["reward"] == "test_grpo_run:cat_words,r.py:f"
    assert RunConfig.from_dict(config.to_dict()) == config
    assert load_rewards(["test_grpo_run:cat_words"]) == {"cat_words": cat_words}
    REWARD_FUNCTIONS.pop("test_grpo_run:cat_words")  # a later process: imported from its module
    assert load_rewards(["test_grpo_run:cat_words"])["cat_words"] is cat_words
    name = GRPOConfig(reward=lambda prompts, completions, **_: [0.0] * len(completions)).reward
    assert load_rewards([name])["<lambda>"]([], ["a"]) == [0.0]
    REWARD_FUNCTIONS.pop(name)
    with pytest.raises(zoo.train.ConfigError, match="lambda or nested function"):
        load_rewards([name])


def test_a_template_refusing_a_prompt_names_its_line(llama_dir, prompts, tmp_path):
    """A chat template's `raise_exception` on a conversational prompt (a system turn it
    does not take): one line naming the prompt's line, exit 2, no run folder."""
    from tiny_runs import CHAT_TEMPLATE

    _, rewards = prompts
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[0].role == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
                      + CHAT_TEMPLATE)  # fmt: skip
    records = [{"prompt": [{"role": "user", "content": "the cat"}], "target": "sat"}] * 3
    records.append({"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a dog"}]})
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    out = tmp_path / "run"
    rc, _, err = zoo_main(
        "finetune", "transformer", "--init", llama_dir, "--data", data, "--reward", f"{rewards}:target_words",
        "--chat-template", strict, "--output", out, *GRPO, "--steps", "2",
    )  # fmt: skip
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "chats.jsonl line 4: the chat template refused this conversation: no system turns" in err, err
    assert not out.exists()
