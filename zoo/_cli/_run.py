"""The one training loop behind `zoo train`, `zoo finetune` and `zoo demo`.

Build the task on the mesh → (LoRA) → place → compile the step once (the program both run
and inspected) → evaluate → (fit a classifier's head on frozen features) → train with a
progress bar, metrics.jsonl, evaluations and checkpoints → evaluate → save the adapter
or the model → loss.png, summary.json, and the summary on stdout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import time
from pathlib import Path
from typing import Any

from ..train._preemption import Preemption
from ._common import (
    CLIError,
    Preempted,
    RunStopped,
    check_rules_fit_mesh,
    collective_summary,
    make_mesh,
    mesh_text,
    tree_bytes,
    tree_size,
)
from ._lora_flag import add_lora, finetune_defaults, lora_json, parse_lora
from ._output import Metrics, Progress, human_bytes, plot_losses, read_metrics, write_json
from ._tasks import Task, TaskSettings, build_task

OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adafactor")
# What the tokenizer of a saved model needs next to its weights.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                    "sentence_bert_config.json")  # fmt: skip


def lr_schedule(lr: float, steps: int, warmup: int, schedule: str):
    """`(host, traced)`: the learning rate at a step count as a Python float (for
    metrics.jsonl, no device op) and as the traced function optax calls. A linear warmup
    from 0 over `warmup` steps, then `lr` (`"constant"`) or a cosine decay to `lr/10` at
    `steps` (`"cosine"`, as `optax.warmup_cosine_decay_schedule`)."""
    end, decay = lr / 10, max(steps - warmup, 1)

    def host(count: int) -> float:
        if count < warmup:
            return lr * count / warmup
        if schedule == "constant":
            return lr
        t = min(count - warmup, decay) / decay
        return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * t))

    def traced(count):
        import jax.numpy as jnp

        count = jnp.asarray(count, jnp.float32)
        if schedule == "constant":
            after = jnp.float32(lr)
        else:
            t = jnp.clip(count - warmup, 0, decay) / decay
            after = end + (lr - end) * 0.5 * (1 + jnp.cos(jnp.pi * t))
        return jnp.where(count < warmup, lr * count / max(warmup, 1), after)

    return host, traced


def make_optimizer(name: str, lr: float, steps: int, *, warmup: int, schedule: str, weight_decay: float, clip: float):
    """`(optimizer, lr_at)`: global-norm clipping at `clip` (0: none), then `name`
    (adamw, adam, sgd with Nesterov momentum 0.9, lion, adafactor) on `lr_schedule`;
    weight decay for adamw, lion, sgd. `lr_at(step)` is the host-side rate."""
    import optax

    lr_at, rate = lr_schedule(lr, steps, warmup, schedule)
    if name == "adamw":
        opt = optax.adamw(rate, weight_decay=weight_decay)
    elif name == "adam":
        opt = optax.adam(rate)
    elif name == "sgd":
        opt = optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(rate, momentum=0.9, nesterov=True))
    elif name == "lion":
        opt = optax.lion(rate, weight_decay=weight_decay)
    else:
        opt = optax.adafactor(rate)
    return (optax.chain(optax.clip_by_global_norm(clip), opt) if clip > 0 else opt), lr_at


# --- evaluation ------------------------------------------------------------------------------


class Evaluator:
    """Held-out loss and accuracy of a model: the task's `metrics_fn` jitted, run on
    fixed-size chunks split over the data axis (the last chunk padded with weight-0 rows).

    Padded texts (a `mask` in the data) are evaluated shortest first, each chunk cut to
    its longest text rounded up to a multiple of `bucket` positions: most docstrings are
    far shorter than the training length, so this does a fraction of the work, for one
    compile per bucket (a few at most)."""

    def __init__(self, task: Task, mesh, rows: int, *, bucket: int = 16):
        import equinox as eqx

        self.task, self.mesh, self.rows, self.bucket = task, mesh, rows, bucket
        self._fn = eqx.filter_jit(task.metrics_fn)

    def __call__(self, model, data: dict, *, features: bool = False) -> dict[str, Any]:
        """`{"loss", "accuracy" (None for regression), "examples", "features" (numpy, in
        the rows' order, when asked)}` over every row of `data`."""
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        n = len(next(iter(data.values())))
        sharding = NamedSharding(self.mesh, P("data"))
        lengths = data["mask"].sum(axis=1) if "mask" in data else None
        order = np.argsort(lengths, kind="stable") if lengths is not None else np.arange(n)
        outs, feats = [], []
        for start in range(0, n, self.rows):
            rows = order[start : start + self.rows]
            chunk = {k: v[rows] for k, v in data.items()}
            if lengths is not None:  # cut the padding every row of the chunk has
                seq = data["mask"].shape[1]
                keep = min(seq, -(-int(lengths[rows].max()) // self.bucket) * self.bucket)
                chunk = {k: v[:, :keep] if v.ndim == 2 and v.shape[1] == seq else v for k, v in chunk.items()}
            m = len(rows)
            if m < self.rows:  # pad with copies of the first row, weighted 0
                chunk = {k: np.concatenate([v, np.repeat(v[:1], self.rows - m, axis=0)]) for k, v in chunk.items()}
            chunk["weight"] = (np.arange(self.rows) < m).astype(np.float32)
            out = self._fn(model, put_rows(chunk, sharding))
            outs.append({k: v.sum() for k, v in out.items() if k != "features"})
            if features:
                feats.append(np.asarray(out["features"])[:m])
        sums = {"loss": 0.0, "weight": 0.0, "correct": 0.0}
        for out in outs:
            for k, v in out.items():
                sums[k] += float(v)
        result = {
            "loss": sums["loss"] / max(sums["weight"], 1e-12),
            "accuracy": None if self.task.kind == "regression" else sums["correct"] / max(sums["weight"], 1e-12),
            "examples": n,
        }
        if features:
            result["features"] = np.empty_like(np.concatenate(feats))
            result["features"][order] = np.concatenate(feats)
        return result


def head_metrics(features, labels, weight, bias) -> dict[str, Any]:
    """Loss and accuracy of a linear head `features @ weight + bias` (numpy, float64)."""
    import numpy as np

    logits = features @ weight + bias
    logits = logits - logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    loss = -logp[np.arange(len(labels)), labels].mean()
    return {"loss": float(loss), "accuracy": float((logits.argmax(axis=1) == labels).mean()), "examples": len(labels)}


def fit_head(features, labels, weight, bias, *, steps: int, lr: float = 1e-2, l2: float = 1e-3):
    """A linear probe: softmax regression of `labels` on frozen `features`, full-batch
    Adam for `steps` steps from the head's `(weight [d, k], bias [k])`, L2 penalty `l2`
    on the weight. numpy: a few hundred steps on a thousand rows take a second."""
    import numpy as np

    x, y = features.astype(np.float64), labels
    w, b = np.array(weight, np.float64), np.array(bias, np.float64)
    onehot = np.eye(w.shape[1])[y]
    moments = [np.zeros_like(w), np.zeros_like(b), np.zeros_like(w), np.zeros_like(b)]
    for t in range(1, steps + 1):
        logits = x @ w + b
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / len(y)
        grads = (x.T @ g + l2 * w, g.sum(axis=0))
        for i, (param, grad) in enumerate(zip((w, b), grads)):
            m, v = moments[i], moments[i + 2]
            m[...] = 0.9 * m + 0.1 * grad
            v[...] = 0.999 * v + 0.001 * grad**2
            param -= lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    return w, b


# --- the run ---------------------------------------------------------------------------------


def put_rows(batch: dict, sharding) -> dict:
    """A whole numpy batch (the same in every process) on the devices of `sharding`, dim 0
    split over its data axis. In a multi-process run each process hands over only the rows
    its own devices hold (`zoo.local_rows`), so no process copies rows it does not keep."""
    import jax

    import zoo

    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    rows = zoo.local_rows(len(next(iter(batch.values()))), sharding.mesh)
    return zoo.global_batch({k: v[rows] for k, v in batch.items()}, sharding.mesh)


class _NoMetrics:
    """metrics.jsonl in processes other than 0: they train, process 0 writes."""

    def write(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass
class RunResult:
    """What a run returns to its command: the summary (as in summary.json) and the folder."""

    summary: dict[str, Any]
    output: Path


def _data_size(mesh_shape: dict[str, int]) -> int:
    return mesh_shape["data"]


def check_layout(s: dict[str, Any], mesh_shape: dict[str, int], devices: int) -> None:
    """Everything about the mesh and the batch that can fail, before anything is built."""
    if "data" not in mesh_shape:
        raise CLIError(
            f"--mesh {mesh_text(mesh_shape)} has no 'data' axis, which the batch is split over; "
            f"add one, e.g. --mesh data={devices}"
        )
    check_rules_fit_mesh(s["rules"], mesh_shape, devices)
    data, m, bsz = mesh_shape["data"], s["microbatches"], s["batch_size"]
    if m < 1:
        raise CLIError(f"--microbatches must be >= 1, got {m}")
    if bsz < 1 or bsz % (data * m):
        unit = data * m
        raise CLIError(
            f"--batch-size {bsz} is not divisible by data-parallel size {data} x microbatches {m} = {unit}; "
            f"use a multiple of {unit}, e.g. {max(unit, round(bsz / unit) * unit)}"
        )


def checkpoint_dir(s: dict[str, Any], output: Path) -> Path:
    """Where the run's checkpoints go: --checkpoint-dir, else OUTPUT/checkpoints."""
    return Path(s["checkpoint_dir"]).expanduser() if s["checkpoint_dir"] else output / "checkpoints"


