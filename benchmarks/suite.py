"""The benchmark suite: one markdown table (and JSON) for docs/performance.md.

Three parts, each run in its own worker process (a process can simulate only one CPU
device count; see `_harness.py`):

1. **Collectives**: the tiny `zoo inspect` models (mlp, decoder = `transformer`, encoder,
   decoder+LoRA with the CLI's `--lora` defaults) × presets dp / fsdp / fsdp-once / tp
   (mesh data=N/2, model=2) / zero1, on N simulated devices (`--devices`, default 8), AdamW,
   4 microbatches. Each step is compiled only (with the CLI inspect's compiler options,
   which skip LLVM's costly passes; the collectives come out the same) and read with
   `zoo.collectives`: all-reduce / all-gather / other collectives inside and outside loops,
   the bytes of the all-reduces over `data` outside loops (the gradient reduction) against
   the trainable bytes (global and per device), and the lower + compile time.
2. **Step time**, at 2 and 8 devices, side by side in one run (interleaved rounds,
   `_harness.time_rounds`), on `step_time.py`'s seed toy (8 tanh layers 512×512, M=16, SGD):
   zoo, the hand-written seed step and the replicated step (both from `step_time.py`), and
   an `optax.MultiSteps` loop: one jitted call per microbatch on replicated weights (its
   gradient all-reduced each call), MultiSteps applying SGD every M calls.
3. **Peak temporary memory** (`memory_analysis().temp_size_in_bytes`, per device) of the
   zoo dp step of the tiny decoder at one global batch for M = 1, 2, 4, 8 (fully compiled).

Run it:

    make bench                                   # includes: python benchmarks/suite.py
    python benchmarks/suite.py --quick --out build/bench   # fewer rounds (~4 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import _harness  # benchmarks/_harness.py: this script's folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fixed models (fixed_tasks.py)

MODELS = ("mlp", "decoder", "encoder", "decoder+lora")
PRESETS = ("dp", "fsdp", "fsdp-once", "tp", "zero1")
COLL_MICROBATCHES = 4
MEM_MICROBATCHES = (1, 2, 4, 8)
MEM_PER_DEVICE = 16  # sequences per device in the memory table's global batch
MEM_SEQ = 64
STEP_VARIANTS = ("zoo", "hand", "replicated", "multisteps")
STEP_LABELS = {"zoo": "zoo", "hand": "hand-written", "replicated": "replicated", "multisteps": "optax.MultiSteps"}
ROUNDS = {2: 16, 8: 12}  # multiples of 4: each variant goes first equally often
QUICK_ROUNDS = {2: 4, 8: 4}


# -- worker part 1: collectives (and part 3: memory) -------------------------------------------


def _inspect_task(model: str):
    """(InspectTask, trainable filter or None) of the CLI's tiny model `model`."""
    from fixed_tasks import build_inspect_task, inspect_defaults

    import zoo
    from zoo.train._adapters import add_lora
    from zoo.train._text import parse_lora

    if model == "decoder+lora":
        task = build_inspect_task("transformer", 0)
        config = parse_lora("", inspect_defaults("transformer"))
        task.model = add_lora(task.model, config, 0)
        return task, lambda m: zoo.lora.trainable(m, config)
    return build_inspect_task({"decoder": "transformer"}.get(model, model), 0), None


