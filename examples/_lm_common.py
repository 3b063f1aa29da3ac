"""What `train_lm.py` and `lora_finetune.py` share: flags, device set-up, byte-level data, evaluation.

The scripts import this module before they parse their flags, so before jax is told how
many devices to simulate, which must come before its backend starts. So nothing here
imports jax (or zoo, or optax) when the module loads: `use_cpu_devices` configures jax,
and the functions that need it import it when first called, after that.
"""

import argparse
import functools
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


def add_cache_flag(parser: argparse.ArgumentParser) -> None:
    """`--no-compile-cache`: the examples keep their compiled steps in zoo's persistent cache."""
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not use the persistent compilation cache (zoo.enable_compilation_cache; "
        "ZOO_NO_COMPILE_CACHE=1 also turns it off)",
    )


def use_compile_cache(args: argparse.Namespace) -> None:
    """Turn on zoo's persistent compilation cache unless `--no-compile-cache` was given:
    a second identical run loads its compiled programs instead of compiling them."""
    if not args.no_compile_cache:
        import zoo

        zoo.enable_compilation_cache()


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


# --- data (the corpora live in zoo.data; imported on first use, see the module's docstring) ---


def stdlib_sources(max_bytes: int, min_files: int) -> list[bytes]:
    """The standard library's top-level `.py` files (`zoo.data.stdlib_source_files`)."""
    from zoo.data import stdlib_source_files

    return stdlib_source_files(max_bytes, min_files)


def split_files(parts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) bytes, every 10th part validation (`zoo.data.split_files`)."""
    from zoo.data import split_files

    return split_files(parts)


def random_windows(rng: np.random.Generator, data: np.ndarray, batch: int, seq: int) -> np.ndarray:
    """`batch` random windows of `seq` bytes, int32 (`zoo.data.random_windows`)."""
    from zoo.data import random_windows

    return random_windows(rng, data, batch, seq)


def fixed_windows(data: np.ndarray, count: int, seq: int) -> np.ndarray:
    """`count` evenly spaced windows of `seq` bytes (`zoo.data.fixed_windows`)."""
    from zoo.data import fixed_windows

    return fixed_windows(data, count, seq)


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