def check_checkpoints(s: dict[str, Any], output: Path) -> None:
    """--resume needs a checkpoint before --steps; a run without it must not write into a
    folder of checkpoints or of another run's outputs (it would mix two runs), unless
    --overwrite. Checked (read-only) once the folder's lock is held, before anything is
    written."""
    from ._lock import previous_outputs, remove_outputs

    folder = checkpoint_dir(s, output)
    saved = []
    if folder.is_dir():
        import zoo

        # Read-only: opening it for writing would delete the temporary folders of saves in flight.
        # An empty step folder (a save that never started writing) is no step.
        saved = [n for n in zoo.Checkpointer(folder, read_only=True).steps() if any((folder / str(n)).iterdir())]
    if s.get("overwrite") and not s["resume"]:
        remove_outputs(output, folder)
        return
    if s["resume"]:
        if not saved:
            raise CLIError(
                f"--resume: no checkpoint in {folder}; run without --resume, or point --checkpoint-dir "
                "(or --output) at the earlier run's"
            )
        n = s.get("resume_step")
        if n is not None:
            if n not in saved:
                raise CLIError(f"--resume-step {n}: no such checkpoint in {folder}; its steps are {saved}")
            if n >= s["steps"]:
                raise CLIError(f"--resume-step {n} is not before --steps {s['steps']}; raise --steps")
            later = [k for k in saved if k > n]
            if later and not s.get("overwrite"):
                raise CLIError(
                    f"--resume-step {n}: {folder} also holds the later steps {later}, which this run would "
                    "replace; pass --overwrite to delete them, or resume from the newest"
                )
            for k in later:
                shutil.rmtree(folder / str(k))
        elif saved[-1] > s["steps"] or (saved[-1] == s["steps"] and (output / "summary.json").exists()):
            # (at --steps without a summary: killed after its final checkpoint; the run finishes it)
            raise CLIError(
                f"--resume: the checkpoint in {folder} is at step {saved[-1]}, not before --steps {s['steps']}; "
                "raise --steps to train further"
            )
    elif saved:
        raise CLIError(
            f"{folder} already holds checkpoints (steps {saved}); pass --resume to continue from them, "
            "--overwrite to replace that run, or choose another --output or --checkpoint-dir"
        )
    elif previous_outputs(output):
        raise CLIError(
            f"--output {output} already holds another run's outputs ({', '.join(previous_outputs(output))}); "
            "pass --overwrite to replace them, or choose another --output"
        )