def _per_device_bytes(tree) -> int:
    import equinox as eqx
    import jax

    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def collective_row(model: str, preset: str, n: int) -> dict:
    import jax
    import optax

    import zoo
    from zoo._jit import ONCE_COMPILER_OPTIONS
    from zoo.train._output import tree_bytes

    shape = {"data": n // 2, "model": 2} if preset == "tp" else {"data": n}
    mesh = jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))
    task, trainable = _inspect_task(model)
    row = {"model": model, "preset": preset, "mesh": shape}
    with jax.set_mesh(mesh):
        placed = zoo.shard(task.model, zoo.rules(preset), mesh)
        options = {}
        if trainable is not None:
            options["trainable"] = trainable(placed)
        step = zoo.TrainStep(task.loss_fn, optax.adamw(1e-3), microbatches=COLL_MICROBATCHES, preset=preset, **options)
        batch = task.make_batch(shape["data"] * COLL_MICROBATCHES * 2, jax.random.key(0))
        t0 = time.perf_counter()
        compiled = step.lower(placed, step.init(placed), batch).compile(compiler_options=ONCE_COMPILER_OPTIONS)
        row["compile_s"] = time.perf_counter() - t0
        colls = zoo.collectives(compiled, mesh=mesh)
        params = step.partition(placed)[0]
    for kind, key in (("all-reduce", "all_reduce"), ("all-gather", "all_gather")):
        row[key] = [zoo.count(colls, kind, in_loop=True), zoo.count(colls, kind, in_loop=False)]
    others = [c for c in colls if c.kind not in ("all-reduce", "all-gather")]
    row["other"] = [sum(c.in_loop for c in others), sum(not c.in_loop for c in others)]
    row["other_kinds"] = sorted({c.kind for c in others})
    row["grad_reduce_bytes"] = sum(
        c.bytes for c in colls if c.kind == "all-reduce" and not c.in_loop and "data" in c.mesh_axes
    )
    row["trainable_bytes"] = tree_bytes(params)
    row["trainable_bytes_per_device"] = _per_device_bytes(params)
    return row


def memory_rows(n: int) -> list[dict]:
    """Temp bytes per device of the tiny decoder's zoo dp step at one global batch, by M."""
    import jax
    import jax.random as jr
    import lm_step_time
    import optax
    from fixed_tasks import TINY_TRANSFORMER
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zoo

    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    config = zoo.models.TransformerConfig(**(TINY_TRANSFORMER | {"max_len": MEM_SEQ}))
    tokens = jr.randint(jr.key(1), (n * MEM_PER_DEVICE, MEM_SEQ), 0, config.vocab_size)
    rows = []
    with jax.set_mesh(mesh):
        model = zoo.shard(zoo.models.Transformer(config, key=jr.key(0)), zoo.rules("dp"), mesh)
        batch = {"tokens": jax.device_put(tokens, NamedSharding(mesh, P("data", None)))}
        for m in MEM_MICROBATCHES:
            step = zoo.TrainStep(zoo.models.next_token_loss, optax.adamw(1e-3), microbatches=m)
            t0 = time.perf_counter()
            compiled = step.compile(model, step.init(model), batch)
            rows.append({"microbatches": m, "compile_s": time.perf_counter() - t0, **lm_step_time.memory(compiled)})
    return rows


def collectives_worker(n: int) -> dict:
    _harness.data_mesh(n)  # sets the simulated device count
    rows = []
    for model in MODELS:
        for preset in PRESETS:
            try:
                rows.append(collective_row(model, preset, n))
            except Exception as e:  # one failing case should not sink the table
                rows.append({"model": model, "preset": preset, "error": f"{type(e).__name__}: {e}"[:300]})
            _harness.log(f"  {model} {preset}: {rows[-1].get('compile_s', float('nan')):.1f}s")
    return {"devices": n, "collectives": rows, "memory": memory_rows(n)}


# -- worker part 2: step time -------------------------------------------------------------------


def make_multisteps(n: int, m: int, lr: float):
    """`optax.MultiSteps(sgd)`: one jitted call per microbatch, its all-reduce each call."""
    import jax
    import jax.numpy as jnp
    import optax
    import step_time

    opt = optax.MultiSteps(optax.sgd(lr), every_k_schedule=m)

    @jax.jit
    def micro(ws, opt_state, xs):
        def loss(w):  # per-microbatch mean; MultiSteps averages the M gradients
            return jnp.sum(step_time.predict(w, xs) ** 2) / xs.shape[0]

        value, grads = jax.value_and_grad(loss)(ws)
        updates, opt_state = opt.update(grads, opt_state, ws)
        return optax.apply_updates(ws, updates), opt_state, value

    # A tuple built under jit: each microbatch keeps its rows on their devices (iterating the
    # [M, b, d] array outside jit would hand back single-device copies).
    split = jax.jit(lambda x: tuple(step_time.split_microbatches(x, n, m)))
    return opt, micro, split


