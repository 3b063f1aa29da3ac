"""The summary hook: after the last step, summary.json and loss.png from what the run's
stages recorded (`RunRecord`)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import equinox as eqx
import jax

from .._inspect import Collective, collective_summary
from .._tree import counted, tree_bytes, tree_size
from ..lora import trainable as lora_trainable
from ..lora._named import lora_json
from ._build import BuiltRun
from ._hooks import Evaluate, KeepBest, Sample
from ._output import plot_losses, read_metrics, write_json
from ._plan import RunPlan
from ._trainer import Hook, TrainState


@dataclasses.dataclass
class RunRecord:
    """What a run's stages found, for its summary: filled in as the run goes.

    - `plan`, `built`: the run's plan and what it trains with; `start`: the resumed step.
    - `stages`: the evaluations of the summary's table (before training, the probe, after);
      `before`: the evaluation training starts from (None: `RunConfig.eval_before` off).
    - `evaluations`: the `Evaluate` hook; `sample`: the `Sample` hook (decoders), or None;
      `best`: the `KeepBest` hook (`keep_best`, `early_stop`), or None.
    - `collectives`: the compiled step's; `seconds`: load, first evaluation, compile;
      `t_start`: when the run began (`time.perf_counter`).
    - `outputs`: the files the export wrote (the `Export` hook's `outputs`).
    - `summary`: what summary.json holds, once the `Summary` hook made it (None before).
    """

    plan: RunPlan
    built: BuiltRun
    t_start: float
    start: int = 0
    stages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    before: dict[str, Any] | None = None
    evaluations: Evaluate | None = None
    sample: Sample | None = None
    best: KeepBest | None = None
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    summary: dict[str, Any] | None = None
    sizes: dict[str, int] | None = None

    def step_sizes(self, model) -> dict[str, int]:
        """Bytes of the trained leaves (all, and each device's share: what it reduces over
        `data`, less under tp/fsdp) and of the LoRA branches alone; measured once (training
        changes values, not shapes or placement)."""
        if self.sizes is not None:
            return self.sizes
        trained = self.built.step.partition(model)[0]
        lcfg = self.plan.config.lora
        self.sizes = {
            "trainable": tree_bytes(trained),
            "per_device": sum(
                math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                for x in jax.tree.leaves(eqx.filter(trained, eqx.is_array))
            ),
            "adapter": tree_bytes(eqx.filter(model, lora_trainable(model))) if lcfg is not None else 0,
        }
        return self.sizes


class Summary(Hook):
    """After the last step: the run's summary (into `record.summary`: what summary.json
    holds), and on process 0 summary.json and loss.png in the run's folder."""

    def __init__(self, record: RunRecord, *, main: bool):
        self.record, self.main = record, main

    def on_end(self, state: TrainState) -> None:
        r = self.record
        c, task, trainer = r.plan.config, r.built.task, state.trainer
        opt, steps, start, last = c.optimizer, c.steps, r.start, state.step  # last: < steps when stopped early
        after = r.evaluations.results[-1][1]
        r.stages.append(
            {
                "name": ("LoRA" + (" + head" if task.classifier else "") if c.lora is not None else "trained")
                + f" after {counted(last, 'step')}",
                **after,
            }
        )
        colls = r.collectives
        grads = [
            x for x in colls if not x.in_loop and "data" in x.mesh_axes and x.kind in ("all-reduce", "reduce-scatter")
        ]
        sizes = r.step_sizes(state.model)
        train_s = trainer.train_seconds
        rates = r.built.rates
        sample = r.sample.results[-1] if r.sample is not None and r.sample.results else None
        r.summary = {
            "command": r.plan.command,
            "model": c.model,
            "title": r.plan.title,
            "data": task.data,
            "init": task.init,
            "devices": c.devices,
            "processes": jax.process_count(),
            "backend": jax.default_backend(),
            "mesh": r.plan.mesh_shape,
            "rules": c.rules,
            "microbatches": c.microbatches,
            "batch_size": c.batch_size,
            "steps": steps,
            "last_step": last,
            "resumed_from": start or None,
            "stopped_early": None if trainer.stop_reason is None else {"step": last, "reason": trainer.stop_reason},
            "best": None if r.best is None else r.best.record(r.plan.checkpoints),
            "optimizer": {
                "name": opt.name,
                "lr": opt.lr,
                "schedule": opt.schedule,
                "warmup": opt.warmup_steps(steps),
                "first_lr": float(rates[0]),
                "last_lr": float(rates[-1]),
            },
            "eval_every": c.eval_interval,
            "eval_before": r.before,
            "eval_after": after,
            "evals": [{"step": i, **ev} for i, ev in r.evaluations.results if 0 < i < last and i != start],
            "stages": r.stages,
            "probe": next((st for st in r.stages if st.get("baseline")), None),
            "loss_fell": None if r.before is None else after["loss"] < r.before["loss"],
            "train_loss_first": trainer.losses[0] if trainer.losses else None,
            "train_loss_last": trainer.losses[-1] if trainer.losses else None,
            "skipped_nonfinite_steps": trainer.skipped if c.skip_nonfinite else None,
            "parameters": r.built.parameters,
            "model_bytes": r.built.model_bytes,
            "trainable_parameters": tree_size(r.built.step.partition(state.model)[0]),
            "trainable_bytes": sizes["trainable"],
            "trainable_bytes_per_device": sizes["per_device"],
            "adapter_bytes": sizes["adapter"] if c.lora is not None else None,
            "lora": None if c.lora is None else lora_json(state.model, c.lora),
            "collectives": {
                **collective_summary(colls),
                "gradient_reductions": len(grads),
                "gradient_reduction_kinds": sorted({x.kind for x in grads}),
                "gradient_bytes": sum(x.bytes for x in grads),
                "list": [x.to_json() for x in colls],
                "budget": r.built.step.budget_verdict,
            },
            "reward_rose": _reward_rose(r.before, after),
            "seconds": {
                **r.seconds,
                "train": train_s,
                **_rollout_seconds(task),
                "hooks": trainer.hook_seconds,
                "total": time.perf_counter() - r.t_start,
            },
            "throughput": {
                "examples_per_s": (last - start) * c.batch_size / max(train_s, 1e-9),
                **(
                    {"tokens_per_s": (last - start) * c.batch_size * task.tokens_per_example / max(train_s, 1e-9)}
                    if task.unit == "tokens"
                    else {}
                ),
            },
            "outputs": r.outputs,
            "adapters": _adapters(r, after),
            "sample": None if sample is None else {k: sample[k] for k in ("prompt", "completion", "new_tokens")},
        }
        if self.main:
            baselines = {f"{st['name']}, eval": st["loss"] for st in r.stages if st.get("baseline")}
            output = r.plan.output
            plot_losses(read_metrics(output / "metrics.jsonl"), output / "loss.png", r.plan.title, baselines)
            write_json(output / "summary.json", r.summary)


def _adapters(r: RunRecord, after: dict[str, Any]) -> dict[str, Any] | None:
    """Several adapters trained at once: per adapter its held-out loss before and after,
    and its peft folder (None for a one-model run)."""
    names = r.built.task.adapter_names
    if names is None:
        return None
    folders = r.outputs.get("adapters", {})
    return {
        n: {
            "eval_loss_before": None if r.before is None else r.before.get(f"loss/{n}"),
            "eval_loss_after": after.get(f"loss/{n}"),
            "folder": folders.get(n),
        }
        for n in names
    }


def _reward_rose(before: dict[str, Any] | None, after: dict[str, Any]) -> bool | None:
    """A GRPO run's verdict: the held-out mean reward above the first evaluation's (None
    for other tasks, and without an evaluation before training)."""
    if after.get("reward") is None or before is None:
        return None
    return after["reward"] > (before.get("reward") if before.get("reward") is not None else -math.inf)


def _rollout_seconds(task: Any) -> dict[str, float]:
    """`{"rollouts": seconds}` spent sampling a GRPO run's training batches ({} otherwise)."""
    seconds = getattr(task.train_source, "train_rollout_seconds", None)
    return {} if seconds is None else {"rollouts": seconds}