def run(s: dict[str, Any], *, command: str, devices: int, mesh_shape: dict[str, int], output: Path,
        title: str, config: dict[str, Any]) -> RunResult:  # fmt: skip
    """Train (`s["lora"]` None) or LoRA-fine-tune model `s["model"]` with the resolved
    flags `s`, writing into `output` (`config` as its config.json, once the model is
    built). Prints the summary; returns it."""
    import equinox as eqx
    import jax
    import numpy as np

    import zoo

    t_start = time.perf_counter()
    # Every process trains; only process 0 prints and writes metrics, plots and summaries.
    main = zoo.is_main_process()
    quiet = s["quiet"] or not main

    def say(text: str = "") -> None:
        if main:
            print(text, flush=True)

    mesh = make_mesh(mesh_shape)
    rules = zoo.rules(s["rules"])
    data_size = _data_size(mesh_shape)
    finetune = s.get("lora") is not None
    ckpt_dir = checkpoint_dir(s, output)
    steps, bsz, m = s["steps"], s["batch_size"], s["microbatches"]

    # SIGTERM from here on: before the loop the run stops at once (nothing trained yet); in
    # the loop every process stops after the same step and saves it; after it, the run ends.
    early = lambda: Preempted("SIGTERM before training started: nothing was trained or saved; rerun the same command")
    with jax.set_mesh(mesh), Preemption(enabled=True, early=early) as preemption:
        # -- build ----------------------------------------------------------------------------
        settings = TaskSettings(
            name=s["model"], data=s["data"], seq_len=s["seq_len"], seed=s["seed"], dtype=s["dtype"],
            model_config=s["model_config_values"], init=s["init"], eval_size=s["eval_size"],
        )  # fmt: skip
        task = build_task(settings, rules=rules, mesh=mesh)
        lcfg = parse_lora(s["lora"], finetune_defaults(task.classifier)) if finetune else None
        if lcfg is not None and task.kind == "regression":
            raise CLIError("zoo finetune: the mlp has no pretrained weights to adapt; train it with zoo train mlp")
        if s["probe"] and not task.classifier:
            raise CLIError(f"--probe fits a classifier's head; {s['model']} has none: drop --probe")
        base_bytes, base_params = tree_bytes(task.model), tree_size(task.model)
        model = task.model if lcfg is None else add_lora(task.model, lcfg, s["seed"])
        try:
            model = zoo.shard(model, rules, mesh)
        except ValueError as e:
            raise CLIError(str(e).splitlines()[0]) from e
        output.mkdir(parents=True, exist_ok=True)
        if main:
            write_json(output / "config.json", config)
        trainable = zoo.lora.trainable(model, lcfg) if lcfg is not None else eqx.is_inexact_array
        optimizer, lr_at = make_optimizer(
            s["optimizer"], s["lr"], steps, warmup=s["warmup"], schedule=s["schedule"],
            weight_decay=s["weight_decay"], clip=s["clip"],
        )  # fmt: skip
        if s.get("skip_nonfinite"):
            import optax

            # A step whose gradients hold a NaN/inf leaves the weights and moments as they were.
            optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=steps + 1)
        step = zoo.TrainStep(
            task.loss_fn, optimizer, microbatches=m, trainable=trainable, mode=s["mode"], preset=s["rules"]
        )
        params, frozen = step.partition(model)
        opt_state = step.init(model)
        key = jax.random.key(s["seed"])
        dropout = bool(lcfg is not None and lcfg.lora_dropout) or (
            lcfg is None and bool((task.config or {}).get("dropout") or (task.config or {}).get("attention_dropout"))
        )

        own_rows = zoo.local_rows(bsz, mesh) if jax.process_count() > 1 else None

        def batch_of(i: int) -> dict:
            batch = task.train_batch(i, bsz)
            if dropout:  # one key per example: the masks do not depend on the device split
                batch["dropout_key"] = zoo.nn.example_keys(jax.random.fold_in(key, i), bsz)
            if own_rows is not None:  # every process builds the same global batch and keeps its rows
                batch = zoo.global_batch({k: v[own_rows] for k, v in batch.items()}, mesh)
            return batch

        # -- resume -------------------------------------------------------------------------------
        start = 0
        checkpointer = None
        if s["resume"] or s["checkpoint_every"]:
            checkpointer = zoo.Checkpointer(ckpt_dir, keep=s["keep"])
            if s["resume"]:  # check_checkpoints made sure there is one, before --steps
                like = {"params": params, "opt_state": opt_state, "key": key}
                start, state, removed = _restore(checkpointer, like, s.get("resume_step"), ckpt_dir)
                if removed:  # the manager lists the steps it saw when opened
                    checkpointer.close()
                    checkpointer = zoo.Checkpointer(ckpt_dir, keep=s["keep"])
                model = eqx.combine(state["params"], frozen)
                opt_state, key = state["opt_state"], state["key"]

        # -- evaluate, probe --------------------------------------------------------------------
        rows = data_size * max(1, math.ceil(max(bsz, 64) / data_size))
        evaluate = Evaluator(task, mesh, rows)
        stages: list[dict[str, Any]] = []
        t_eval = time.perf_counter()
        if s["probe"] and start == 0:
            # A baseline to compare with: the new head fitted alone on frozen-encoder features
            # (the texts embedded once). Training itself starts from the new head: on a
            # thousand texts a head fitted this close to the training set leaves fine-tuning
            # nothing to learn but overconfidence (its held-out loss only rose from there).
            if not isinstance(model.head, zoo.nn.Linear) or model.head.bias is None:
                raise CLIError("--probe needs the head to stay a plain Linear; keep it out of the LoRA targets")
            test = evaluate(model, task.eval_data, features=True)
            train = evaluate(model, task.train_data, features=True)
            before = _plain(test)
            stages.append({"name": "pretrained encoder + new head", **before})
            w0, b0 = np.asarray(model.head.weight), np.asarray(model.head.bias)
            w, b = fit_head(train["features"], task.train_data["labels"], w0, b0, steps=s["probe"])
            probe = head_metrics(test["features"], task.eval_data["labels"], w, b)
            train_probe = head_metrics(train["features"], task.train_data["labels"], w, b)
            stages.append({"name": "frozen encoder + fitted head (linear probe)", **probe,
                           "train_accuracy": train_probe["accuracy"], "baseline": True})  # fmt: skip
        else:
            before = _plain(evaluate(model, task.eval_data))
            stages.append({"name": "before training" if start == 0 else f"resumed at step {start}", **before})
        eval_s = time.perf_counter() - t_eval
        load_s = t_eval - t_start

        # -- compile once: the program that runs is the one inspected -----------------------
        t0 = time.perf_counter()
        try:
            compiled = step.compile(model, opt_state, batch_of(start + 1))
        except ValueError as e:
            raise CLIError(str(e).splitlines()[0]) from e
        compile_s = time.perf_counter() - t0
        colls = zoo.collectives(compiled, mesh=mesh)
        trained = step.partition(model)[0]
        trainable_bytes = tree_bytes(trained)
        # What each device holds of them, hence reduces over `data` (less under tp/fsdp).
        per_device_bytes = sum(
            math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(eqx.filter(trained, eqx.is_array))
        )
        adapter_bytes = tree_bytes(eqx.filter(model, zoo.lora.trainable(model))) if lcfg is not None else 0

        if not quiet:
            _print_header(say, s, task, title, devices, mesh_shape, lcfg, model, base_params, base_bytes,
                          trainable_bytes, adapter_bytes, compile_s, start)  # fmt: skip

        # -- train ----------------------------------------------------------------------------
        metrics_path = output / "metrics.jsonl"
        if not main:
            metrics = _NoMetrics()
        elif start:  # a resumed run keeps the rows up to its checkpoint
            # At --steps (a run killed after its final checkpoint) its final evaluation is redone.
            redo = ("eval", steps) if start == steps else None
            kept = [
                r
                for r in read_metrics(metrics_path)
                if r.get("step", 0) <= start and (r.get("kind"), r.get("step")) != redo
            ]
            metrics = Metrics(metrics_path)
            for row in kept:
                metrics.write(row)
        else:
            metrics = Metrics(metrics_path)
        elapsed0 = time.perf_counter()
        unit_per_example = task.tokens_per_example if task.unit == "tokens" else 1
        progress = Progress(steps, start=start, unit="tok" if task.unit == "tokens" else "ex", quiet=quiet,
                            label="finetune" if finetune else "train")  # fmt: skip
        if start == 0:
            metrics.write({"kind": "eval", "step": 0, "eval_loss": before["loss"],
                           "eval_accuracy": before["accuracy"], "elapsed": 0.0})  # fmt: skip
        losses: list[float] = []
        last = time.perf_counter()
        train_t0 = last
        pending: tuple[int, Any] | None = None
        skip = bool(s.get("skip_nonfinite"))
        skipped = 0
        last_saved = start or None  # the last good checkpoint: a resumed run's own

        def stop(why: str) -> RunStopped:
            metrics.close()
            progress.close()
            if checkpointer is not None:  # the last good save may still be in flight
                checkpointer.wait()
                checkpointer.close()
            kept = (f"the last good checkpoint is step {last_saved} in {ckpt_dir}" if last_saved
                    else "no checkpoint was saved")  # fmt: skip
            return RunStopped(
                f"{why}: training stopped, nothing saved from it; {kept}. Lower --lr (now {s['lr']:g}), "
                "keep --clip > 0, or pass --skip-nonfinite to skip such steps"
            )

        def check_weights(i: int) -> None:
            """Before a save: a non-finite gradient can leave NaN weights under a finite loss."""
            if not _all_finite(step.partition(model)[0]):
                raise stop(f"step {i}: the weights hold NaN or inf")

        def record(i: int, loss) -> None:
            nonlocal last, skipped
            value = float(loss)  # waits for step i
            now = time.perf_counter()
            rate_ex = bsz / max(now - last, 1e-9)
            last = now
            finite = math.isfinite(value)
            if finite:
                losses.append(value)
            elif skip:
                skipped += 1
            row = {"kind": "train", "step": i, "loss": value, "examples_per_s": rate_ex}
            if task.unit == "tokens":
                row["tokens_per_s"] = rate_ex * unit_per_example
            row |= {"lr": lr_at(i - 1), "elapsed": now - elapsed0}
            if skip:
                row["skipped"] = skipped  # steps skipped so far
            metrics.write(row)
            if not finite and not skip:
                raise stop(f"step {i}: the training loss is {value}")
            progress.update(i, value, rate_ex * unit_per_example)

        evals: list[dict[str, Any]] = []
        try:
            for i in range(start + 1, steps + 1):
                model, opt_state, loss = compiled(model, opt_state, batch_of(i))
                if pending is not None:
                    record(*pending)
                pending = (i, loss)
                due_eval = s["eval_every"] and i % s["eval_every"] == 0 and i != steps
                due_ckpt = checkpointer is not None and s["checkpoint_every"] and i % s["checkpoint_every"] == 0
                if due_eval or due_ckpt:
                    record(*pending)
                    pending = None
                if due_eval:
                    ev = _plain(evaluate(model, task.eval_data))
                    evals.append({"step": i, **ev})
                    metrics.write({"kind": "eval", "step": i, "eval_loss": ev["loss"], "eval_accuracy": ev["accuracy"],
                                   "elapsed": time.perf_counter() - elapsed0})  # fmt: skip
                    progress.note(f"step {i}: eval loss {ev['loss']:.4f}" + _acc_text(ev))
                    last = time.perf_counter()  # evaluation time is not training throughput
                if due_ckpt and i != steps:
                    check_weights(i)
                    checkpointer.save(i, {"params": step.partition(model)[0], "opt_state": opt_state, "key": key},
                                      metadata={"step": i, "model": s["model"]})  # fmt: skip
                    last_saved = i
                if preemption.stop_at(i) and i != steps:  # the same step in every process
                    if pending is not None:
                        record(*pending)
                        pending = None
                    check_weights(i)
                    if checkpointer is None:
                        checkpointer = zoo.Checkpointer(ckpt_dir, keep=s["keep"])
                    if last_saved != i:
                        checkpointer.save(i, {"params": step.partition(model)[0], "opt_state": opt_state,
                                              "key": key}, metadata={"step": i, "model": s["model"]})  # fmt: skip
                    checkpointer.wait()
                    checkpointer.close()
                    metrics.close()
                    progress.close()
                    raise Preempted(f"SIGTERM: stopped after step {i} of {steps}, checkpoint saved in {ckpt_dir}; "
                                    "continue with the same command and --resume")  # fmt: skip
        except BaseException:
            # Ctrl-C, a full disk, a stopped run: a save in flight finishes (or fails) first.
            if checkpointer is not None:
                with contextlib.suppress(Exception):
                    checkpointer.wait()
            raise
        if pending is not None:
            record(*pending)
        check_weights(steps)
        progress.close()
        train_s = time.perf_counter() - train_t0

        # -- evaluate, sample, save ---------------------------------------------------------------
        after = _plain(evaluate(model, task.eval_data))
        text_sample = None
        if task.kind == "lm":  # a decoder shows what it learned: a greedy continuation
            from ._generate import sample

            text_sample = sample(model, task)
        metrics.write({"kind": "eval", "step": steps, "eval_loss": after["loss"], "eval_accuracy": after["accuracy"],
                       "elapsed": time.perf_counter() - elapsed0})  # fmt: skip
        metrics.close()
        stages.append({"name": ("LoRA" + (" + head" if task.classifier else "") if finetune else "trained")
                       + f" after {steps} steps", **after})  # fmt: skip
        saved_files: dict[str, Any] = {}
        if lcfg is not None:
            # Every process calls the savers (sharded leaves are gathered); process 0 writes.
            zoo.lora.save_adapter(model, lcfg, output / "adapter")
            saved_files["adapter"] = str(output / "adapter")
        elif task.hf_part is not None:
            try:
                zoo.hf.save_pretrained(task.hf_part(model), output / "model")
                if task.tokenizer_dir is not None and main:
                    for name in _TOKENIZER_FILES:
                        if (task.tokenizer_dir / name).is_file():
                            shutil.copy(task.tokenizer_dir / name, output / "model" / name)
                saved_files["model"] = str(output / "model")
            except ValueError as e:  # a config Hugging Face's GPT-2 / BERT cannot express
                saved_files["model_not_saved"] = str(e).splitlines()[0]
        # The final state as a checkpoint: in a checkpointed run (--checkpoint-every,
        # --resume), and for a trained model without a Hugging Face folder (the mlp, a
        # transformer GPT-2 cannot express).
        if checkpointer is None and command == "train" and "model" not in saved_files:
            checkpointer = zoo.Checkpointer(ckpt_dir, keep=s["keep"])
        if checkpointer is not None:
            if start < steps:  # (else it is the checkpoint this run resumed from)
                checkpointer.save(steps, {"params": step.partition(model)[0], "opt_state": opt_state, "key": key},
                                  metadata={"step": steps, "model": s["model"]})  # fmt: skip
            checkpointer.wait()
            checkpointer.close()
            saved_files["checkpoints"] = str(ckpt_dir)

    # -- report -------------------------------------------------------------------------------------
    grads = [c for c in colls if not c.in_loop and "data" in c.mesh_axes and c.kind in ("all-reduce", "reduce-scatter")]
    grad_bytes = sum(c.bytes for c in grads)
    fell = after["loss"] < before["loss"]
    summary = {
        "command": command,
        "model": s["model"],
        "title": title,
        "data": task.data,
        "init": task.init,
        "devices": devices,
        "processes": jax.process_count(),
        "backend": jax.default_backend(),
        "mesh": mesh_shape,
        "rules": s["rules"],
        "microbatches": m,
        "batch_size": bsz,
        "steps": steps,
        "resumed_from": start or None,
        "eval_before": before,
        "eval_after": after,
        "evals": evals,
        "stages": stages,
        "probe": next((st for st in stages if st.get("baseline")), None),
        "loss_fell": fell,
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "skipped_nonfinite_steps": skipped if skip else None,
        "parameters": base_params,
        "model_bytes": base_bytes,
        "trainable_parameters": tree_size(step.partition(model)[0]),
        "trainable_bytes": trainable_bytes,
        "trainable_bytes_per_device": per_device_bytes,
        "adapter_bytes": adapter_bytes if lcfg is not None else None,
        "lora": None if lcfg is None else lora_json(model, lcfg),
        "collectives": {
            **collective_summary(colls),
            "gradient_reductions": len(grads),
            "gradient_reduction_kinds": sorted({c.kind for c in grads}),
            "gradient_bytes": grad_bytes,
            "list": [c.to_json() for c in colls],
        },
        "seconds": {
            "load": load_s,
            "evaluate_before": eval_s,
            "compile": compile_s,
            "train": train_s,
            "total": time.perf_counter() - t_start,
        },
        "throughput": {
            "examples_per_s": (steps - start) * bsz / max(train_s, 1e-9),
            **(
                {"tokens_per_s": (steps - start) * bsz * task.tokens_per_example / max(train_s, 1e-9)}
                if task.unit == "tokens"
                else {}
            ),  # fmt: skip
        },
        "outputs": saved_files,
        "sample": text_sample,
    }
    if main:
        baselines = {f"{st['name']}, eval": st["loss"] for st in stages if st.get("baseline")}
        plot_losses(read_metrics(metrics_path), output / "loss.png", title, baselines)
        write_json(output / "summary.json", summary)
        _print_summary(say, summary, task, colls, output, lcfg)
    return RunResult(summary, output)


