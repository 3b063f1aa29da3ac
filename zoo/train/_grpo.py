"""The task of `RunConfig.objective` grpo: a decoder's LoRA adapters trained online on a
file of prompts, its batches rollouts of the policy it trains (`Rollouts`), its loss a
`zoo.models.GRPOLoss`, its held-out evaluation the rollouts' rewards and TRL's metrics on
held-out prompts.

The rollout worker is `zoo.serve.Engine`, in the training process: it holds the frozen base
once (the training model's own arrays on one device) and the policy's LoRA adapter in one
slot of its adapter bank. After every optimizer step the adapter's new weights are written
into that slot (`Engine.update_adapter`): the engine's programs keep their shapes, so
nothing compiles again and the base is never copied (a replicated base; under `fsdp` /
`tp` the engine holds a gathered copy). Its continuous batching runs the step's B·G
requests through its slots, each request's draws keyed by its own seed.

A step's batch is a function of the step and the policy that step starts from: the
prompts by a seeded permutation (epochs, as `zoo.data.Dataset`), each completion's seed by
`(seed, step)`. A resumed run restores the policy of its checkpoint, so it draws the same
rollouts as the run it continues (the checkpoint holds nothing more of the generator).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._distributed import is_main_process
from ..data import DataFormatError
from ..data._chat import rendering
from ..data._records import read_located
from ..models._grpo import _nanstd, group_advantages, reward_table
from ._errors import ConfigError
from ._registry import model_spec
from ._settings import REWARD_FUNCTIONS
from ._task import Task, init_name
from ._trainer import Hook, TrainState

# The engine's slots when a step's requests are more: a CPU decodes 32 rows about as fast
# per row as more, and the cache's memory grows with the slots.
MAX_SLOTS = 32
# The adapter slot the policy is served from.
POLICY = "policy"


def load_rewards(specs: Sequence[str]) -> dict[str, Callable]:
    """The reward functions of `FILE.py:NAME` specs, by name (a name twice: `NAME_2`, ...).

    **Raises** `ConfigError` (one line, the fix in it): a spec without `:NAME`, a file that
    does not exist or fails to import, no such name in it, or a name that is no function."""
    if not specs:
        raise ConfigError(
            "RunConfig.objective grpo needs at least one reward function: GRPOConfig.reward FILE.py:NAME (a function "
            "NAME(prompts, completions, **columns) -> one float per completion)"
        )
    functions = []
    for spec in specs:
        if spec in REWARD_FUNCTIONS:  # given as a function in this process
            functions.append((spec.rpartition(":")[2].split("#")[0].rpartition(".")[2], REWARD_FUNCTIONS[spec]))
            continue
        given = f"GRPOConfig.reward {spec}"
        path_text, _, name = str(spec).rpartition(":")
        if path_text and not path_text.endswith(".py") and path_text.replace(".", "_").isidentifier():
            # MODULE:NAME: a function given in Python, found again in a later process
            functions.append((name.rpartition(".")[2], _imported(spec, path_text, name)))
            continue
        if not path_text or not name.isidentifier():
            raise ConfigError(f"{given}: write it as FILE.py:NAME (the file, a colon, the function's name)")
        path = Path(path_text).expanduser()
        if not path.is_file():
            raise ConfigError(f"{given}: no such file {path}")
        module_name = "zoo_reward_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
        module = sys.modules.get(module_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(module_name, path)
            if loader is None or loader.loader is None:
                raise ConfigError(f"{given}: {path} is not a Python file zoo can import (name it FILE.py)")
            module = importlib.util.module_from_spec(loader)
            try:
                loader.loader.exec_module(module)
            except Exception as e:  # the user's code: name it, keep its message
                raise ConfigError(f"{given}: importing {path} raised {type(e).__name__}: {e}") from e
            sys.modules[module_name] = module
        function = getattr(module, name, None)
        if function is None:
            found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise ConfigError(f"{given}: {path} has no {name!r} (its functions: {found})")
        if not callable(function):
            raise ConfigError(f"{given}: {name!r} in {path} is a {type(function).__name__}, not a function")
        functions.append((name, function))
    named: dict[str, Callable] = {}
    for name, function in functions:
        unique, k = name, 2
        while unique in named:  # the same name from two files: NAME, NAME_2, ...
            unique, k = f"{name}_{k}", k + 1
        named[unique] = function
    return named


def _imported(spec: str, module_name: str, qualname: str) -> Callable:
    """The function `qualname` of module `module_name` (a reward given as a function in an
    earlier process: its config.json names it `MODULE:NAME`)."""
    if "#" in qualname or "<" in qualname:
        raise ConfigError(
            f"GRPOConfig.reward {spec}: a lambda or nested function given in another process cannot be found "
            "again; define the reward at the top level of a module (or a FILE.py) and pass it again"
        )
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"GRPOConfig.reward {spec}: cannot import {qualname} from module {module_name} ({e}); pass the "
            "function again, or name it FILE.py:NAME"
        ) from None
    if not callable(found):
        raise ConfigError(
            f"GRPOConfig.reward {spec}: {qualname} in {module_name} is a {type(found).__name__}, not a function"
        )
    return found


@dataclasses.dataclass
class Prompts:
    """A prompts file encoded: `ids` (each prompt's token ids), `prompts` (each as the file
    gives it, a text or a list of messages: what reward functions get), `columns` (the
    records' other keys, one value per prompt, `None` where a record lacks one) and the
    file's `sha256`."""

    ids: list[list[int]]
    prompts: list[Any]
    columns: dict[str, list[Any]]
    sha256: str

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, rows: Sequence[int] | np.ndarray) -> Prompts:
        """The prompts at indices `rows`, in that order."""
        rows = [int(i) for i in rows]
        return Prompts(
            [self.ids[i] for i in rows],
            [self.prompts[i] for i in rows],
            {k: [v[i] for i in rows] for k, v in self.columns.items()},
            self.sha256,
        )


