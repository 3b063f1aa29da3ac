"""LoRA fine-tuning at real size: `zoo finetune` against transformers + peft, same cores.

A decoder of 0.4B (Qwen2-0.5B's shape: 24 layers, d=896, GQA 14/2) or 1B parameters
(Llama-3.2-1B's: 16 layers, d=2048, GQA 32/8), each with a 32,000-token vocabulary and
tied embeddings, random weights saved by transformers (`build/real_size/<size>/model`,
made once). LoRA r=16 (alpha 32) on every linear layer, AdamW, one device, batch 4 × 256,
the built-in prose (byte tokens: the folder has no tokenizer), one microbatch.

Each side runs in its own process (its peak resident memory is its own), the folder's files
read once just before it starts (`warm`: both sides start from the OS's page cache):

- **zoo**: `zoo finetune transformer --init FOLDER --devices 1 ...` (`zoo._cli.main`, in
  the worker process), the first evaluation on one batch of held-out windows; per-step
  times from its metrics.jsonl. Then it writes the batches the run trained on.
- **torch**: `transformers.AutoModelForCausalLM` from the same folder, `peft` LoRA of the
  same rank on every linear layer, `torch.optim.AdamW`, on those batches
  (`torch.set_num_threads` = the cores).

Printed side by side: median step time (the first step apart), tokens/s, peak resident
memory, time to the first step (from the process's start to its training loop's: imports,
loading, the first evaluation and zoo's compile) and the loss of the first step on both (LoRA's B starts at zero,
so both are the base model's loss on the same batch: equal within rounding). Both sides
evaluate the held-out windows before their first step (zoo's run always does: its
`loss_fell` compares with that loss; torch's side as transformers' `eval_on_start=True`
would), print that loss (equal within rounding), and their time to the first step less
that evaluation; with `--no-eval-before` neither side evaluates (zoo's `--no-eval-before`).

    python benchmarks/real_size.py                       # 0.4B, float32
    python benchmarks/real_size.py --size 1b --steps 4
    python benchmarks/real_size.py --repeat 3            # three side by sides, alternating; medians
    python benchmarks/real_size.py --no-eval-before      # neither side evaluates before its first step
    python benchmarks/real_size.py --size 0.4b --dtype bfloat16
    python benchmarks/real_size.py --size small          # 55M: checks the script in a minute
    python benchmarks/real_size.py --remat none,dots_saveable,nothing_saveable   # zoo alone
    python benchmarks/real_size.py --size 1b --steps 4 --remat projections,none  # 0.64x torch's peak
    python benchmarks/real_size.py --size 1b --steps 4 --policy none  # beside torch, remat off
    python benchmarks/real_size.py --size 1b --load      # zoo's loading alone
    python benchmarks/real_size.py --size small --steps 2 --mfu   # + model FLOPs, TFLOP/s, MFU
    python benchmarks/real_size.py --mfu --peak-tflops 989.4      # MFU against a peak you give

`--remat P,...` runs zoo's side once per `jax.checkpoint` policy of the layer stack
(`--model-config remat=P`; `none`: no rematerialisation; `auto`: the default, which picks
`projections` at 0.4B and 1B) and prints each one's step time and peak memory against the
first. `--policy P` runs the side-by-side comparison with zoo under policy `P`. `--load` times `zoo.hf.from_pretrained`
of the folder as `zoo finetune` calls it (one device, `zoo.rules("dp")`) in a process of
its own and prints its seconds and the process's peak resident memory against the
parameters' bytes.

`--mfu` adds the step's model FLOPs (`_flops.step_flops` from the folder's config.json:
LoRA's frozen weights 4·N·T, its branches 6·n·T, attention 3 × its forward), each side's
achieved TFLOP/s over its median step time, and MFU where the peak of the side's device in
its matmul arithmetic is known (`_flops.PEAKS` by `jax.devices()[0].device_kind`, read in
zoo's worker; torch's side always runs on the CPU) or given (`--peak-tflops`: zoo's
device's dense peak), and XLA's own count of zoo's compiled step (its cost analysis). It
also times the step's weight matmuls (`_flops.weight_matmuls`: each projection's and the
head's forward and activation-gradient shapes) one shape at a time in each side's own
library, in its worker after the run, and prints their seconds against each side's step:
what each library's matmuls alone would take here (a CPU's peak is listed nowhere: this is
its yardstick), and the rest of each step (attention, LoRA's small matmuls, norms, the
loss, the optimizer, memory traffic).

On a shared machine the times are noisy: read them with the load line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _flops import matmul_arithmetic, matmul_operands, multiply, peak_tflops, step_flops, utilisation, weight_matmuls

START = time.perf_counter()

# name -> (transformers config class, its arguments)
SIZES = {
    "small": ("Qwen2Config", dict(hidden_size=512, intermediate_size=2816, num_hidden_layers=8,
                                  num_attention_heads=8, num_key_value_heads=2)),
    "0.4b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2)),
    "1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8)),
}  # fmt: skip
VOCAB = 32_000


def make_model(size: str, folder: Path) -> None:
    """Random weights of `size`'s shape, saved by transformers (once)."""
    if (folder / "config.json").exists():
        return
    import torch
    import transformers

    name, shape = SIZES[size]
    config = getattr(transformers, name)(
        vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=True, **shape
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def zoo_side(args, folder: Path, out: Path) -> dict:
    """`zoo finetune` in this process; its step times, first loss, time to the first step."""
    from zoo._cli import main

    run = out / "zoo-run"
    captured = _capture_compiled() if args.mfu else []
    entered = _entry_times()
    argv = ["finetune", "transformer", "--init", str(folder), "--devices", "1", "--steps", str(args.steps),
            "--batch-size", str(args.batch), "--microbatches", "1", "--seq-len", str(args.seq),
            "--eval-size", str(args.batch), "--eval-every", str(args.steps), "--dtype", args.dtype,
            "--lora", f"r={args.rank},alpha={2 * args.rank},targets=all-linear", "--lr", str(args.lr),
            "--output", str(run), "--overwrite", "--no-compile-cache", "--sample-tokens", "0", "--quiet"]  # fmt: skip
    if args.policy is not None:  # none: remat off (zoo's default is "auto")
        argv += ["--model-config", f"remat={args.policy}"]
    if args.no_eval_before:
        argv += ["--no-eval-before"]
    if main(argv) != 0:
        raise SystemExit("zoo finetune failed")
    peak = peak_mb()
    summary = json.loads((run / "summary.json").read_text())
    seconds = summary["seconds"]
    # From the process's start to the training loop's: what the CLI imports (jax, zoo) and
    # plans before the run's own clock starts is counted too, as torch's imports are.
    first_step = entered["loop"] - START
    parts = {"imports": entered["run"] - START, **{k: seconds[k] for k in ("load", "evaluate_before", "compile")}}
    train = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    ends = [r["elapsed"] for r in train]
    steps = [b - a for a, b in zip([0.0, *ends], ends)]
    _write_batches(run, out / "batches.npz", args.steps)
    return {
        "step_s": steps,
        "first_loss": train[0]["loss"],
        "held_out_loss": None if summary["eval_before"] is None else summary["eval_before"]["loss"],
        "peak_mb": peak,
        "first_step_s": first_step,
        "parts": parts | ({"then": then} if (then := first_step - sum(parts.values())) >= 0.05 else {}),
        **(
            _jax_device(args, captured) | {"matmuls_alone": matmuls_alone(args, folder, _jax_matmul)}
            if args.mfu
            else {}
        ),
    }


def _capture_compiled() -> list:
    """A list that receives the training step `zoo finetune` compiles (`zoo.train.Trainer.compile`
    wrapped): the program that runs, read for XLA's cost analysis without compiling it again."""
    from zoo.train import Trainer

    captured, compile_ = [], Trainer.compile

    def compile(self, *args, **kwargs):
        captured.append(compile_(self, *args, **kwargs))
        return captured[-1]

    Trainer.compile = compile
    return captured


def _entry_times() -> dict[str, float]:
    """Filled as `zoo finetune` runs: `"run"`, when the run's own clock starts (its stages,
    after the CLI's imports and plan), and `"loop"`, when its training loop starts (after
    the first evaluation and the compile); `time.perf_counter` values."""
    import zoo.train._run as run_module
    from zoo.train import Trainer

    entered: dict[str, float] = {}
    stages, loop = run_module._run, Trainer.run

    def run_stages(*args, **kwargs):
        entered["run"] = time.perf_counter()
        return stages(*args, **kwargs)

    def run_loop(self, *args, **kwargs):
        entered.setdefault("loop", time.perf_counter())
        return loop(self, *args, **kwargs)

    run_module._run, Trainer.run = run_stages, run_loop
    return entered


def _jax_device(args, captured: list) -> dict:
    """The zoo side's device for `--mfu`: its kind, the arithmetic of its matmuls, and XLA's
    FLOPs count of the compiled step (None where the backend has no cost analysis)."""
    import jax

    device = jax.devices()[0]
    try:
        xla = float(captured[-1].cost_analysis()["flops"])
    except (IndexError, KeyError, TypeError, NotImplementedError):
        xla = None
    precision = jax.config.jax_default_matmul_precision
    return {
        "device": device.device_kind,
        "arithmetic": matmul_arithmetic(args.dtype, device.platform, precision),
        "xla_flops": xla,
        "xla_counts_trips": _xla_counts_loop_trips(),
    }


def _xla_counts_loop_trips() -> bool | None:
    """Whether XLA's cost analysis on this backend multiplies a loop's body by its trip count
    (on CPU it does not: a `lax.scan` of the layers is counted as one layer); None where
    the compiler unrolled the probe's loop (then the probe cannot tell)."""
    import jax
    import jax.numpy as jnp

    def compiled(n: int):
        scan = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c @ c, None), x, None, length=n)[0])
        return scan.lower(jnp.ones((64, 64))).compile()

    short, long = compiled(8), compiled(16)
    if " while(" not in long.as_text():
        return None
    return long.cost_analysis()["flops"] > 1.5 * short.cost_analysis()["flops"]


