"""Fresh processes for tests/test_checkpoints.py: training runs that save or resume, and a
save to be killed.

Importing `conftest` gives this process what the pytest process has: 8 simulated CPU
devices and the same XLA flags (so the same compiled programs, bit for bit).

    python tests/_checkpoint_worker.py train DIR OUT.npz --steps N [--save-at K] [--resume]
        [--preset fsdp] [--devices 8]
    python tests/_checkpoint_worker.py kill DIR MB   (dies by SIGKILL when committing step 2)
"""

import argparse
import functools
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import conftest  # noqa: F401  (its side effects: 8 devices, XLA flags, before jax's backend starts)
import equinox as eqx
import helpers
import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo

BATCH, MICROBATCHES = 16, 2


def big_state(seed: int, megabytes: int) -> dict:
    """`{"w": [rows, 1024] uint32}` of random bits from the host, split over 8 devices
    (incompressible, so writing it takes time in proportion to its size)."""
    rows = megabytes * 256
    bits = np.frombuffer(np.random.default_rng(seed).bytes(rows * 1024 * 4), np.uint32).reshape(rows, 1024)
    return {"w": jax.device_put(bits, NamedSharding(helpers.data_mesh(8), P("data", None)))}


def kill_target(directory: str, megabytes: int) -> None:
    """Save step 1 and wait for it, then save step 2 and SIGKILL this process at the
    commit point of that save: every file of step 2 written into its temporary
    directory, the rename that makes it a step not yet done. (Deterministic fault
    injection: orbax's `atomicity.on_commit_callback` is the one place that commits a
    step, whether the save is synchronous or asynchronous.)"""
    import signal

    from orbax.checkpoint._src.path import atomicity

    commit = atomicity.on_commit_callback

    async def commit_or_die(tmp_dir, **kwargs):
        if os.path.basename(str(tmp_dir.get_final())) == "2":
            print(f"COMMITTING 2 {tmp_dir.get()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return await commit(tmp_dir, **kwargs)

    atomicity.on_commit_callback = commit_or_die
    with zoo.Checkpointer(directory, keep=None) as ckpt:
        ckpt.save(1, big_state(1, megabytes))
        ckpt.wait()
        print("SAVED 1", flush=True)
        ckpt.save(2, big_state(2, megabytes))
        ckpt.wait()
        print("SAVED 2", flush=True)  # never reached: the commit point kills us


@functools.cache
def init_state(preset: str, mesh) -> tuple[zoo.TrainStep, Callable[[], dict]]:
    """The training step (donating its inputs) and a jitted function making the initial
    state: a tiny decoder with dropout, AdamW, and the RNG key the steps draw their
    dropout keys from. (One compile, rather than one per eager op of an initialisation:
    process start-up time.)"""
    step = zoo.TrainStep(
        zoo.models.next_token_loss,
        optax.adamw(1e-2),
        microbatches=MICROBATCHES,
        donate=True,
        preset=preset,
    )

    @eqx.filter_jit
    def make():
        model = helpers.tiny_decoder(jax.random.key(0), dropout=0.1, attention_dropout=0.1)
        model = zoo.shard(model, zoo.rules(preset), mesh)
        return {"model": model, "opt_state": step.init(model), "key": jax.random.key(42)}

    return step, make


def run(step: zoo.TrainStep, state: dict, first: int, last: int, ckpt=None, save_at=None) -> tuple[dict, list]:
    """Steps `first`..`last`; the per-step dropout key comes from the RNG carried in the
    state, the data from the step number (a data loader would keep its position in the
    checkpoint's metadata). Saves after step `save_at` and goes on at once: the step
    donates the buffers the (asynchronous) save has just been given."""
    losses = []
    for i in range(first, last + 1):
        key, sub = jax.random.split(state["key"])
        batch = helpers.lm_batch(jax.random.fold_in(jax.random.key(7), i), BATCH)
        batch["dropout_key"] = zoo.nn.example_keys(sub, BATCH)
        model, opt_state, loss = step(state["model"], state["opt_state"], batch)
        state = {"model": model, "opt_state": opt_state, "key": key}
        losses.append(np.asarray(loss))
        if i == save_at:
            ckpt.save(i, state, metadata={"run": "resume-test"})
    return state, losses


def leaves(state: dict) -> dict[str, np.ndarray]:
    """Every leaf of a training state as a host array (keys as their key data)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def train(directory: str, out: str, steps: int, save_at: int | None, resume: bool, preset: str, devices: int):
    """Without `resume`: train `steps` steps straight (run "straight"), then again from a
    fresh initial state, saving after step `save_at` (run "saving"). With `resume`:
    restore the newest checkpoint in a fresh process and train on to `steps` (run
    "resumed"). Writes each run's losses and final leaves to `out`."""
    mesh = helpers.preset_mesh(preset, devices)
    results = {}
    with jax.set_mesh(mesh), zoo.Checkpointer(directory, keep=None) as ckpt:
        step, make = init_state(preset, mesh)
        if resume:
            # The target: shapes and shardings of an initial state, nothing computed.
            done, state, metadata = ckpt.restore(jax.eval_shape(make))
            assert metadata == {"run": "resume-test"}, metadata
            results["resumed"] = run(step, state, done + 1, steps)
        else:
            results["straight"] = run(step, make(), 1, steps)
            results["saving"] = run(step, make(), 1, steps, ckpt, save_at)
    arrays = {}
    for name, (final, losses) in results.items():
        arrays[f"{name}/losses"] = np.stack(losses)
        arrays.update({f"{name}/{path}": value for path, value in leaves(final).items()})
    np.savez(out, **arrays)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("train")
    t.add_argument("directory")
    t.add_argument("out")
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--save-at", type=int)
    t.add_argument("--resume", action="store_true")
    t.add_argument("--preset", default="fsdp")
    t.add_argument("--devices", type=int, default=8)
    k = sub.add_parser("kill")
    k.add_argument("directory")
    k.add_argument("megabytes", type=int)
    args = p.parse_args()
    if args.mode == "kill":
        kill_target(args.directory, args.megabytes)
    else:
        train(args.directory, args.out, args.steps, args.save_at, args.resume, args.preset, args.devices)


if __name__ == "__main__":
    main()
