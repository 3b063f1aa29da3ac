"""Step time and tokens/s of the zoo decoder LM under `dp` against replicated params, and
the step's peak temporary memory at M=1 against M=4 (and M=8) microbatches.

The model is `zoo.models.Transformer` (a GPT-style decoder, layers scanned) trained with
`zoo.models.next_token_loss` and AdamW 1e-3. Two parts:

**Step time**, each device count (2 and 8 by default) in its own worker process (a process
can simulate only one CPU device count), side by side in one run:

- **zoo dp**: the model placed by `zoo.shard(model, zoo.rules("dp"), mesh)` and stepped by
  `zoo.TrainStep(next_token_loss, optax.adamw(1e-3), microbatches=M)`: reduced cast of the
  parameters, `lax.scan` over microbatches accumulating unreduced gradients, one all-reduce
  after the loop, AdamW;
- **replicated**: a hand-written jitted step on the same plain replicated parameters:
  `lax.scan` over the same microbatches (`zoo.internal.split_microbatches`), plain
  `jax.value_and_grad` in the body, so every microbatch's backward pass all-reduces its
  gradients (and loss sums) inside the loop; then the same AdamW update. The step of
  `benchmarks/step_time.py`'s replicated baseline, for the LM.

A worker compiles both, counts their all-reduces inside/outside loops (`zoo.collectives`,
`zoo.count`; zoo must hold 0 in loops and 1 outside, replicated some in loops), checks that
both give the same first loss and gradients (AdamW's first moment), then times them interleaved round by
round (the order alternating), so load on a shared machine hits both alike. Reported:
median step times, tokens/s (tokens in the global batch per second), and the median of
per-round speed ratios, plus how many CPUs other processes kept busy meanwhile (their load
shrinks the speedup; time it on an otherwise idle machine).

**Memory**, in the 8-device worker (per device; compile only, nothing runs): the zoo step
compiled at one global batch (16 sequences of 64 tokens per device) with M=1, 4 and 8
microbatches, and with `remat="nothing_saveable"` at M=1 and 4;
`compiled.memory_analysis().temp_size_in_bytes` is the peak temporary memory (one
microbatch's activations and workspace), printed beside the argument and output sizes
(parameters, optimizer state, batch). At a fixed global batch, M microbatches should cut
the activation memory about M-fold.

Targets, set from runs on a 2-core machine with other processes busy on ~1.5 of its CPUs
(medians 1.52-1.53x at 2 devices, 1.21-1.59x at 8, single rounds 0.7x to 2.3x; temp memory
M=1 / M=4 4.3x, deterministic): zoo dp >= 1.3x replicated speed at 2 devices and >= 1.2x
at 8; temp memory M=1 / M=4 >= 3x. On CPU the simulated devices share the cores: every
device's backward pass and gradient accumulation run on them too, so the all-reduces the
replicated step adds per microbatch weigh less than on real accelerators.

Run it (about 4 minutes on a 2-core machine with other processes busy on 1.5 of its CPUs,
less when idle; compiling is most of it):

    python benchmarks/lm_step_time.py
    python benchmarks/lm_step_time.py --devices 8 --rounds 6 --no-memory --json lm.json
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import _harness  # benchmarks/_harness.py: this script's folder is on sys.path
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo

# The model: small enough to step in well under a second on 2 CPU cores, with enough
# parameters (~1.7M, 6.9 MB of float32 gradients) that all-reducing them costs time.
VOCAB = 512
D_MODEL = 256
HEADS = 4
LAYERS = 2
LR = 1e-3
# Step time: M microbatches of PER_DEVICE sequences of SEQ tokens on each device. Few
# tokens per microbatch keep the step quick on CPU; the gradient (and its all-reduce in
# the replicated step) is the same size whatever the batch.
SEQ = 16
MICROBATCHES = 8
PER_DEVICE = 1
DEFAULT_ROUNDS = {2: 16, 8: 10}  # even: each variant goes first equally often
# Memory: one global batch of MEM_PER_DEVICE sequences of MEM_SEQ tokens per device.
MEM_SEQ = 64
MEM_PER_DEVICE = 16
# (remat policy, M) pairs compiled for the memory table.
MEM_CASES = ((None, 1), (None, 4), (None, 8), ("nothing_saveable", 1), ("nothing_saveable", 4))
MEM_DEVICES = 8
TARGET_SPEEDUP = {2: 1.3, 8: 1.2}  # zoo dp vs replicated, by device count
TARGET_MEMORY = 3.0  # temp bytes at M=1 / at M=4, no remat
VARIANTS = ("zoo", "replicated")


def config(max_len: int, remat: str | None = None) -> zoo.models.TransformerConfig:
    return zoo.models.TransformerConfig(
        vocab_size=VOCAB, d_model=D_MODEL, num_heads=HEADS, num_layers=LAYERS, max_len=max_len, remat=remat
    )


def tokens_batch(mesh, rows: int, seq: int) -> dict:
    tokens = jr.randint(jr.key(1), (rows, seq), 0, VOCAB, dtype=jnp.int32)
    return {"tokens": jax.device_put(tokens, NamedSharding(mesh, P("data", None)))}


# -- the replicated baseline, written by hand ------------------------------------------------


def make_replicated_step(n: int, m: int, optimizer, static):
    """Plain `value_and_grad` per microbatch on replicated params: all-reduces in the loop."""

    def objective(params, mb):
        loss_sums, counts = zoo.models.next_token_loss(eqx.combine(params, static), mb)
        return jnp.sum(loss_sums), jnp.sum(counts)  # plain sums: all-reduced per microbatch

    @jax.jit
    def replicated_step(params, opt_state, batch):
        mbs = zoo.internal.split_microbatches(batch, m, n, ("data",))  # same rows per device as zoo

        def body(acc, mb):
            (loss, count), grads = jax.value_and_grad(objective, has_aux=True)(params, mb)
            return (acc[0] + loss, acc[1] + count, jax.tree.map(jnp.add, acc[2], grads)), None

        acc = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, count, grads), _ = lax.scan(body, acc, mbs)
        grads = jax.tree.map(lambda g: g / count, grads)  # token-weighted mean, like zoo's
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / count

    return replicated_step


# -- worker: one device count per process ----------------------------------------------------


def all_reduces(compiled, mesh) -> dict:
    """All-reduce counts in/outside loops, and the bytes they reduce per step.

    Per step: an op's bytes times the trip counts of the loops its JAX op name nests it
    in (`while/body` once: the microbatch loop, x M; twice: the layer loop inside it too,
    x M x layers). An estimate from op names; the counts come from `zoo.count`.
    """
    colls = zoo.collectives(compiled, mesh=mesh)
    trips = {0: 1, 1: MICROBATCHES, 2: MICROBATCHES * LAYERS}
    ars = [c for c in colls if c.kind == "all-reduce"]
    return _harness.all_reduces(
        colls,
        bytes_as_compiled=[c.bytes for c in ars],
        bytes_per_step=sum(c.bytes * trips.get(c.op_name.count("while/body") if c.in_loop else 0, 0) for c in ars),
    )


def memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    return {
        "temp": int(ma.temp_size_in_bytes),
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
    }


def memory_part(mesh, n: int) -> list[dict]:
    """Compile the zoo step at one global batch for each remat and M; per-device sizes.

    Lowering runs in turn; the compiles (most of the time, and nothing is timed meanwhile)
    run in parallel threads, one per CPU.
    """
    batch = tokens_batch(mesh, n * MEM_PER_DEVICE, MEM_SEQ)
    models, lowered = {}, []
    for remat, m in MEM_CASES:
        if remat not in models:
            models[remat] = zoo.shard(
                zoo.models.Transformer(config(MEM_SEQ, remat), key=jr.key(0)), zoo.rules("dp"), mesh
            )
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.adamw(LR), microbatches=m)
        lowered.append(step.lower(models[remat], step.init(models[remat]), batch))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        compiled = list(pool.map(lambda low: low.compile(), lowered))
    _harness.log(f"  memory: compiled {len(compiled)} steps in {time.perf_counter() - t0:.1f}s")
    return [{"remat": r, "microbatches": m, **memory(c)} for (r, m), c in zip(MEM_CASES, compiled)]


def worker(n: int, rounds: int, with_memory: bool) -> dict:
    mesh = _harness.data_mesh(n)
    optimizer = optax.adamw(LR)
    with jax.set_mesh(mesh):
        model = zoo.shard(zoo.models.Transformer(config(SEQ), key=jr.key(0)), zoo.rules("dp"), mesh)
        batch = tokens_batch(mesh, n * MICROBATCHES * PER_DEVICE, SEQ)
        zoo_step = zoo.TrainStep(zoo.models.next_token_loss, optimizer, microbatches=MICROBATCHES)
        params, static = zoo_step.partition(model)
        repl_step = make_replicated_step(n, MICROBATCHES, optimizer, static)
        opt_state = zoo_step.init(model)
        state = {"zoo": (model, opt_state), "replicated": (params, opt_state)}

        # Compile once each: the calls below reuse these executables (jax caches them).
        t0 = time.perf_counter()
        compiled = {"zoo": zoo_step.lower(*state["zoo"], batch).compile()}
        t1 = time.perf_counter()
        compiled["replicated"] = repl_step.lower(*state["replicated"], batch).compile()
        t2 = time.perf_counter()
        _harness.log(f"  {n} devices: compiled zoo in {t1 - t0:.1f}s, replicated in {t2 - t1:.1f}s")
        hlo = {name: all_reduces(c, mesh) for name, c in compiled.items()}
        step_memory = {name: memory(c) for name, c in compiled.items()}

        def call(name):
            """One step of `name` from its current state; returns (new opt_state, loss)."""
            if name == "zoo":
                m, o, loss = zoo_step(*state["zoo"], batch)
                state["zoo"] = (m, o)
            else:
                p, o, loss = repl_step(*state["replicated"], batch)
                state["replicated"] = (p, o)
            return jax.block_until_ready((o, loss))

        # From identical params and optimizer state, compare the first losses and
        # gradients: after one step AdamW's first moment is 0.1 x the gradient. (Not the
        # updates: Adam's first update is about lr * sign(gradient), so gradients near 0
        # flip it on float noise.)
        first = {name: call(name) for name in VARIANTS}
        mu = {name: [np.asarray(x) for x in jax.tree.leaves(first[name][0][0].mu)] for name in VARIANTS}
        scale = max(np.abs(g).max() for g in mu["zoo"])
        match = bool(
            all(np.allclose(r, z, rtol=1e-3, atol=1e-5 * scale) for r, z in zip(mu["replicated"], mu["zoo"]))
            and np.allclose(first["replicated"][1], first["zoo"][1], rtol=1e-5)
        )
        timing = _harness.time_rounds(call, VARIANTS, rounds)  # the order alternating
        _harness.log(f"  {n} devices: timed {rounds} rounds")

        mem = memory_part(mesh, n) if with_memory else None

    med = timing.medians()
    tokens = n * MICROBATCHES * PER_DEVICE * SEQ
    return {
        "devices": n,
        "global_batch": n * MICROBATCHES * PER_DEVICE,
        "tokens_per_step": tokens,
        "rounds": rounds,
        "other_processes_cpus": timing.other_cpus,
        "median_ms": med,
        "tokens_per_s": {name: tokens / (ms / 1e3) for name, ms in med.items()},
        "times_ms": timing.times,
        "zoo_vs_replicated": timing.ratio("replicated", "zoo"),
        "all_reduces": hlo,
        "step_memory": step_memory,
        "matches_zoo": match,
        "hlo_ok": hlo["zoo"]["in_loop"] == 0 and hlo["zoo"]["outside"] == 1 and hlo["replicated"]["in_loop"] > 0,
        "memory": mem,
    }


# -- driver: launch the workers, print the report --------------------------------------------


def memory_ratio(mem: list[dict], remat, m: int) -> float:
    temp = {(r["remat"], r["microbatches"]): r["temp"] for r in mem}
    return temp[(remat, 1)] / temp[(remat, m)]


def verdicts(results: list[dict]) -> list[dict]:
    out = [
        _harness.verdict(
            f"zoo dp >= {TARGET_SPEEDUP[r['devices']]}x replicated speed ({r['devices']} devices)",
            r["zoo_vs_replicated"],
            r["zoo_vs_replicated"] >= TARGET_SPEEDUP[r["devices"]],
        )
        for r in results
        if r["devices"] in TARGET_SPEEDUP
    ]
    out += [
        _harness.verdict(
            f"temp memory M=1 / M=4 >= {TARGET_MEMORY}x (no remat, {r['devices']} devices)",
            memory_ratio(r["memory"], None, 4),
            memory_ratio(r["memory"], None, 4) >= TARGET_MEMORY,
        )
        for r in results
        if r["memory"] and (None, 4) in MEM_CASES
    ]
    out += [_harness.verdict(f"collectives as expected ({r['devices']} devices)", None, r["hlo_ok"]) for r in results]
    out += [
        _harness.verdict(f"first loss and gradients match ({r['devices']} devices)", None, r["matches_zoo"])
        for r in results
    ]
    return out


def mib(b: int) -> str:
    return f"{b / 2**20:.2f}"


def report(results: list[dict], command: str) -> str:
    def note(r):
        h = r["all_reduces"]
        return (
            f"All-reduces {'as expected' if r['hlo_ok'] else 'UNEXPECTED'}; their bytes as compiled: zoo dp "
            f"{h['zoo']['bytes_as_compiled']}, replicated {h['replicated']['bytes_as_compiled']}; "
            f"all-reduced per step (loop trip counts from op names): zoo dp {mib(h['zoo']['bytes_per_step'])} MiB, "
            f"replicated {mib(h['replicated']['bytes_per_step'])} MiB; "
            f"other collectives: {_harness.other_collectives(h, VARIANTS)}. "
            f"First loss and gradients match: {r['matches_zoo']}."
        )

    title = (
        f"LM step time: zoo.models.Transformer d_model={D_MODEL}, {HEADS} heads, {LAYERS} layers, "
        f"vocab {VOCAB}, AdamW; M={MICROBATCHES} microbatches of {PER_DEVICE}x{SEQ} tokens per device. "
        f"Times: medians over rounds; ratio: median of per-round ratios. Rerun: `{command}`"
    )
    header = ["devices", "tokens/step", "zoo dp ms", "replicated ms", "zoo dp tokens/s", "replicated tokens/s"]
    header += ["zoo dp vs replicated", "all-reduces in loop/outside: zoo dp", "replicated"]
    rows = [
        [str(r["devices"]), str(r["tokens_per_step"]), *(f"{r['median_ms'][v]:.1f}" for v in VARIANTS)]
        + [*(f"{r['tokens_per_s'][v]:.0f}" for v in VARIANTS), f"{r['zoo_vs_replicated']:.2f}x"]
        + [_harness.in_loop_outside(r["all_reduces"][v]) for v in VARIANTS]
        for r in results
    ]
    lines = _harness.report_lines(title, header, rows, results, note)
    for r in results:
        if not r["memory"]:
            continue
        n = r["devices"]
        lines += [
            "",
            (
                f"Peak temporary memory per device (compiled.memory_analysis()), zoo dp step, {n} devices, "
                f"global batch {n * MEM_PER_DEVICE} x {MEM_SEQ} tokens ({MEM_PER_DEVICE} sequences per "
                f"device), same model with max_len {MEM_SEQ}:"
            ),
            "",
        ]
        header = ["remat", "M", "temp MiB", "M=1 temp / this", "argument MiB", "output MiB"]
        rows = [
            [row["remat"] or "off", str(row["microbatches"]), mib(row["temp"])]
            + [f"{memory_ratio(r['memory'], row['remat'], row['microbatches']):.2f}x"]
            + [mib(row["argument"]), mib(row["output"])]
            for row in r["memory"]
        ]
        lines += _harness.table(header, rows, left=1)
    lines.append("")
    lines += [
        f"- timed steps at {r['devices']} devices: temp MiB zoo dp {mib(r['step_memory']['zoo']['temp'])}, "
        f"replicated {mib(r['step_memory']['replicated']['temp'])}."
        for r in results
    ]
    lines += _harness.verdict_lines(verdicts(results))
    return "\n".join(lines)


def main() -> None:
    def add_arguments(parser):
        parser.add_argument(
            "--memory-devices",
            type=int,
            default=MEM_DEVICES,
            help=f"which device count's worker also compiles the memory table (default {MEM_DEVICES})",
        )
        parser.add_argument("--no-memory", action="store_true", help="skip the memory table")

    args = _harness.parse_args(__doc__, DEFAULT_ROUNDS, add_arguments)
    if args.worker is not None:
        _harness.print_worker_result(worker(args.worker, args.rounds_for(args.worker), not args.no_memory))
        return

    start = time.perf_counter()
    memory_devices = args.memory_devices if args.memory_devices in args.devices else args.devices[-1]
    results = []
    for n in args.devices:
        with_memory = not args.no_memory and n == memory_devices
        flags, note = ([], ", memory") if with_memory else (["--no-memory"], "")
        results.append(_harness.run_worker(__file__, n, args.rounds_for(n), flags, note))
    command = _harness.command_line()
    print(report(results, command))
    wall = time.perf_counter() - start
    print(f"- wall time {wall:.0f}s")
    summary = {"command": command, "wall_s": wall, "results": results, "verdicts": verdicts(results)}
    _harness.write_summary(summary, args.json)


if __name__ == "__main__":
    main()
