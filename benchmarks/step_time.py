"""Step time of `zoo.TrainStep` against the hand-written step and the replicated baseline.

On the seed's toy (8 tanh layers of 512×512 stacked with `zoo.nn.Stacked`, 16 microbatches,
2 examples per device per microbatch, loss = per-example sum of squares, SGD 0.01) this
times, side by side in one run:

- **zoo**: `zoo.TrainStep(loss_fn, optax.sgd(0.01), microbatches=16)`;
- **hand-written**: the step of the JAX page "Autodiff and sharding" (example "microbatch
  gradient accumulation"): reduced cast of the stacked weights, `lax.scan` over
  microbatches with an unreduced gradient and loss accumulator, one reshard (the one
  all-reduce), SGD update;
- **replicated**: the same step with plain replicated weights, so each microbatch's
  backward pass all-reduces its gradients inside the loop.

Each device count runs in its own worker process (a process can simulate only one CPU
device count), 2 and 8 by default. A worker compiles, checks the compiled programs'
all-reduces (`zoo.collectives`: zoo and hand-written must hold 0 inside loops and 1
outside; replicated must hold some inside), checks that the three give the same first
weight update and loss, then times the three steps interleaved round by round, so load on
a shared machine hits all three alike. The report is a markdown table of median step
times and of per-round speed ratios (medians), the target verdicts (zoo ≥ 0.95×
hand-written speed; zoo ≥ 2.5× faster than replicated at 8 devices) and a JSON summary.
Other processes' CPU use shrinks both steps' speedup over replicated (the report prints
how many CPUs they kept busy): time it on an otherwise idle machine.

Run it (a few minutes on a 2-core machine):

    make bench                      # = .venv/bin/python benchmarks/step_time.py
    .venv/bin/python benchmarks/step_time.py --devices 8 --rounds 5 --json bench.json
"""

from __future__ import annotations

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
from jaxtyping import Array, Float, PRNGKeyArray

import zoo

LAYERS = 8
WIDTH = 512
MICROBATCHES = 16
PER_DEVICE = 2  # examples per device per microbatch
LR = 0.01
DEFAULT_ROUNDS = {2: 48, 8: 30}  # multiples of 3: each variant goes first equally often
TARGET_VS_HAND = 0.95
TARGET_VS_REPLICATED = 2.5  # at 8 devices
VARIANTS = ("zoo", "hand", "replicated")
LABELS = {"zoo": "zoo", "hand": "hand-written", "replicated": "replicated"}


class TanhLayer(eqx.Module):
    """One toy layer, `tanh(x @ W)`, no bias (as in the reference page)."""

    weight: Float[Array, "d d"] = zoo.field(axes=("embed", "mlp"))

    def __init__(self, key: PRNGKeyArray):
        self.weight = jr.normal(key, (WIDTH, WIDTH)) / np.sqrt(WIDTH)

    def __call__(self, x: Float[Array, "b d"]) -> Float[Array, "b d"]:
        return jnp.tanh(x @ self.weight)


def zoo_loss(model: zoo.nn.Stacked, x: Float[Array, "b d"]) -> Float[Array, " b"]:
    return jnp.sum(model(x) ** 2, axis=1)


# -- the reference page's step, written by hand on the stacked weight array [L, d, d] ------


def predict(ws, xs):
    def apply_layer(h, w):
        return jnp.tanh(h @ w), None

    out, _ = lax.scan(apply_layer, xs, ws)
    return out


def split_microbatches(x, n, m):
    """[B@data, d] → [M, B/M @data, d] from each device's own rows (no all-to-all)."""
    b = x.shape[0] // (n * m)
    x = x.reshape(n, m, b, x.shape[1], out_sharding=P("data", None, None, None))
    return x.swapaxes(0, 1).reshape(m, n * b, x.shape[-1], out_sharding=P(None, "data", None))