def encode_prompts(
    records: list[dict[str, Any]],
    wheres: list[str],
    rust: Any,
    *,
    seq_len: int,
    chat_template: Any = None,
    system: str | None = None,
    sha256: str = "",
) -> Prompts:
    """The prompts of `records` (`{"prompt": text or messages, ...}`), tokenized as
    preference prompts are: a text with the tokenizer's special tokens, a conversation
    rendered by `chat_template` with the generation prompt (`system` first as a system turn
    where it has none). A prompt that leaves no room for a completion in `seq_len` tokens
    is refused (`ConfigError` naming its line)."""
    ids, prompts = [], []
    keys = sorted({k for r in records for k in r} - {"prompt"})
    columns: dict[str, list[Any]] = {k: [] for k in keys}
    for record, where in zip(records, wheres):
        prompt = record["prompt"]
        if isinstance(prompt, str):
            text = (system + "\n\n" if system else "") + prompt
            encoded = rust.encode(text, add_special_tokens=True).ids
        else:
            if chat_template is None:
                raise ConfigError(
                    f"DataConfig.source {where}: the prompt is a conversation but the tokenizer has no chat template; pass a "
                    "model folder whose tokenizer has one, or DataConfig.chat_template FILE"
                )
            if system and prompt[0].get("role") != "system":
                prompt = [{"role": "system", "content": system}, *prompt]
            try:
                with rendering(where):
                    text = chat_template.render(prompt, add_generation_prompt=True)
            except DataFormatError as e:
                raise ConfigError(f"DataConfig.source {e}") from None
            encoded = rust.encode(text, add_special_tokens=False).ids
        if not encoded:
            raise ConfigError(f"DataConfig.source {where}: the prompt holds no token; give it text or remove the line")
        if len(encoded) >= seq_len:
            raise ConfigError(
                f"DataConfig.source {where}: the prompt has {len(encoded)} tokens, leaving no room for a completion in "
                f"DataConfig.seq_len {seq_len}; raise DataConfig.seq_len or shorten the prompt"
            )
        ids.append(list(encoded))
        prompts.append(record["prompt"])
        for k in keys:
            columns[k].append(record.get(k))
    return Prompts(ids, prompts, columns, sha256)