def _write_batches(run: Path, path: Path, steps: int) -> None:
    """The token batches of the run's steps 1..`steps`, as the run drew them."""
    import jax
    import numpy as np

    import zoo
    from zoo.train import RunConfig, build_task

    config = RunConfig.from_dict(json.loads((run / "config.json").read_text())).resolved("finetune")
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        task = build_task(config, rules=zoo.rules("dp"), mesh=mesh)
    tokens = [np.asarray(task.batch_at(s, config.batch_size)["tokens"]) for s in range(1, steps + 1)]
    np.savez(path, tokens=np.stack(tokens), held_out=np.asarray(task.eval_data["tokens"]))


def torch_side(args, folder: Path, out: Path) -> dict:
    """transformers + peft on the zoo run's batches: step times, first loss, time to the first step."""
    import numpy as np
    import peft
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    imported = time.perf_counter() - START
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules="all-linear")
    model = peft.get_peft_model(model, config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    saved = np.load(out / "batches.npz")
    batches, held_out = (torch.from_numpy(saved[k].astype(np.int64)) for k in ("tokens", "held_out"))
    loaded = time.perf_counter() - START
    # zoo's run evaluates the held-out windows before its first step (its `loss_fell`
    # needs that loss); so does this side, as transformers' `eval_on_start=True` would:
    # the same work before the first step on both sides, and the same loss.
    held_out_loss = None
    if not args.no_eval_before:
        model.eval()
        with torch.no_grad():
            held_out_loss = float(model(input_ids=held_out, labels=held_out).loss)
        model.train()
    first_step = time.perf_counter() - START
    steps, losses = [], []
    for tokens in batches:
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        steps.append(time.perf_counter() - t)
    peak = peak_mb()
    return {
        "step_s": steps,
        "first_loss": losses[0],
        "held_out_loss": held_out_loss,
        "peak_mb": peak,
        "first_step_s": first_step,
        "parts": {"imports": imported, "load": loaded - imported, "evaluate_before": first_step - loaded},
        # The model stays on the CPU (never moved to an accelerator).
        "device": "cpu",
        "arithmetic": matmul_arithmetic(args.dtype, "cpu", torch.get_float32_matmul_precision()),
        **({"matmuls_alone": matmuls_alone(args, folder, _torch_matmul)} if args.mfu else {}),
    }


# Timed runs of each weight-matmul shape alone (after two warm-up runs): their median counts.
MATMUL_REPEATS = 5


def matmuls_alone(args, folder: Path, matmul) -> float:
    """`--mfu`: the seconds the step's weight matmuls (`_flops.weight_matmuls`) take when each
    shape runs on its own in the side's library (`matmul(a_shape, b_shape, form, dtype)`
    gives a call that runs one and waits for it): each shape's median of `MATMUL_REPEATS`
    runs times its count in a step. The step's time less this is what the side spends
    besides those matmuls (attention's and LoRA's small ones included)."""
    config = json.loads((folder / "config.json").read_text())
    seconds = 0.0
    for m, k, n, form, count in weight_matmuls(config, args.batch, args.seq):
        run = matmul(*matmul_operands(m, k, n, form), form, args.dtype)
        run(), run()
        times = []
        for _ in range(MATMUL_REPEATS):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        seconds += count * statistics.median(times)
    return seconds


def _jax_matmul(a_shape, b_shape, form: str, dtype: str):
    import jax
    import jax.numpy as jnp

    a, b = jnp.full(a_shape, 0.01, dtype), jnp.full(b_shape, 0.01, dtype)
    product = jax.jit(lambda a, b: multiply(a, b, form))
    return lambda: product(a, b).block_until_ready()


def _torch_matmul(a_shape, b_shape, form: str, dtype: str):
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    a, b = torch.full(a_shape, 0.01, dtype=dtype), torch.full(b_shape, 0.01, dtype=dtype)

    def run():
        with torch.no_grad():
            multiply(a, b, form)

    return run


def load_side(args, folder: Path, out: Path) -> dict:
    """`zoo.hf.from_pretrained(folder)` as `zoo finetune` loads it: seconds, peak memory."""
    import jax

    import zoo

    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        model = zoo.hf.from_pretrained(folder, rules=zoo.rules("dp"), mesh=mesh)
    jax.block_until_ready(model)
    seconds = time.perf_counter() - start
    params = sum(x.nbytes for x in jax.tree.leaves(model) if hasattr(x, "nbytes"))
    return {"load_s": seconds, "peak_mb": peak_mb(), "params_mb": params / 2**20}


def warm(folder: Path) -> bool:
    """Read every file of `folder` once (into the OS's page cache) before a side starts, so
    both start from cached weights: zoo reads them before its first step, torch maps them
    and reads them during it, and a file the other side's process pushed out of the cache
    (a 1B model's 4 GB, after a worker of 10 GB) would otherwise be read from disk by
    whichever side comes next (at 1B: `from_pretrained` 8.3 s with two thirds of the file
    not cached, 5.1 s cached)."""
    for path in sorted(folder.iterdir()):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while f.read(1 << 24):
                    pass


def _warm_worker(worker: str, folder: Path) -> dict | None:
    """`_worker(worker)`, the folder's files read just before it (`warm`)."""
    warm(folder)
    return _worker(worker)


def loadavg() -> str:
    """As `_harness.loadavg`, which this script does not import: `_harness` imports jax, and the
    torch worker's resident memory must be torch's alone."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def median_step(side: dict) -> float:
    """A side's step time: the median of its steps after the first (which compiles or
    pages weights in), or of all when it ran one."""
    return statistics.median(side["step_s"][1:] or side["step_s"])


def report(args, zoo: dict, torch: dict, load: str | None = None) -> None:
    tokens = args.batch * args.seq
    rows = {}
    for name, side in (("zoo", zoo), ("torch", torch)):
        step = median_step(side)
        rows[name] = (step, tokens / step, side["peak_mb"], side["first_step_s"], side["first_loss"])
    print(f"\n{args.size}, {args.dtype}, LoRA r={args.rank} on every linear layer, batch {args.batch} x {args.seq}, "
          f"{args.steps} steps (median of steps 2..), loadavg {load or loadavg()}")  # fmt: skip
    print(f"{'':8}{'step s':>9}{'tokens/s':>10}{'peak MB':>10}{'first step s':>14}{'first loss':>13}")
    for name, (step, tps, peak, first, loss) in rows.items():
        print(f"{name:8}{step:9.2f}{tps:10.0f}{peak:10.0f}{first:14.1f}{loss:13.6f}")
    z, t = rows["zoo"], rows["torch"]
    print(f"{'zoo/torch':8}{z[0] / t[0]:9.2f}{'':10}{z[2] / t[2]:10.2f}{z[3] / t[3]:14.2f}"
          f"{'   |diff| ' + format(abs(z[4] - t[4]), '.1e'):>13}")  # fmt: skip
    print("time to the first step, zoo: " + ", ".join(f"{k} {v:.1f} s" for k, v in zoo["parts"].items()))
    print("time to the first step, torch: " + ", ".join(f"{k} {v:.1f} s" for k, v in torch["parts"].items()))
    if zoo["held_out_loss"] is None:
        print("neither side evaluated before its first step (--no-eval-before)")
    else:
        print(f"both evaluate the held-out windows before the first step: loss {zoo['held_out_loss']:.6f} / "
              f"{torch['held_out_loss']:.6f} (|diff| {abs(zoo['held_out_loss'] - torch['held_out_loss']):.1e}); "
              f"the first step less each side's evaluation: {without_evaluation(zoo):.1f} / "
              f"{without_evaluation(torch):.1f} s ({without_evaluation(zoo) / without_evaluation(torch):.2f}x)")  # fmt: skip
    if args.mfu:
        report_mfu(args, {"zoo": (zoo, rows["zoo"][0]), "torch": (torch, rows["torch"][0])})


def without_evaluation(side: dict) -> float:
    """A side's time to the first step less its evaluation before it (as a run without one,
    transformers' default, would start)."""
    return side["first_step_s"] - side["parts"]["evaluate_before"]