def make_hand_step(n):
    def loss(ws, xs):
        per_example = jnp.sum(predict(ws, xs) ** 2, axis=1)
        # Sum over this device's rows only: a plain jnp.sum would all-reduce per microbatch.
        return lax.reduce_sum(per_example, (0,), out_sharding=P(unreduced={"data"}))

    @jax.jit
    def step(ws, x):  # ws plain at rest, like zoo's params
        mbs = split_microbatches(x, n, MICROBATCHES)
        ws_reduced = jax.reshard(ws, P(reduced={"data"}))  # free

        def microbatch_step(acc, xs_mb):
            loss_mb, grads = jax.value_and_grad(loss)(ws_reduced, xs_mb)
            return (acc[0] + loss_mb, acc[1] + grads), None

        acc = (
            jax.reshard(jnp.zeros((), jnp.float32), P(unreduced={"data"})),
            jax.reshard(jnp.zeros_like(ws), P(unreduced={"data"})),
        )
        (loss_sum, grads), _ = lax.scan(microbatch_step, acc, mbs)
        loss_sum, grads = jax.reshard((loss_sum, grads), (P(), P()))  # the one all-reduce
        size = x.shape[0]  # zoo's step takes means over the global batch; so does this one
        return ws - LR * (grads / size), loss_sum / size

    return step


def make_replicated_step(n):
    def loss(ws, xs):
        return jnp.sum(jnp.sum(predict(ws, xs) ** 2, axis=1))

    @jax.jit
    def step(ws, x):
        mbs = split_microbatches(x, n, MICROBATCHES)

        def microbatch_step(acc, xs_mb):
            loss_mb, grads = jax.value_and_grad(loss)(ws, xs_mb)  # all-reduces here, in the loop
            return (acc[0] + loss_mb, acc[1] + grads), None

        acc = (jnp.zeros((), jnp.float32), jnp.zeros_like(ws))
        (loss_sum, grads), _ = lax.scan(microbatch_step, acc, mbs)
        size = x.shape[0]
        return ws - LR * (grads / size), loss_sum / size

    return step


# -- worker: one device count per process --------------------------------------------------


def seed_variants(n: int) -> tuple[jax.Array, jax.Array, dict, dict]:
    """Under `jax.set_mesh` of `n` devices: the seed toy's global batch, its initial stacked
    weights, and the zoo, hand-written and replicated steps on it, as
    `(batch, initial weights, calls, all_reduces)`: `calls[name]()`
    runs one step of that variant from its own state and returns `(new weights, loss)`;
    `all_reduces[name]` counts its compiled step's all-reduces in and out of loops."""
    model_key, data_key = jr.split(jr.key(0))
    mesh = jax.sharding.get_mesh()
    model = zoo.shard(zoo.nn.Stacked(TanhLayer, LAYERS, key=model_key), zoo.rules("dp"), mesh)
    batch = jax.device_put(
        jr.normal(data_key, (n * MICROBATCHES * PER_DEVICE, WIDTH)), NamedSharding(mesh, P("data", None))
    )
    zoo_step = zoo.TrainStep(zoo_loss, optax.sgd(LR), microbatches=MICROBATCHES)
    hand_step, repl_step = make_hand_step(n), make_replicated_step(n)
    w = model.layers.weight
    state = {"zoo": (model, zoo_step.init(model)), "hand": w, "replicated": w}

    def zoo_call():
        m, opt_state, loss = zoo_step(*state["zoo"], batch)
        state["zoo"] = (m, opt_state)
        return jax.block_until_ready((m.layers.weight, loss))

    def plain_call(name, fn):
        def call():
            ws, loss = jax.block_until_ready(fn(state[name], batch))
            state[name] = ws
            return ws, loss

        return call

    calls = {"zoo": zoo_call, "hand": plain_call("hand", hand_step), "replicated": plain_call("replicated", repl_step)}
    all_reduces = {
        "zoo": _harness.all_reduces(zoo.collectives(zoo_step.lower(*state["zoo"], batch))),
        "hand": _harness.all_reduces(zoo.collectives(hand_step, w, batch)),
        "replicated": _harness.all_reduces(zoo.collectives(repl_step, w, batch)),
    }
    return batch, w, calls, all_reduces


def compare_and_time(calls: dict, w0: jax.Array, rounds: int) -> tuple[dict, _harness.Timing]:
    """The first call of every variant (it compiles), all from the weights `w0`, compared
    with zoo's; then `rounds` interleaved timed rounds. Returns `(whether each other variant
    matches zoo, timing)`.

    The updates (new - old weights) are compared: the weights alone would agree to 1e-4
    whatever the gradients, the update being ~1e-3 of them."""
    w0 = np.asarray(w0)
    first = {name: call() for name, call in calls.items()}
    zoo_update = np.asarray(first["zoo"][0]) - w0
    atol = 1e-4 * np.abs(zoo_update).max()
    match = {
        name: bool(
            np.allclose(np.asarray(first[name][0]) - w0, zoo_update, rtol=1e-4, atol=atol)
            and np.allclose(first[name][1], first["zoo"][1], rtol=1e-4)
        )
        for name in calls
        if name != "zoo"
    }
    return match, _harness.time_rounds(lambda name: calls[name](), tuple(calls), rounds)