def steps_worker(n: int, rounds: int) -> dict:
    mesh = _harness.data_mesh(n)
    import jax
    import step_time

    import zoo

    m = step_time.MICROBATCHES
    with jax.set_mesh(mesh):
        # zoo, hand-written and replicated as step_time.py runs them, plus MultiSteps.
        batch, w0, calls, hlo = step_time.seed_variants(n)
        ms_opt, ms_micro, ms_split = make_multisteps(n, m, step_time.LR)
        mbs = ms_split(batch)  # split once, outside the timed steps
        ms_state = [w0, ms_opt.init(w0)]

        def multisteps():
            ws, opt_state = ms_state
            losses = []
            for mb in mbs:
                ws, opt_state, loss = ms_micro(ws, opt_state, mb)
                losses.append(loss)
            ms_state[:] = [ws, opt_state]
            return jax.block_until_ready((ws, sum(losses) / m))

        hlo["multisteps"] = _harness.all_reduces(zoo.collectives(ms_micro.lower(*ms_state, mbs[0]).compile()), calls=m)
        calls["multisteps"] = multisteps
        match, timing = step_time.compare_and_time(calls, w0, rounds)
    return {
        "devices": n,
        "rounds": rounds,
        "other_processes_cpus": timing.other_cpus,
        "median_ms": timing.medians(),
        "times_ms": timing.times,
        "zoo_vs": {v: timing.ratio(v, "zoo") for v in STEP_VARIANTS[1:]},
        "all_reduces": hlo,
        "matches_zoo": match,
    }


# -- driver --------------------------------------------------------------------------------------


def machine() -> dict:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__, "python": platform.python_version()}


def pair(v: list[int]) -> str:
    return f"{v[0]}/{v[1]}"


def kib(b: int) -> str:
    return f"{b / 1024:.1f}"


def collective_table(res: dict) -> list[str]:
    header = ["model", "preset", "mesh", "all-reduce in/out", "all-gather in/out", "other in/out"]
    header += ["grad-reduce KiB (out, data)", "trainable KiB", "trainable KiB/device", "reduce / trainable per device"]
    header += ["compile s"]
    rows = []
    for r in res["collectives"]:
        if "error" in r:
            why = r["error"].split(". ")[0]  # the first sentence of zoo's message
            rows.append([r["model"], r["preset"], "", f"not placed: {why}", *[""] * 7])
            continue
        other = pair(r["other"]) + (f" ({', '.join(r['other_kinds'])})" if r["other_kinds"] else "")
        rows.append(
            [
                r["model"],
                r["preset"],
                ",".join(f"{k}={v}" for k, v in r["mesh"].items()),
                pair(r["all_reduce"]),
                pair(r["all_gather"]),
                other,
                kib(r["grad_reduce_bytes"]),
                kib(r["trainable_bytes"]),
                kib(r["trainable_bytes_per_device"]),
                f"{r['grad_reduce_bytes'] / r['trainable_bytes_per_device']:.2f}",
                f"{r['compile_s']:.1f}",
            ]
        )
    return _harness.table(header, rows, left=3)


def step_table(results: list[dict]) -> list[str]:
    header = ["devices", "rounds", *(f"{STEP_LABELS[v]} ms" for v in STEP_VARIANTS)]
    header += [f"zoo vs {STEP_LABELS[v]}" for v in STEP_VARIANTS[1:]]
    header += ["all-reduces in/out per step: zoo", "hand-written", "replicated", "MultiSteps (per call × M)"]
    header += ["other CPUs busy"]
    rows = []
    for r in results:
        h = r["all_reduces"]
        ms = h["multisteps"]
        other = "?" if r["other_processes_cpus"] is None else f"{r['other_processes_cpus']:.2f}"
        rows.append(
            [str(r["devices"]), str(r["rounds"]), *(f"{r['median_ms'][v]:.1f}" for v in STEP_VARIANTS)]
            + [f"{r['zoo_vs'][v]:.3f}x" for v in STEP_VARIANTS[1:]]
            + [_harness.in_loop_outside(h[v]) for v in ("zoo", "hand", "replicated")]
            + [f"{_harness.in_loop_outside(ms)} × {ms['calls']}", other]
        )
    return _harness.table(header, rows)


def memory_table(res: dict) -> list[str]:
    rows_in = res["memory"]
    base = next(r["temp"] for r in rows_in if r["microbatches"] == 1)
    header = ["M", "temp MiB", "M=1 temp / this", "argument MiB", "output MiB", "compile s"]
    rows = [
        [str(r["microbatches"]), f"{r['temp'] / 2**20:.2f}", f"{base / r['temp']:.2f}x"]
        + [f"{r['argument'] / 2**20:.2f}", f"{r['output'] / 2**20:.2f}", f"{r['compile_s']:.1f}"]
        for r in rows_in
    ]
    return _harness.table(header, rows)