class Rollouts(Hook):
    """A GRPO run's batches: `batch_at(step, batch_size, *, seed)` completes `batch_size /
    num_generations` prompts `num_generations` times each with the current policy and
    returns `{"tokens", "completion", "advantages"}` `[batch_size, seq_len]` (prompt then
    completion, right-padded), with the step's rollout metrics in `metrics[step]` (TRL's
    names: `reward`, `reward_std`, `frac_reward_zero_std`, `rewards/NAME/mean` and `/std`,
    `completions/mean_length`, `/min_length`, `/max_length`, `/clipped_ratio`).

    A `Hook` firing after every step: the policy it samples from follows the trained model
    (`follow`). `evaluate(model, prompts)` is its held-out evaluation.

    **Arguments:**

    - `prompts`: the training prompts (`Prompts`); `held_out`: the evaluation's.
    - `rewards`: name → reward function; `weights`: one per function (None: 1 each).
    - `settings`: the run's `GRPOConfig`; `objective`: its `GRPOLoss`.
    - `seq_len`: prompt + completion; `eos_ids`: the ids that end a completion; `pad_id`.
    - `decode`: ids → text (special tokens dropped), as the reward functions see completions.
    """

    every = 1

    def __init__(
        self,
        prompts: Prompts,
        held_out: Prompts,
        rewards: dict[str, Callable],
        settings: Any,
        objective: Any,
        *,
        seq_len: int,
        eos_ids: Sequence[int],
        pad_id: int,
        decode: Callable[[list[int]], str],
        conversational: bool,
        slots: int = MAX_SLOTS,
    ):
        self.prompts, self.held_out, self.rewards = prompts, held_out, rewards
        self.settings, self.objective, self.seq_len = settings, objective, seq_len
        self.weights = settings.weights()
        self.iterations = settings.num_iterations
        self.eos_ids, self.pad_id, self.decode, self.conversational = tuple(eos_ids), pad_id, decode, conversational
        self.slots = max(1, min(int(slots), MAX_SLOTS))
        self.engine: Any = None
        self.policy: Any = None
        self.metrics: dict[int, dict[str, Any]] = {}
        self.samples: dict[int, dict[str, Any]] = {}
        self.train_rollout_seconds = 0.0  # sampling the training batches (their rewards included)
        self._last: tuple[int, Any, dict] | None = None
        self._mesh: Any = None
        self._served: Any = None  # the policy whose adapter the engine holds
        self._metrics_fn: Any = None
        self._warned_unscored = False  # said once a run, as TRL's warning (Python shows a warning once)

    def __len__(self) -> int:
        return len(self.prompts)

    # -- the policy -----------------------------------------------------------------------

    def follow(self, model: Any) -> None:
        """Sample from `model` (a LoRA model) from the next rollout on (the engine made on
        the first call, over its base)."""
        if self.engine is None:
            with self._device():
                self.engine = _engine(model, self._mesh.devices.flat[0], slots=self.slots, max_len=self.seq_len)
            self._served = model
        self.policy = model

    def _serve_policy(self) -> None:
        """The policy's adapter written into the engine's slot, if it changed (not at every
        step of a rollout reused `num_iterations` times)."""
        if self._served is not self.policy:
            with self._device():
                self.engine.update_adapter(POLICY, self.policy)
            self._served = self.policy

    def _device(self):
        """A context on the engine's one device: its programs run outside the run's mesh
        (a multi-device run sets its mesh for the step; the engine's arrays live on one)."""
        import jax

        if self._mesh is None:
            self._mesh = jax.sharding.Mesh(np.array([jax.local_devices()[0]]), ("rollout",))
        return jax.set_mesh(self._mesh)

    def on_start(self, state: TrainState) -> None:
        self.follow(state.model)

    def __call__(self, state: TrainState) -> None:
        self.follow(state.model)

    # -- batches --------------------------------------------------------------------------

    def rows_at(self, step: int, prompts: int, *, seed: int) -> np.ndarray:
        """The prompts of step `step`: epochs of seeded permutations, as `zoo.data.Dataset`."""
        n = len(self.prompts)
        if prompts > n:
            raise ConfigError(
                f"DataConfig.source has {n} training prompts, fewer than a step's {prompts} (RunConfig.batch_size / GRPOConfig.num_generations); "
                "give it more prompts or lower RunConfig.batch_size"
            )
        epoch, index = divmod(step - 1, n // prompts)
        return np.random.default_rng([seed, epoch]).permutation(n)[index * prompts : (index + 1) * prompts]

    def batch_at(self, step: int, batch_size: int, *, seed: int = 0, mesh: Any = None, data_axes: Any = "data") -> dict:
        """Step `step`'s batch: the rollout of its block of `num_iterations` steps, sampled
        from the policy the block starts from (made once per block; the compile's example
        batch is the first step's), with the sampling policy's `old_logps` when a block
        holds several steps."""
        if self.policy is None:  # nothing to sample from (`zoo inspect`): a batch of the shapes
            return self.example_batch(batch_size, seed=seed)
        block = (step - 1) // self.iterations + 1  # the rollout's number, from 1
        if self._last is not None and self._last[0] == block and (self.iterations > 1 or self._last[1] is self.policy):
            if step not in self.metrics:  # a later step of the block: the policy it updates, on the rollout
                self.metrics[step] = self._loss_metrics(self._last[2])
            return dict(self._last[2])
        g = self.settings.num_generations
        if batch_size % g:
            raise ConfigError(
                f"RunConfig.batch_size {batch_size} counts completions: make it a multiple of GRPOConfig.num_generations {g}"
            )
        rows = self.rows_at(block, batch_size // g, seed=seed)
        seeds = np.random.default_rng([seed, block, 1]).integers(2**62, size=batch_size)
        t0 = time.perf_counter()
        batch, metrics, sample = self.rollout(self.prompts.take(rows), seeds)
        self.train_rollout_seconds += time.perf_counter() - t0
        self.metrics[step], self.samples[step] = metrics | self._loss_metrics(batch), sample
        self._last = (block, self.policy, batch)
        return dict(batch)

    def _loss_metrics(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """TRL's per-step metrics of the objective on `batch` under the policy the step
        updates (`entropy`, `clip_ratio/*`, `kl` with a reference): one more forward pass."""
        return {k: v for k, v in self._objective_metrics(self.policy, batch).items() if k != "loss"}

    def _objective_metrics(self, model: Any, batch: dict[str, np.ndarray]) -> dict[str, float]:
        import equinox as eqx

        if self._metrics_fn is None:
            self._metrics_fn = eqx.filter_jit(self.objective.metrics)
        return {k: float(v) for k, v in self._metrics_fn(model, batch).items()}

    def example_batch(self, batch_size: int, *, seed: int = 0) -> dict[str, np.ndarray]:
        """A batch of a step's shapes and dtypes, not sampled (what `zoo inspect` compiles):
        padding tokens, each row's completion after its first token, random advantages."""
        rng = np.random.default_rng([seed, 0, 3])
        batch = {
            "tokens": np.full((batch_size, self.seq_len), self.pad_id, np.int32),
            "completion": np.pad(np.ones((batch_size, self.seq_len - 1), np.int32), ((0, 0), (1, 0))),
            "advantages": rng.normal(size=batch_size).astype(np.float32),
        }
        if self.iterations > 1:
            batch["old_logps"] = np.zeros((batch_size, self.seq_len - 1), np.float32)
        return batch

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the generator: the current block's rollout (its
        later steps reuse it), or nothing with one step a rollout (the step and the
        restored policy make it again)."""
        if self.iterations == 1 or self._last is None:
            return {}
        return {
            "rollout_block": np.asarray(self._last[0], np.int32),
            **{f"rollout_{k}": v for k, v in self._last[2].items()},
        }

    def checkpoint_like(self, batch_size: int) -> dict[str, Any]:
        """`checkpoint_state`'s shapes and dtypes (what a resume restores into)."""
        if self.iterations == 1:
            return {}
        rows, cols = batch_size, self.seq_len
        return {
            "rollout_block": np.zeros((), np.int32),
            "rollout_tokens": np.zeros((rows, cols), np.int32),
            "rollout_completion": np.zeros((rows, cols), np.int32),
            "rollout_advantages": np.zeros((rows,), np.float32),
            "rollout_old_logps": np.zeros((rows, cols - 1), np.float32),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue the block a checkpoint stopped in (`checkpoint_state`, restored)."""
        if self.iterations > 1 and state:
            batch = {k.removeprefix("rollout_"): np.asarray(v) for k, v in state.items() if k != "rollout_block"}
            self._last = (int(state["rollout_block"]), None, batch)

    def rollout(self, prompts: Prompts, seeds: np.ndarray) -> tuple[dict, dict, dict]:
        """Complete each of `prompts` `num_generations` times (request `i` seeded
        `seeds[i]`); returns `(batch, metrics, sample)`: the `GRPOLoss` batch, the rollout
        metrics and the first completion with its prompt and reward."""
        from ..serve import Request

        s, g = self.settings, self.settings.num_generations
        self._serve_policy()
        handles = []
        for i, ids in enumerate(prompts.ids):
            room = min(s.max_completion_length, self.seq_len - len(ids))
            for k in range(g):
                request = Request(
                    list(ids),
                    max_tokens=room,
                    temperature=float(s.temperature),
                    top_k=s.top_k or None,
                    top_p=None if s.top_p >= 1 else float(s.top_p),
                    seed=int(seeds[i * g + k]),
                    stop_ids=self.eos_ids,
                    adapter=POLICY,
                )
                handles.append(self.engine.submit(request))
        with self._device():
            self.engine.run_until_done()
        rows = len(handles)
        tokens = np.full((rows, self.seq_len), self.pad_id, np.int32)
        completion = np.zeros((rows, self.seq_len), np.int32)
        lengths, clipped, texts, ids = np.zeros(rows, np.int64), np.zeros(rows, bool), [], []
        old = np.zeros((rows, self.seq_len - 1), np.float32)  # position t: token t + 1's
        for r, handle in enumerate(handles):
            prompt, out = prompts.ids[r // g], handle.ids
            old[r, len(prompt) - 1 : len(prompt) - 1 + len(out)] = [t.sampled_logprob for t in handle.tokens]
            tokens[r, : len(prompt)] = prompt
            tokens[r, len(prompt) : len(prompt) + len(out)] = out
            clipped[r] = handle.finish_reason != "stop"
            lengths[r] = len(out)
            if not (clipped[r] and s.mask_truncated_completions):
                completion[r, len(prompt) : len(prompt) + len(out)] = 1
            ids.append([int(t) for t in out])
            text = self.decode([t for t in out if t not in self.eos_ids])
            texts.append([{"role": "assistant", "content": text}] if self.conversational else text)
        repeat = [p for p in prompts.prompts for _ in range(g)]
        columns = {k: [v for v in values for _ in range(g)] for k, values in prompts.columns.items()}
        columns["completion_ids"] = ids  # as TRL passes them: each completion's token ids, its EOS included
        try:
            table = reward_table(self.rewards, repeat, texts, **columns)
        except ValueError as e:
            raise ConfigError(f"GRPOConfig.reward: {e}") from None
        self._warn_unscored(table)
        advantages, totals = group_advantages(table, g, weights=self.weights, scale_rewards=s.scale_rewards)
        batch = {"tokens": tokens, "completion": completion, "advantages": advantages}
        if self.iterations > 1:  # the policy moves within the block: the ratio needs the sampler's
            batch["old_logps"] = old
        sample = self._sample(repeat[0], texts[0], float(totals[0]))
        return batch, self._metrics(table, totals, lengths, clipped), sample

    def _warn_unscored(self, table: np.ndarray) -> None:
        """Say once a run (on stderr, process 0) when every reward function returned None
        for some completion: it gets advantage 0 and teaches nothing (TRL warns the same)."""
        unscored = int(np.isnan(table).all(axis=1).sum())
        if unscored and not self._warned_unscored and is_main_process():
            self._warned_unscored = True
            print(
                f"zoo: warning: every reward function returned None for {unscored} of {len(table)} completions of a "
                "rollout: they get advantage 0 and teach nothing; make at least one function score each completion "
                "(None means 'does not apply')",
                file=sys.stderr,
                flush=True,
            )

    def _metrics(self, table, totals, lengths, clipped) -> dict[str, float | None]:
        g = self.settings.num_generations
        # A step no function scored (every reward None): the means are NaN, logged as null;
        # numpy's "Mean of empty slice" is a RuntimeWarning that errstate does not silence.
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            groups = totals.reshape(-1, g)
            group_std = _nanstd(groups, axis=1)
            std = _nanstd(totals) if self.settings.scale_rewards == "batch" else group_std
            out = {
                "reward": float(np.nanmean(totals)),
                "reward_std": float(np.nanmean(std)),
                "frac_reward_zero_std": float(np.mean(np.nan_to_num(group_std, nan=0.0) < 1e-6)),
            }
            for j, name in enumerate(self.rewards):
                out[f"rewards/{name}/mean"] = float(np.nanmean(table[:, j]))
                out[f"rewards/{name}/std"] = float(_nanstd(table[:, j]))
        out |= {
            "completions/mean_length": float(np.mean(lengths)),
            "completions/min_length": float(np.min(lengths)),
            "completions/max_length": float(np.max(lengths)),
            "completions/clipped_ratio": float(np.mean(clipped)),
        }
        return {k: (v if math.isfinite(v) else None) for k, v in out.items()}

    @staticmethod
    def _sample(prompt: Any, completion: Any, reward: float) -> dict[str, Any]:
        text = completion if isinstance(completion, str) else completion[0]["content"]
        shown = prompt if isinstance(prompt, str) else json.dumps(prompt[-1].get("content", ""))
        return {"prompt": shown, "completion": text, "reward": float(reward) if math.isfinite(reward) else None}

    # -- the held-out evaluation ----------------------------------------------------------

    def evaluate(self, model: Any, data: Any = None, *, features: bool = False) -> dict[str, Any]:
        """The held-out evaluation of `model`: each held-out prompt completed
        `num_generations` times (the same seeds at every evaluation), the loss and TRL's
        metrics of the objective on them (`loss`, `entropy`, `clip_ratio/*`, `kl` with a
        reference) with the rollout metrics, and one `sample` (prompt, completion, reward)."""
        self.follow(model)
        seeds = np.random.default_rng([0, 0, 2]).integers(
            2**62, size=len(self.held_out) * self.settings.num_generations
        )
        batch, metrics, sample = self.rollout(self.held_out, seeds)
        return {
            **self._objective_metrics(model, batch),
            "accuracy": None,
            "examples": len(batch["tokens"]),
            **metrics,
            "sample": sample,
        }


def _engine(model: Any, device: Any, *, slots: int, max_len: int):
    """The rollout engine over `model`'s base, its adapter in the policy slot."""
    import jax

    from ..lora import LoraExpertLinear, LoraLinear, modules, unload
    from ..serve import Engine

    layers, experts = modules(model, LoraLinear), modules(model, LoraExpertLinear)
    if not layers and not experts:
        raise ConfigError("RunConfig.objective grpo trains LoRA adapters (zoo finetune): the model has none")
    ranks = [int(jax.tree.leaves(_lora_a(model, path))[0].shape[-1]) for path, _ in (layers | experts).values()]
    return Engine(
        on_one_device(unload(model), device),
        slots=slots,
        max_len=max_len,
        adapters={POLICY: model},
        max_adapters=1,
        max_lora_rank=max(ranks),
        lora_targets=sorted(layers),  # room where the policy has branches (its output head too, if adapted)
        lora_parameters=sorted(experts) or None,  # and on its expert weights (a mixture of experts)
    )


def on_one_device(model: Any, device: Any) -> Any:
    """`model` with each array on `device`: a replicated array's own copy there (no new
    buffer), any other gathered there (a copy: under `fsdp` / `tp` the engine holds a whole
    base beside the training step's shards)."""
    import equinox as eqx
    import jax

    here = jax.sharding.SingleDeviceSharding(device)

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_replicated:
            for shard in x.addressable_shards:
                if shard.device == device:  # its buffer, placed as one device's (no copy)
                    return jax.device_put(shard.data, here)
        return jax.device_put(x, here)

    arrays, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.tree.map(one, arrays), static)


def _lora_a(model: Any, path: tuple) -> Any:
    from .._tree import node_at

    return node_at(model, path).lora_A


class RolloutMetrics:
    """A `Trainer`'s `step_metrics`: the rollout metrics of a step (`Rollouts.metrics`),
    added to its training row."""

    def __init__(self, rollouts: Rollouts):
        self.rollouts = rollouts

    def __call__(self, step: int) -> dict[str, Any]:
        return self.rollouts.metrics.pop(step, {})


def eos_ids(folder: Path | None) -> list[int]:
    """The ids that end a completion: `eos_token_id` of the folder's config.json and
    generation_config.json (an id or a list)."""
    found: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((folder / name).read_text()).get("eos_token_id") if folder is not None else None
        except (OSError, ValueError):
            value = None
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v not in found:
                found.append(v)
    return found


# --------------------------------------------------------------------------- the task

# Held-out prompts evaluated when the run does not say (DataConfig.eval_size): each is
# completed num_generations times at every evaluation.
EVAL_PROMPTS = 16


def grpo_task(c: Any, *, rules, mesh) -> Task:
    """The GRPO task of `c` on its prompts file (`c.data.source`, read once):
    `c.data.validation` of the prompts held out (at least one when set), the reward
    functions of `c.grpo.reward` imported before the model is built, the model of `c.model`
    built or read from its init folder."""
    import jax

    from ._user_data import chat_template_of, check_prompts_file, check_tokenizer, tokenizer_source

    if c.lora is None:
        raise ConfigError(
            "RunConfig.objective grpo trains LoRA adapters, served to its rollouts beside the frozen base: run zoo finetune "
            "(RunConfig.lora)"
        )
    if jax.process_count() > 1:
        raise ConfigError(
            f"RunConfig.objective grpo samples its rollouts in one process; this run has {jax.process_count()}: run it in "
            "one process (its devices still split the training step)"
        )
    g = c.grpo.num_generations
    if c.batch_size % g:
        raise ConfigError(
            f"RunConfig.batch_size {c.batch_size} counts completions: make it a multiple of GRPOConfig.num_generations {g} "
            f"(each step samples batch_size / {g} prompts, {g} times each)"
        )
    path, raw = check_prompts_file(c)
    rewards = load_rewards(c.grpo.rewards())  # before the model: a wrong file fails fast
    folder, tokenizer, rust, decode = tokenizer_source(c)
    template, template_digest = chat_template_of(c, folder)
    try:
        _, records, wheres = read_located(path, data=raw)
    except DataFormatError as e:
        raise ConfigError(f"DataConfig.source: {e}") from None
    digest = hashlib.sha256(raw).hexdigest()
    prompts = encode_prompts(
        records,
        wheres,
        rust,
        seq_len=c.data.seq_len,
        chat_template=template,
        system=c.data.system_prompt,
        sha256=digest,
    )
    train_rows, evaluated = _split(path, c, len(prompts))
    model, config, folder = model_spec(c.model).file_model(c, None, rules=rules, mesh=mesh)
    check_tokenizer(config, tokenizer, folder)
    objective = c.grpo_loss()
    rollouts = Rollouts(
        prompts.take(train_rows),
        prompts.take(evaluated),
        rewards,
        c.grpo,
        objective,
        seq_len=c.data.seq_len,
        eos_ids=eos_ids(folder),
        pad_id=0 if tokenizer is None else tokenizer.pad_id,
        decode=decode,
        conversational=any(not isinstance(p, str) for p in prompts.prompts),
        slots=c.batch_size,
    )
    return Task(
        model=model,
        kind="grpo",
        loss_fn=objective,
        metrics_fn=objective.metrics,
        train_source=rollouts,
        seed=c.seed,
        eval_data={"prompts": np.arange(len(evaluated))},
        train_data=None,
        data=f"{path.name}, {len(train_rows)} prompts; {len(evaluated)} held-out prompts evaluated; grpo "
        f"({objective.loss_type}, {g} completions a prompt of at most {c.grpo.max_completion_length} tokens, "
        f"rewards {', '.join(rewards)}, beta {objective.beta})",
        unit="tokens",
        tokens_per_example=c.data.seq_len,
        hf_part=lambda m: m,
        tokenizer_dir=folder if tokenizer is not None else None,
        config=config.to_dict(),
        init=init_name(c, folder),
        fingerprint={"data_sha256": digest, **template_digest},
        evaluate=rollouts.evaluate,
    )


def _split(path: Path, c: Any, n: int) -> tuple[list[int], list[int]]:
    """The training prompts and the held-out ones evaluated (a fixed split: the same on
    resume; without a split, the first training prompts, as an SFT run evaluates)."""
    validation = c.data.validation or 0.0
    held = min(n - 1, max(1, round(n * validation))) if validation and n > 1 else 0
    order = np.random.default_rng(0).permutation(n)
    train_rows, held_rows = sorted(int(i) for i in order[held:]), sorted(int(i) for i in order[:held])
    per_step = c.batch_size // c.grpo.num_generations
    if len(train_rows) < per_step:
        raise ConfigError(
            f"DataConfig.source {path} has {len(train_rows)} training prompts (after holding out DataConfig.validation {validation}), fewer "
            f"than a step's {per_step} (RunConfig.batch_size / GRPOConfig.num_generations); give it more prompts or lower "
            "RunConfig.batch_size"
        )
    return train_rows, (held_rows or train_rows)[: c.data.eval_size or EVAL_PROMPTS]