def _restore(checkpointer, like, step: int | None, folder: Path) -> tuple[int, Any, bool]:
    """`(step, state, removed)` of checkpoint `step`, or of the newest intact one: a
    damaged newer step (unreadable, truncated, an empty folder) is skipped with a one-line
    warning, and removed (it cannot be restored, and the run's next saves would collide
    with it)."""
    import logging
    import sys

    import zoo

    candidates = [step] if step is not None else sorted(checkpointer.steps(), reverse=True)
    skipped: list[tuple[int, str]] = []
    absl = logging.getLogger("absl")
    for n in candidates:
        level = absl.level
        absl.setLevel(max(level, logging.ERROR))  # orbax's own warnings about the damage: ours names it
        try:
            start, state, _ = checkpointer.restore(like, step=n)
        except zoo.CheckpointError as e:
            first = str(e).splitlines()[0]
            if " is damaged: " not in first or step is not None:
                raise CLIError(f"--resume: {first}" + ("" if " is damaged: " in first else
                               " (was it saved with other flags?)")) from e  # fmt: skip
            skipped.append((n, first.split(" is damaged: ")[1]))
            continue
        finally:
            absl.setLevel(level)
        if skipped:
            what = "; ".join(f"step {k}: {why}" for k, why in skipped)
            print(f"zoo: warning: --resume skipped damaged checkpoints ({what}); they are removed, resuming from "
                  f"step {start}", file=sys.stderr, flush=True)  # fmt: skip
            for k, _ in skipped:
                shutil.rmtree(folder / str(k), ignore_errors=True)
        return start, state, bool(skipped)
    what = "; ".join(f"step {k}: {why}" for k, why in skipped)
    raise CLIError(f"--resume: every checkpoint in {folder} is damaged ({what}); start a new run (--overwrite)")