def worker(n: int, rounds: int) -> dict:
    mesh = _harness.data_mesh(n)
    with jax.set_mesh(mesh):
        _, w0, calls, hlo = seed_variants(n)
        match, timing = compare_and_time(calls, w0, rounds)

    return {
        "devices": n,
        "global_batch": n * MICROBATCHES * PER_DEVICE,
        "rounds": rounds,
        "other_processes_cpus": timing.other_cpus,
        "median_ms": timing.medians(),
        "times_ms": timing.times,
        "zoo_vs_hand": timing.ratio("hand", "zoo"),
        "zoo_vs_replicated": timing.ratio("replicated", "zoo"),
        "hand_vs_replicated": timing.ratio("replicated", "hand"),
        "all_reduces": hlo,
        "matches_zoo": match,
        "hlo_ok": all(hlo[v]["in_loop"] == 0 and hlo[v]["outside"] == 1 for v in ("zoo", "hand"))
        and hlo["replicated"]["in_loop"] > 0,
    }


# -- driver: launch the workers, print the report ------------------------------------------


def verdicts(results: list[dict]) -> list[dict]:
    out = [
        _harness.verdict(
            f"zoo >= {TARGET_VS_HAND}x hand-written speed ({r['devices']} devices)",
            r["zoo_vs_hand"],
            r["zoo_vs_hand"] >= TARGET_VS_HAND,
        )
        for r in results
    ]
    out += [
        _harness.verdict(
            f"zoo >= {TARGET_VS_REPLICATED}x faster than replicated (8 devices)",
            r["zoo_vs_replicated"],
            r["zoo_vs_replicated"] >= TARGET_VS_REPLICATED,
        )
        for r in results
        if r["devices"] == 8
    ]
    return out


def report(results: list[dict], command: str) -> str:
    def note(r):
        h, match = r["all_reduces"], r["matches_zoo"]
        counts = ", ".join(f"{LABELS[v]} {_harness.in_loop_outside(h[v])}" for v in VARIANTS)
        expected = "as expected" if r["hlo_ok"] else "UNEXPECTED"
        return (
            f"All-reduces in loops/outside: {counts} ({expected}); other collectives: "
            f"{_harness.other_collectives(h, VARIANTS)}. Weight updates and loss match zoo (rtol 1e-4): "
            f"hand-written {match['hand']}, replicated {match['replicated']}."
        )

    title = (
        f"Step time, {LAYERS} tanh layers {WIDTH}x{WIDTH}, M={MICROBATCHES}, "
        f"{PER_DEVICE} examples/device/microbatch. Times: medians over rounds; ratios: medians of "
        f"per-round ratios. Rerun: `{command}`"
    )
    header = ["devices", "zoo ms", "hand-written ms", "replicated ms", "zoo/hand-written speed"]
    header += ["zoo vs replicated", "hand-written vs replicated"]
    rows = [
        [str(r["devices"]), *(f"{r['median_ms'][v]:.1f}" for v in VARIANTS), f"{r['zoo_vs_hand']:.3f}x"]
        + [f"{r['zoo_vs_replicated']:.2f}x", f"{r['hand_vs_replicated']:.2f}x"]
        for r in results
    ]
    lines = _harness.report_lines(title, header, rows, results, note)
    lines += _harness.verdict_lines(verdicts(results), miss="MISS")
    return "\n".join(lines)


def main() -> None:
    args = _harness.parse_args(__doc__, DEFAULT_ROUNDS)
    if args.worker is not None:
        _harness.print_worker_result(worker(args.worker, args.rounds_for(args.worker)))
        return

    results = [_harness.run_worker(__file__, n, args.rounds_for(n)) for n in args.devices]
    command = _harness.command_line()
    print(report(results, command))
    _harness.write_summary({"command": command, "results": results, "verdicts": verdicts(results)}, args.json)


if __name__ == "__main__":
    main()