def report_mfu(args, sides: dict[str, tuple[dict, float]]) -> None:
    """`--mfu`: the step's model FLOPs (`_flops.step_flops`, from the folder's config.json),
    each side's achieved TFLOP/s over its median step time and MFU where its device's peak
    is known (`_flops.PEAKS`, or `--peak-tflops` for zoo's device), and XLA's own count of
    zoo's compiled step."""
    config = json.loads((args.out / args.size / "model" / "config.json").read_text())
    flops = step_flops(config, args.batch, args.seq, lora_rank=args.rank)
    print(f"\nmodel FLOPs per step: {flops / 1e12:.3f} TFLOP (LoRA r={args.rank}: 4·N·T for the frozen matmul "
          f"weights N, 6·n·T for the LoRA weights n, 3 x attention's forward; T = {args.batch * args.seq} tokens)")  # fmt: skip
    print(f"{'':8}{'device':>26}{'matmuls':>9}{'TFLOP/s':>9}{'peak':>8}{'MFU':>8}")
    zoo_device = sides["zoo"][0]["device"]
    for name, (side, step) in sides.items():
        override = args.peak_tflops if side["device"] == zoo_device else None
        peak = peak_tflops(side["device"], side["arithmetic"], override)
        achieved, mfu = utilisation(flops, step, peak)
        print(f"{name:8}{side['device']:>26}{side['arithmetic']:>9}{achieved:9.3f}"
              f"{'n/a' if peak is None else format(peak, '.1f'):>8}{'n/a' if mfu is None else format(mfu, '.1%'):>8}")  # fmt: skip
        if peak is None and side["device"] == zoo_device:
            print(f"{'':8}no known {side['arithmetic']} peak for {side['device']!r}: MFU needs --peak-tflops X")
        elif peak is None:  # torch on the CPU beside zoo on an accelerator
            print(f"{'':8}no known peak for {side['device']!r} (--peak-tflops is zoo's device's)")
    matmul_flops = sum(2 * m * k * n * count for m, k, n, _, count in weight_matmuls(config, args.batch, args.seq))
    print(f"\nthe step's weight matmuls ({matmul_flops / 1e12:.3f} TFLOP) with each shape run alone in the side's "
          f"library, median of {MATMUL_REPEATS}, times its count in a step (attention's and LoRA's small matmuls "
          "left out: they count in the rest):")  # fmt: skip
    print(f"{'':8}{'step s':>8}{'matmuls alone s':>17}{'TFLOP/s':>9}{'the rest s':>12}{'matmuls/step':>14}")
    for name, (side, step) in sides.items():
        alone = side["matmuls_alone"]
        print(
            f"{name:8}{step:8.2f}{alone:17.2f}{matmul_flops / alone / 1e12:9.3f}{step - alone:12.2f}{alone / step:14.0%}"
        )
    zoo, layers = sides["zoo"][0], config["num_hidden_layers"]
    if zoo["xla_flops"] is None:
        print("XLA's count of zoo's compiled step: none (this backend's cost analysis gives no flops)")
    elif zoo["xla_counts_trips"] is None:
        print(f"XLA's count of zoo's compiled step: {zoo['xla_flops'] / 1e12:.3f} TFLOP, "
              f"{zoo['xla_flops'] / flops:.2f}x the model FLOPs (whether it counts each of the {layers} scanned "
              "layers or their body once is unknown on this backend)")  # fmt: skip
    elif zoo["xla_counts_trips"]:
        print(f"hardware FLOPs of zoo's step (XLA's cost analysis, remat's recompute included): "
              f"{zoo['xla_flops'] / 1e12:.3f} TFLOP, {zoo['xla_flops'] / flops:.2f}x the model FLOPs")  # fmt: skip
    else:
        print(f"XLA's count of zoo's compiled step: {zoo['xla_flops'] / 1e12:.3f} TFLOP, not its hardware FLOPs: "
              f"this backend's cost analysis counts a loop's body once, and the {layers} layers run as one scanned body")  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's settings (`argv`, else `sys.argv[1:]`); exits with a one-line usage
    error for a combination it cannot run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="0.4b")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--out", type=Path, default=Path("build/real_size"))
    parser.add_argument("--remat", help="policies to compare, comma-separated (zoo alone)")
    parser.add_argument("--load", action="store_true", help="time zoo's loading of the folder alone")
    parser.add_argument("--worker", choices=("make", "zoo", "torch", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--mfu", action="store_true", help="print model FLOPs, TFLOP/s and MFU per side")
    parser.add_argument("--peak-tflops", type=float, help="zoo's device's dense peak TFLOP/s (for --mfu's MFU)")
    parser.add_argument("--policy", help="zoo's remat policy beside torch (none: off; default: zoo's own, auto)")
    parser.add_argument("--repeat", type=int, default=1, help="the side by side N times, zoo and torch alternating")
    parser.add_argument("--no-eval-before", action="store_true", help="neither side evaluates before its first step")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give 1 or more runs")
    alone = "--remat" if args.remat else "--load" if args.load else None
    if alone and args.repeat > 1:
        parser.error(f"--repeat repeats the side by side with torch; {alone} runs zoo alone: drop one")
    if alone and args.mfu:
        parser.error(f"--mfu reads the side by side with torch; {alone} runs zoo alone: drop one")
    return args


def main() -> None:
    args = parse()
    out = args.out / args.size
    folder = out / "model"
    if args.worker == "make":
        make_model(args.size, folder)
        return
    if args.worker is not None:
        side = {"zoo": zoo_side, "torch": torch_side, "load": load_side}[args.worker]
        print("RESULT " + json.dumps(side(args, folder, out)), flush=True)
        return
    out.mkdir(parents=True, exist_ok=True)
    if args.remat:
        compare_remat(args, out)
        return
    if args.load:
        _worker("make")
        r = _worker("load")
        print(f"\n{args.size}: zoo.hf.from_pretrained {r['load_s']:.1f} s, peak resident {r['peak_mb']:,.0f} MB "
              f"for {r['params_mb']:,.0f} MB of parameters ({r['peak_mb'] / r['params_mb']:.2f}x), loadavg {loadavg()}")  # fmt: skip
        return
    _worker("make")
    runs = [
        {worker: _warm_worker(worker, folder) for worker in ("zoo", "torch")} | {"loadavg": loadavg()}
        for _ in range(args.repeat)
    ]
    for run in runs:
        report(args, run["zoo"], run["torch"], run["loadavg"])
    if len(runs) > 1:
        report_repeats(runs)
    (out / f"result-{args.dtype}.json").write_text(json.dumps(runs, indent=1))  # one entry a run


def report_repeats(runs: list[dict]) -> None:
    """`--repeat`: each run's zoo/torch ratios and their medians, and the ratio of the two
    sides' median steps over all runs (torch's own step moves between runs: read the
    spread, not one run)."""

    def ratios(of) -> str:
        values = [of(run["zoo"]) / of(run["torch"]) for run in runs]
        return f"{', '.join(f'{v:.2f}' for v in values)} (median {statistics.median(values):.2f})"

    zoo, torch = (statistics.median(median_step(run[side]) for run in runs) for side in ("zoo", "torch"))
    print(f"\n{len(runs)} runs, zoo and torch alternating; zoo/torch per run:")
    print(f"  step        {ratios(median_step)}; median steps {zoo:.2f} / {torch:.2f} s = {zoo / torch:.2f}")
    print(f"  peak        {ratios(lambda side: side['peak_mb'])}")
    print(f"  first step  {ratios(lambda side: side['first_step_s'])}")
    if runs[0]["zoo"]["held_out_loss"] is not None:
        print(f"  less each side's evaluation  {ratios(without_evaluation)}")


def _worker(worker: str, *extra: str) -> dict | None:
    """Run this script's `worker` in a process of its own; its RESULT line."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", worker, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the {worker} worker failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1].removeprefix("RESULT ")) if lines else None


def compare_remat(args, out: Path) -> None:
    """zoo's step time and peak memory per remat policy, each in its own process."""
    _worker("make")
    policies = args.remat.split(",")
    rows = {p: _worker("zoo", "--policy", p) for p in policies}
    print(f"\n{args.size}, {args.dtype}, batch {args.batch} x {args.seq}, remat policies (loadavg {loadavg()})")
    print(f"{'policy':34}{'step s':>9}{'peak MB':>10}{'step ×':>9}{'peak ×':>9}")
    base = rows[policies[0]]
    for p, r in rows.items():
        step, first = median_step(r), median_step(base)
        print(f"{p:34}{step:9.2f}{r['peak_mb']:10.0f}{step / first:9.2f}{r['peak_mb'] / base['peak_mb']:9.2f}")
    (out / f"remat-{args.dtype}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