def _all_finite(tree) -> bool:
    """Whether every float leaf of `tree` is free of NaN and inf (one device reduction)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))
    return bool(jax.jit(lambda xs: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in xs])))(leaves))


def _plain(ev: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ev.items() if k != "features"}


def _acc_text(ev: dict[str, Any]) -> str:
    return "" if ev.get("accuracy") is None else f", accuracy {100 * ev['accuracy']:.1f}%"


def _print_header(say, s, task, title, devices, mesh_shape, lcfg, model, base_params, base_bytes, trainable_bytes,
                  adapter_bytes, compile_s, start) -> None:  # fmt: skip
    import jax

    import zoo

    backend = jax.default_backend()
    where = "simulated CPU devices" if backend == "cpu" else f"{backend.upper()} devices"
    say(f"zoo {title}")
    say(f"model: {s['model']}, {base_params:,} parameters ({human_bytes(base_bytes)})"
        + (f", from {task.init}" if task.init else ", initialised from scratch"))  # fmt: skip
    say(f"data: {task.data}")
    if task.label_names:
        say(f"classes: {', '.join(task.label_names)}")
    procs = jax.process_count()
    where += f" in {procs} processes" if procs > 1 else ""
    say(f"devices: {devices} {where}, mesh {mesh_text(mesh_shape)}, rules {s['rules']}, mode {s['mode']}")
    say(
        f"steps: {s['steps']} of global batch {s['batch_size']} in {s['microbatches']} microbatches, {s['optimizer']} "
        f"lr {s['lr']:g} ({s['schedule']}, warmup {s['warmup']}), {s['dtype']} compute"
        + (f"; resumed at step {start}" if start else "")
    )
    if lcfg is not None:
        adapted = zoo.lora.modules(model, zoo.lora.LoraLinear)
        names = sorted({n.split(".")[-1] for n in adapted})
        extra = trainable_bytes - adapter_bytes
        # Stacked layers share one module whose arrays lead with the layer axis.
        layers = sum(
            math.prod(x.shape[:-2])
            for path, x in jax.tree_util.tree_leaves_with_path(model)
            if jax.tree_util.keystr(path).endswith(".lora_A")
        )
        say(
            f"LoRA r={lcfg.r} alpha={lcfg.lora_alpha:g} on {layers} Linear layers ({', '.join(names)})"
            + (f" + {', '.join(lcfg.modules_to_save)} trained in full" if lcfg.modules_to_save else "")
            + f": {human_bytes(adapter_bytes)} of adapters"
            + (f" + {human_bytes(extra)}" if extra else "")
        )
    say(f"step compiled in {compile_s:.1f} s")


def _print_summary(say, summary, task, colls, output: Path, lcfg) -> None:
    import zoo

    say()
    ev_name = {"classification": "test", "lm": "validation", "regression": "held-out"}[task.kind]
    n = summary["eval_after"]["examples"]
    what = {"classification": "texts", "lm": "windows", "regression": "examples"}[task.kind]
    has_acc = summary["eval_after"]["accuracy"] is not None
    acc_name = "accuracy" if task.kind == "classification" else "next-token acc."
    head = f"{ev_name} set, {n} {what}"
    width = max(len(head), 2 + max(len(st["name"]) for st in summary["stages"])) + 2
    say(f"{head:<{width}}{'loss':>8}" + (f"{acc_name:>18}" if has_acc else ""))
    for st in summary["stages"]:
        acc = f"{100 * st['accuracy']:17.1f}%" if has_acc and st.get("accuracy") is not None else ""
        say(f"  {st['name']:<{width - 2}}{st['loss']:8.4f}{acc}")
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
    in_loop = f"; {inside} collectives inside loops" + (
        f" (over {', '.join(c['in_loop_mesh_axes']) or 'no mesh axis'})" if inside else ""
    )
    if c["gradient_reductions"] == 1 and 0 <= scalars <= 16:
        say(f"collectives of the compiled step: 1 gradient {kinds}, outside the microbatch loop, over data:")
        say(f"  {c['gradient_bytes']:,} bytes = {what} {per_device:,}{split} + loss scalars {scalars:,}{in_loop}")
    else:  # e.g. fsdp on CPU: XLA splits the reduction, and the optimizer's norms add their own
        say(
            f"collectives of the compiled step: {c['gradient_reductions']} {kinds}s over data outside the microbatch "
            f"loop, {c['gradient_bytes']:,} bytes in all ({what} {per_device:,} bytes{split}){in_loop}"
        )
    say(zoo.report(colls))
    secs = summary["seconds"]
    thr = summary["throughput"]
    rate = (
        f"{thr['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in thr else f"{thr['examples_per_s']:,.1f} examples/s"
    )
    say(
        f"time: load + first eval {secs['load'] + secs['evaluate_before']:.1f} s, compile {secs['compile']:.1f} s, "
        f"{summary['steps'] - (summary['resumed_from'] or 0)} steps {secs['train']:.1f} s ({rate}), "
        f"total {secs['total']:.1f} s"
    )
    files = sorted(p.name + ("/" if p.is_dir() else "") for p in output.iterdir() if not p.name.startswith("."))
    say(f"outputs in {output}/: {', '.join(files)}")
    if "model_not_saved" in summary["outputs"]:
        say(f"  (no Hugging Face model/ folder: {summary['outputs']['model_not_saved']})")
    if summary.get("sample"):
        smp = summary["sample"]
        say(f"sample ({smp['new_tokens']} tokens, greedy, after the start of a validation window): "
            f"{smp['prompt']!r} -> {smp['completion']!r}")  # fmt: skip
    b, a = summary["eval_before"]["loss"], summary["eval_after"]["loss"]
    say(f"loss fell: {'yes' if summary['loss_fell'] else 'NO'} ({ev_name} loss {b:.4f} -> {a:.4f})")