def report(summary: dict) -> str:
    mach, coll, steps = summary["machine"], summary["collectives"], summary["steps"]
    n = coll["devices"]
    import step_time

    lines = [
        "# eqx-zoo benchmark suite",
        "",
        f"Rerun: `{summary['command']}` (wall time {summary['wall_s']:.0f}s{', --quick' if summary['quick'] else ''}).",
        f"Machine: {mach['cpu']}, {mach['cores']} cores; load average {summary['load_start']} at start, "
        f"{summary['load_end']} at end; jax {mach['jax']}, Python {mach['python']}; devices simulated on CPU.",
        "",
        f"## Collectives per step ({n} simulated devices, {COLL_MICROBATCHES} microbatches, AdamW)",
        "",
        "Counts are `inside loops/outside`; grad-reduce: bytes of the all-reduces over `data` outside loops; "
        "compile: lower + compile with the inspect options (no LLVM optimisation).",
        "",
        *collective_table(coll),
        "",
        f"## Step time (seed toy: {step_time.LAYERS} tanh layers {step_time.WIDTH}x{step_time.WIDTH}, "
        f"M={step_time.MICROBATCHES}, {step_time.PER_DEVICE} examples/device/microbatch, SGD)",
        "",
        "Times: medians over rounds; `zoo vs X`: median of per-round ratios time(X)/time(zoo) "
        "(above 1: zoo faster), all variants interleaved in each round.",
        "",
        *step_table(steps),
        "",
        *(
            f"- {r['devices']} devices: first update and loss match zoo (rtol 1e-4): "
            + ", ".join(f"{STEP_LABELS[v]} {ok}" for v, ok in r["matches_zoo"].items())
            for r in steps
        ),
        *_harness.verdict_lines(summary["verdicts"], miss="MISS"),
        "",
        f"## Peak temporary memory vs microbatches (tiny decoder, zoo dp, {n} devices, global batch "
        f"{n * MEM_PER_DEVICE} x {MEM_SEQ} tokens, per device)",
        "",
        *memory_table(coll),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated devices of the collective table (default 8)")
    parser.add_argument("--step-devices", type=int, nargs="+", default=[2, 8], help="device counts timed (default 2 8)")
    parser.add_argument("--rounds", type=int, help=f"timed rounds (default {ROUNDS}, --quick {QUICK_ROUNDS})")
    parser.add_argument("--quick", action="store_true", help="fewer timed rounds")
    parser.add_argument("--out", default="build/bench", help="folder for suite.json and suite.md (default build/bench)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=("collectives", "steps"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        if args.part == "collectives":
            result = collectives_worker(args.worker)
        else:
            result = steps_worker(args.worker, args.rounds)
        _harness.print_worker_result(result)
        return

    start, load_start = time.perf_counter(), " ".join(f"{x:.2f}" for x in os.getloadavg())
    command = _harness.command_line()
    rounds = args.rounds or None
    default = QUICK_ROUNDS if args.quick else ROUNDS
    coll = _harness.run_worker(__file__, args.devices, 0, ["--part", "collectives"], ", collectives + memory")
    steps = [
        _harness.run_worker(__file__, n, rounds or default.get(n, 8), ["--part", "steps"], ", step time")
        for n in args.step_devices
    ]
    verdicts = [
        _harness.verdict(
            f"zoo >= 0.95x hand-written speed ({r['devices']} devices)",
            r["zoo_vs"]["hand"],
            r["zoo_vs"]["hand"] >= 0.95,
        )
        for r in steps
    ]
    summary = {
        "command": command,
        "quick": args.quick,
        "machine": machine(),
        "load_start": load_start,
        "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "wall_s": time.perf_counter() - start,
        "collectives": coll,
        "steps": steps,
        "verdicts": verdicts,
    }
    text = report(summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.md").write_text(text)
    (out / "suite.json").write_text(json.dumps(summary, indent=2))
    print(text)
    _harness.log(f"wrote {out / 'suite.md'} and {out / 'suite.json'}")


if __name__ == "__main__":
    sys.exit(main())
