"""The console of a run: phase lines while it builds, the header once the step is
compiled (`Header`, before the first step) and the summary after the last (`Report`)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import jax

from .._inspect import report
from .._tree import counted, human_bytes
from ..data import Dataset
from ..lora import LoraExpertLinear, LoraLinear
from ..lora import modules as lora_modules
from ._adapters import AdapterRows
from ._plan import init_family
from ._registry import model_spec
from ._summary import RunRecord
from ._text import mesh_text
from ._trainer import Hook, TrainState


class Phases:
    """Prints one line before each long phase of a run, with the seconds since it began
    (nothing when `quiet`)."""

    def __init__(self, t_start: float, *, quiet: bool):
        self.t_start, self.quiet = t_start, quiet

    def __call__(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t_start:6.1f}s] {text}", flush=True)


def _say(text: str = "") -> None:
    print(text, flush=True)


def lora_layer_count(model) -> int:
    """How many Linear layers of `model` carry a LoRA branch, each layer of a stack counted
    (a stack's layers share one module whose arrays lead with the layer axes)."""
    return sum(
        math.prod(x.shape[:-2])
        for path, x in jax.tree_util.tree_leaves_with_path(model)
        if jax.tree_util.keystr(path).endswith(".lora_A")
    )


class Header(Hook):
    """Before the first step: what the run trains, on what, how (model, data, devices,
    mesh, steps, LoRA), the compile time, then the training phase line."""

    def __init__(self, record: RunRecord, phases: Phases):
        self.record, self.phases = record, phases

    def on_start(self, state: TrainState) -> None:
        r = self.record
        c = r.plan.config
        sizes = r.step_sizes(state.model)
        _print_header(
            _say,
            c,
            r.built.task,
            r.plan.title,
            c.devices,
            r.plan.mesh_shape,
            c.lora,
            state.model,
            r.built.parameters,
            r.built.model_bytes,
            sizes["trainable"],
            sizes["adapter"],
            r.seconds["compile"],
            r.start,
            c.optimizer.warmup_steps(c.steps),
            _chosen(r),
        )
        steps = f"step {c.steps}" if r.start + 1 == c.steps else f"steps {r.start + 1} to {c.steps}"
        self.phases(f"training {steps}, {_cadence(c.eval_interval, r.start, c.steps)}...")


def _idle_devices(mesh_shape: dict[str, int], devices: int) -> str:
    """The header's line for a mesh smaller than `--devices` (allowed: `mesh_shape_of`):
    how many devices it leaves idle and the flags that use them all."""
    used = math.prod(mesh_shape.values())
    text = f"note: the mesh {mesh_text(mesh_shape)} uses {used} of the {devices} devices; "
    if devices % used == 0:
        grown = dict(mesh_shape, data=mesh_shape["data"] * devices // used)
        text += f"to use all {devices} pass --mesh {mesh_text(grown)}, or ask for {used} with --devices {used}"
    else:
        text += f"ask for {used} with --devices {used}, or give --mesh axes whose sizes multiply to {devices}"
    return text


def _cadence(every: int, start: int, steps: int) -> str:
    """When a run evaluates between steps `start` and `steps` (`Evaluate`: after each
    multiple of `every`, and after the last step), as the header says it: an interval
    that no step of the run reaches (`--eval-every 15` of 12 steps) is not named."""
    between = (steps - 1) // every - start // every if every else 0  # multiples of every in (start, steps)
    if not between:
        return "evaluating after the last step"
    return "evaluating after every step" if every == 1 else f"evaluating every {every} steps"


def _chosen(r: RunRecord) -> str:
    """What the header says of a batch `RunConfig.resolved` chose below the model's default
    (`--batch-size` unset: the largest the mesh and the data's rows allow), else nothing."""
    c = r.plan.config
    default = model_spec(c.model).defaults_for(r.plan.command)["batch_size"]
    if "batch_size" not in c.derived or c.batch_size == default:
        return ""
    source = r.built.task.train_source
    rows = f" and the {counted(len(source), 'training row')}" if hasattr(source, "__len__") else ""
    return f" (--batch-size unset: the largest up to the default {default} that the mesh{rows} allow)"


class Report(Hook):
    """After the last step (and the `Summary` hook): the summary table, sizes,
    collectives, times, outputs and whether the loss fell."""

    def __init__(self, record: RunRecord):
        self.record = record

    def on_end(self, state: TrainState) -> None:
        r = self.record
        _print_summary(_say, r.summary, r.built.task, r.collectives, r.plan.output, r.plan.config.lora)


def _print_header(
    say,
    c,
    task,
    title,
    devices,
    mesh_shape,
    lcfg,
    model,
    base_params,
    base_bytes,
    trainable_bytes,
    adapter_bytes,
    compile_s,
    start,
    warmup,
    chosen="",
) -> None:
    backend = jax.default_backend()
    where = "simulated CPU device" if backend == "cpu" else f"{backend.upper()} device"
    where += "" if devices == 1 else "s"
    say(f"zoo {title}")
    family = init_family(c.init)  # a Hugging Face base's model_type ("llama", "qwen3"): what a user calls it
    say(
        f"model: {c.model}{f' ({family})' if family else ''}, {base_params:,} parameters ({human_bytes(base_bytes)})"
        + (f", from {task.init}" if task.init else ", initialised from scratch")
    )
    say(f"data: {task.data}")
    if task.label_names:
        say(f"classes: {', '.join(task.label_names)}")
    procs = jax.process_count()
    where += f" in {procs} processes" if procs > 1 else ""
    say(f"devices: {devices} {where}, mesh {mesh_text(mesh_shape)}, rules {c.rules}, mode {c.mode}")
    if math.prod(mesh_shape.values()) < devices:
        say(_idle_devices(mesh_shape, devices))
    say(
        f"steps: {c.steps} of global batch {c.batch_size}{chosen} in {counted(c.microbatches, 'microbatch', 'microbatches')}, {c.optimizer.name} "
        f"lr {c.optimizer.lr:g} ({c.optimizer.schedule}, warmup {warmup}), {c.dtype} compute"
        + (f"; resumed at step {start}" if start else "")
    )
    if lcfg is not None:
        adapted = lora_modules(model, (LoraLinear, LoraExpertLinear))  # the experts count in the layers too
        names = sorted({n.split(".")[-1] for n in adapted})
        extra = trainable_bytes - adapter_bytes
        say(
            f"LoRA r={lcfg.r} alpha={lcfg.lora_alpha:g} on {counted(lora_layer_count(model), 'Linear layer')} ({', '.join(names)})"
            + (f" + {', '.join(lcfg.modules_to_save)} trained in full" if lcfg.modules_to_save else "")
            + f": {human_bytes(adapter_bytes)} of adapters"
            + (f" + {human_bytes(extra)}" if extra else "")
        )
    say(f"step compiled in {compile_s:.1f} s")


def _print_best(say, summary) -> None:
    """Where the run stopped early and which checkpoint is its best (when it watched a metric)."""
    if summary.get("stopped_early"):
        stop = summary["stopped_early"]
        say(f"stopped early after step {stop['step']} of {summary['steps']}: {stop['reason']}")
    best = summary.get("best")
    if best and best["checkpoint"]:
        say(
            f"best checkpoint: step {best['step']} ({best['metric']} {best['value']:.4f}) in {best['checkpoint']} "
            f"(continue from it with --resume-step {best['step']})"
        )
    elif best and best["step"] is None:
        say(f"best checkpoint: none (no evaluation after a step measured a finite {best['metric']})")


def _print_summary(say, summary, task, colls, output: Path, lcfg) -> None:
    say()
    ev_name = {"classification": "test", "lm": "validation"}.get(task.kind, "held-out")
    n = summary["eval_after"]["examples"]
    what = {"classification": "text", "lm": _lm_rows(task), "regression": "example", "preference": "pair"}
    what = what.get(task.kind, "completion")  # grpo: completions of the held-out prompts
    has_acc = summary["eval_after"]["accuracy"] is not None
    acc_name = {"classification": "accuracy", "preference": "preference acc."}.get(task.kind, "next-token acc.")
    has_reward = summary["eval_after"].get("reward") is not None  # grpo: the mean reward of the completions
    head = f"{ev_name} set, {counted(n, what)}"
    width = max(len(head), 2 + max(len(st["name"]) for st in summary["stages"])) + 2
    say(
        f"{head:<{width}}{'loss':>8}"
        + (f"{acc_name:>18}" if has_acc else "")
        + (f"{'reward':>10}" if has_reward else "")
    )
    for st in summary["stages"]:
        acc = f"{100 * st['accuracy']:17.1f}%" if has_acc and st.get("accuracy") is not None else ""
        reward = f"{st['reward']:10.4f}" if has_reward and st.get("reward") is not None else ""
        say(f"  {st['name']:<{width - 2}}{st['loss']:8.4f}{acc}{reward}")
    for name, own in (summary.get("adapters") or {}).items():  # several adapters: each on its own rows
        before = "" if own["eval_loss_before"] is None else f"{own['eval_loss_before']:.4f} -> "
        say(f"  adapter {name}: {ev_name} loss {before}{own['eval_loss_after']:.4f}, saved in {own['folder']}")
    probe, last = summary["probe"], summary["stages"][-1]
    if probe is not None and has_acc and last is not probe:  # what training the encoder bought
        margin = 100 * (last["accuracy"] - probe["accuracy"])
        say(f"{last['name'].split(' after ')[0]} vs the linear probe: {margin:+.1f} points of {ev_name} accuracy")
    _print_best(say, summary)
    model_bytes, trainable = summary["model_bytes"], summary["trainable_bytes"]
    if lcfg is not None:
        adapter = summary["adapter_bytes"]
        extra = trainable - adapter
        say(
            f"adapter: {human_bytes(trainable)} ({human_bytes(adapter)} LoRA"
            + (f" + {human_bytes(extra)} {'+'.join(lcfg.modules_to_save)}" if extra else "")
            + f") = {100 * trainable / model_bytes:.2f}% of the model's {human_bytes(model_bytes)}"
        )
    else:
        say(f"trained: {human_bytes(trainable)} of the model's {human_bytes(model_bytes)}")
    c = summary["collectives"]
    kinds = "/".join(c["gradient_reduction_kinds"]) or "all-reduce"
    what = (
        "adapter" + ("+head" if lcfg.modules_to_save and task.classifier else "") if lcfg is not None else "trainable"
    )
    per_device = summary["trainable_bytes_per_device"]
    scalars = c["gradient_bytes"] - per_device
    split = "" if per_device == trainable else " per device"
    inside = c["collectives_in_loop"]
    in_loop = f"; {counted(inside, 'collective')} inside loops" + (
        f" (over {', '.join(c['in_loop_mesh_axes']) or 'no mesh axis'})" if inside else ""
    )
    if c["gradient_reductions"] == 1 and 0 <= scalars <= 16:
        say(f"collectives of the compiled step: 1 gradient {kinds}, outside the microbatch loop, over data:")
        say(f"  {c['gradient_bytes']:,} bytes = {what} {per_device:,}{split} + loss scalars {scalars:,}{in_loop}")
    else:  # e.g. fsdp on CPU: XLA splits the reduction, and the optimizer's norms add their own
        say(
            f"collectives of the compiled step: {counted(c['gradient_reductions'], kinds)} over data outside the microbatch "
            f"loop, {c['gradient_bytes']:,} bytes in all ({what} {per_device:,} bytes{split}){in_loop}"
        )
    say(report(colls))
    if c.get("budget"):
        say(f"collectives: {c['budget']}")
    secs = summary["seconds"]
    thr = summary["throughput"]
    rate = (
        f"{thr['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in thr else f"{thr['examples_per_s']:,.1f} examples/s"
    )
    say(
        f"time: load + first eval {secs['load'] + secs['evaluate_before']:.1f} s, compile {secs['compile']:.1f} s, "
        f"{counted(summary['last_step'] - (summary['resumed_from'] or 0), 'step')} {secs['train']:.1f} s ({rate}), "
        + (
            f"sampling their rollouts {secs['rollouts']:.1f} s (the first step's before it), "
            if "rollouts" in secs
            else ""
        )
        + f"evaluations and saves between them {secs['hooks']:.1f} s, "
        f"total {secs['total']:.1f} s"
    )
    files = sorted(p.name + ("/" if p.is_dir() else "") for p in output.iterdir() if not p.name.startswith("."))
    say(f"outputs in {output}/: {', '.join(files)}")
    if "model_not_saved" in summary["outputs"]:
        say(f"  (no Hugging Face model/ folder: {summary['outputs']['model_not_saved']})")
    if summary.get("sample"):
        smp = summary["sample"]
        say(
            f"sample ({smp['new_tokens']} tokens, greedy, after the start of a validation {_lm_rows(task)}): "
            f"{smp['prompt']!r} -> {smp['completion']!r}"
        )
    if summary.get("reward_rose") is not None:  # grpo: what it maximises
        b, a = summary["eval_before"]["reward"], summary["eval_after"]["reward"]
        say(f"reward rose: {'yes' if summary['reward_rose'] else 'NO'} ({ev_name} mean reward {_apart(b, a)})")
        return
    if summary["eval_before"] is None:  # RunConfig.eval_before off: nothing to compare with
        verdict, name = ("reward rose", "mean reward") if has_reward else ("loss fell", "loss")
        value = summary["eval_after"]["reward" if has_reward else "loss"]
        say(f"{verdict}: not judged (no evaluation before training: --no-eval-before; {ev_name} {name} {value:.4f})")
        return
    b, a = summary["eval_before"]["loss"], summary["eval_after"]["loss"]
    say(f"loss fell: {'yes' if summary['loss_fell'] else 'NO'} ({ev_name} loss {_apart(b, a)})")


def _lm_rows(task) -> str:
    """What a language model's evaluation rows are: a data file's rows (text packed, or
    prompt / completion or chat examples, as the data line counts them), else a built-in
    corpus's windows of its text."""
    return "row" if isinstance(task.train_source, (Dataset, AdapterRows)) else "window"


def _apart(before: float, after: float) -> str:
    """`before -> after` to 4 decimals, or as many more (up to 8) as tell two different
    values apart: a verdict never shows equal numbers for values it found different."""
    digits = 4
    while digits < 8 and before != after and f"{before:.{digits}f}" == f"{after:.{digits}f}":
        digits += 1
    return f"{before:.{digits}f} -> {after:.{digits}f}"
