"""What `train_lm.py` and `lora_finetune.py` share: flags, device set-up, byte-level data, evaluation.

The scripts import this module before they parse their flags, so before jax is told how
many devices to simulate, which must come before its backend starts. So nothing here
imports jax (or zoo, or optax) when the module loads: `use_cpu_devices` configures jax,
and the functions that need it import it when first called, after that.
"""

import argparse
import functools
import glob
import math
import os
import sysconfig

import numpy as np

LN2 = math.log(2.0)  # nats per bit

STDLIB = sysconfig.get_paths()["stdlib"]

# The flags both scripts take, with the same meaning: name -> add_argument keywords. Where
# the scripts' defaults differ there is none here, and `add_flags` must be given one.
_FLAGS = {
    "devices": {"type": int, "default": 8, "help": "simulated CPU devices (the data axis)"},
    "microbatches": {"type": int, "default": 4, "help": "microbatches per step"},
    "batch-size": {"type": int, "help": "global batch (multiple of devices x microbatches)"},
    "seq-len": {"type": int, "default": 64, "help": "bytes per training window (also max_len)"},
    "d-model": {"type": int, "default": 64, "help": "model width"},
    "layers": {"type": int, "default": 2, "help": "transformer blocks"},
    "heads": {"type": int, "default": 4, "help": "attention heads"},
    "data-mb": {"type": float, "help": "at most this many MB of stdlib sources"},
}


# --- flags and devices -------------------------------------------------------------------


def new_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first line of the script's docstring, showing defaults."""
    return argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )


def add_flags(parser: argparse.ArgumentParser, *names: str, **defaults) -> None:
    """Add the shared flags `names` ("devices", "batch-size", ...) to `parser`, in that
    order; `defaults` (`batch_size=64`, ...) give or replace their defaults."""
    for name in names:
        kwargs = dict(_FLAGS[name])
        key = name.replace("-", "_")
        if key in defaults:
            kwargs["default"] = defaults.pop(key)
        if "default" not in kwargs:
            raise TypeError(f"add_flags: --{name} needs a default ({key}=...)")
        parser.add_argument(f"--{name}", **kwargs)
    if defaults:
        raise TypeError(f"add_flags: defaults for flags not added: {', '.join(sorted(defaults))}")


def batch_layout(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """(devices, microbatches, batch size, window length), once the batch is checked to
    split over devices x microbatches and the validation windows over the devices."""
    n, m, bsz, seq = args.devices, args.microbatches, args.batch_size, args.seq_len
    if bsz % (n * m):
        raise SystemExit(f"--batch-size {bsz} must be a multiple of devices x microbatches = {n * m}")
    if args.eval_windows % n:
        raise SystemExit(f"--eval-windows {args.eval_windows} must be a multiple of --devices {n}")
    return n, m, bsz, seq


def use_cpu_devices(count: int) -> None:
    """Make jax simulate `count` CPU devices: call it before anything (zoo included) can
    touch a device."""
    # The simulated devices share a few cores, so on a busy machine one device's thread can
    # reach the all-reduce long after the others; XLA's CPU runtime would abort the process
    # after 40 s of waiting. Let it wait instead.
    if "collective_call_terminate_timeout" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_cpu_collective_call_terminate_timeout_seconds=3600"
        ).strip()

    import jax

    jax.config.update("jax_num_cpu_devices", count)


# --- data ----------------------------------------------------------------------------------


def stdlib_sources(max_bytes: int, min_files: int) -> list[bytes]:
    """The standard library's top-level `.py` files, in name order, up to `max_bytes` in
    all but at least `min_files` of them (where there are as many).

    Top-level files only: sub-folders hold the large, repetitive test suite and
    site-packages (whatever happens to be installed). Sorted by name, so the text (and the
    split of `split_files`) is the same on every run.
    """
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(STDLIB, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        if total + len(data) > max_bytes and len(parts) >= min_files:
            break
        parts.append(data)
        total += len(data)
    return parts


def split_files(parts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) bytes: every 10th part is validation, the rest training, so the
    validation text comes from files (modules, topics) the model never saw."""
    train = b"".join(p for i, p in enumerate(parts) if i % 10 != 9)
    val = b"".join(p for i, p in enumerate(parts) if i % 10 == 9)
    return np.frombuffer(train, np.uint8), np.frombuffer(val, np.uint8)


def random_windows(rng: np.random.Generator, data: np.ndarray, batch: int, seq: int) -> np.ndarray:
    """`batch` windows of `seq` bytes at random offsets, as int32 tokens `[batch, seq]`."""
    starts = rng.integers(0, len(data) - seq + 1, size=batch)
    return data[starts[:, None] + np.arange(seq)].astype(np.int32)


def fixed_windows(data: np.ndarray, count: int, seq: int) -> np.ndarray:
    """`count` evenly spaced windows: the same validation set at every evaluation."""
    starts = np.linspace(0, len(data) - seq, count).astype(np.int64)
    return data[starts[:, None] + np.arange(seq)].astype(np.int32)


# --- training and evaluation (these import jax when called) --------------------------------


def make_optimizer(lr: float, steps: int, weight_decay: float = 0.01):
    """AdamW with global-norm clipping at 1, a short warmup to `lr`, then cosine decay.

    A small LM at a high peak rate stays stable and ends on the low rate that gives its
    best loss.
    """
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup_steps=max(steps // 20, 1), decay_steps=steps, end_value=lr / 10
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay))


@functools.cache
def _loss_sums():
    # Built on first use, once jax is configured (see the module's docstring).
    import jax

    import zoo

    @jax.jit
    def loss_sums(model, tokens):
        sums, counts = zoo.models.next_token_loss(model, {"tokens": tokens})
        return sums.sum(), counts.sum()

    return loss_sums


def evaluate(model, tokens) -> float:
    """Mean next-token loss (nats) over `tokens`, forward only (no dropout)."""
    sums, counts = _loss_sums()(model, tokens)
    return float(sums) / float(counts)
