"""Train a small byte-level language model on Python's own standard library.

The text is the standard library's top-level `.py` sources (found with `sysconfig`, so it
is on every machine without a download): a sorted, deterministic subset of a few MB, every
10th file held out for validation. Bytes are tokens (vocab 256). The model is a
`zoo.models.Transformer`, data-parallel over simulated CPU devices, trained by
`zoo.TrainStep` with microbatches: one gradient all-reduce per step, outside the loop.

It prints the unigram entropy of the training bytes (what a model that ignores context
can reach), the validation loss before and after training, a text sample, and the
collectives of the compiled training step. It exits 0 only if the final validation loss
is below the unigram entropy, i.e. the model learned to use context.

Run it (about two minutes on two idle CPU cores, longer on a busy machine):

    python examples/train_lm.py
    python examples/train_lm.py --steps 200 --layers 1   # a quicker look
    python examples/train_lm.py --help
"""

import argparse
import glob
import math
import os
import sys
import sysconfig
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (the data axis)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--batch-size", type=int, default=128, help="global batch (multiple of devices x microbatches)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per training window (also max_len)")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (warmup, then cosine decay)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--seed", type=int, default=0, help="seed for the model, the batches and the sample")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--data-mb", type=float, default=4.0, help="at most this many MB of stdlib sources")
    p.add_argument("--log-every", type=int, default=0, help="print train loss every k steps (0: steps/20)")
    p.add_argument("--eval-every", type=int, default=0, help="validation loss every k steps (0: start and end only)")
    p.add_argument("--eval-windows", type=int, default=256, help="validation windows (fixed, evenly spaced)")
    p.add_argument("--prompt", default="def ", help="start of the generated sample")
    p.add_argument("--sample-bytes", type=int, default=200, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    return p.parse_args(argv)


# Parsed first: the device count must be set before jax starts its backend, so before
# anything (zoo included) can touch a device.
args = parse_args()

# The simulated devices share a few cores, so on a busy machine one device's thread can
# reach the all-reduce long after the others; XLA's CPU runtime would abort the process
# after 40 s of waiting. Let it wait instead.
if "collective_call_terminate_timeout" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_collective_call_terminate_timeout_seconds=3600"
    ).strip()

import jax

jax.config.update("jax_num_cpu_devices", args.devices)

import equinox as eqx
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo

LN2 = math.log(2.0)


# --- data -----------------------------------------------------------------------------


def load_stdlib_bytes(max_bytes: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(train bytes, validation bytes, number of files) from the stdlib's top-level sources.

    Top-level files only: sub-folders hold the large, repetitive test suite and
    site-packages (whatever happens to be installed). Sorted by name so the split is the
    same on every run; every 10th file is validation, so the
    validation text comes from modules the model never saw.
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    train, val, total = [], [], 0
    for i, path in enumerate(paths):
        with open(path, "rb") as f:
            data = f.read()
        if total + len(data) > max_bytes and train:
            break
        (val if i % 10 == 9 else train).append(data)
        total += len(data)
    if not val:
        raise SystemExit(f"too little text under {stdlib} for a validation split; raise --data-mb")

    def as_array(parts):
        return np.frombuffer(b"".join(parts), dtype=np.uint8)

    return as_array(train), as_array(val), len(train) + len(val)


def unigram_entropy_bits(data: np.ndarray) -> float:
    """Entropy of the byte frequencies, in bits/byte: the best loss without context."""
    counts = np.bincount(data, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def random_windows(rng: np.random.Generator, data: np.ndarray, batch: int, seq: int) -> np.ndarray:
    """`batch` windows of `seq` bytes at random offsets, as int32 tokens `[batch, seq]`."""
    starts = rng.integers(0, len(data) - seq + 1, size=batch)
    return data[starts[:, None] + np.arange(seq)].astype(np.int32)


def fixed_windows(data: np.ndarray, count: int, seq: int) -> np.ndarray:
    """`count` evenly spaced windows: the same validation set at every evaluation."""
    starts = np.linspace(0, len(data) - seq, count).astype(np.int64)
    return data[starts[:, None] + np.arange(seq)].astype(np.int32)


# --- model helpers ----------------------------------------------------------------------


@jax.jit
def _loss_sums(model, tokens):
    sums, counts = zoo.models.next_token_loss(model, {"tokens": tokens})
    return sums.sum(), counts.sum()


def evaluate(model, tokens) -> float:
    """Mean next-token loss (nats) over `tokens`, forward only."""
    sums, counts = _loss_sums(model, tokens)
    return float(sums) / float(counts)


@jax.jit
def _next_byte(model, window, pos, key, temperature):
    # A full forward over the fixed window; causal attention makes the logits at `pos`
    # independent of the zero padding after it.
    logits = model(window[None])[0, pos]
    return jax.random.categorical(key, logits / temperature)


def sample(model, prompt: bytes, length: int, seq: int, temperature: float, key) -> bytes:
    """Continue `prompt` by `length` bytes, one forward per byte over the last `seq` bytes."""
    text = bytearray(prompt or b"\n")
    for i in range(length):
        context = text[-seq:]
        window = np.zeros(seq, np.int32)
        window[: len(context)] = np.frombuffer(bytes(context), np.uint8)
        byte = _next_byte(model, window, len(context) - 1, jax.random.fold_in(key, i), temperature)
        text.append(int(byte))
    return bytes(text)


# --- main -------------------------------------------------------------------------------


def main() -> int:
    n, m, bsz, seq = args.devices, args.microbatches, args.batch_size, args.seq_len
    if bsz % (n * m):
        raise SystemExit(f"--batch-size {bsz} must be a multiple of devices x microbatches = {n * m}")
    if args.eval_windows % n:
        raise SystemExit(f"--eval-windows {args.eval_windows} must be a multiple of --devices {n}")
    log_every = args.log_every or max(args.steps // 20, 1)

    train, val, files = load_stdlib_bytes(int(args.data_mb * 1e6))
    unigram = unigram_entropy_bits(train)
    print(f"data: {files} stdlib files, {len(train):,} train bytes, {len(val):,} validation bytes")
    print(f"unigram entropy of the training bytes: {unigram:.3f} bits/byte")

    config = zoo.models.TransformerConfig(
        vocab_size=256,
        d_model=args.d_model,
        num_heads=args.heads,
        num_layers=args.layers,
        max_len=seq,
        dtype=args.dtype,
    )
    model = zoo.models.Transformer(config, key=jax.random.key(args.seed))
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(
        f"model: d_model {args.d_model}, {args.layers} layers, {args.heads} heads, {params:,} parameters, "
        f"{args.dtype} compute"
    )
    print(f"training: {n} devices x {m} microbatches, batch {bsz} x {seq} bytes, {args.steps} steps, lr {args.lr:g}")

    # Short warmup, then cosine decay: a small LM at a high peak rate stays stable and
    # ends on the low rate that gives its best loss.
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=max(args.steps // 20, 1), decay_steps=args.steps, end_value=args.lr / 10
    )
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=args.weight_decay))

    rng = np.random.default_rng(args.seed)
    mesh = jax.make_mesh((n,), ("data",))
    with jax.set_mesh(mesh):
        model = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(zoo.models.next_token_loss, optimizer, microbatches=m)
        opt_state = step.init(model)

        # Validation windows split over the data axis, so evaluation is data-parallel too.
        val_tokens = jax.device_put(fixed_windows(val, args.eval_windows, seq), NamedSharding(mesh, P("data")))
        val_before = evaluate(model, val_tokens)
        print(f"val loss before training: {val_before:.4f} nats = {val_before / LN2:.3f} bits/byte")

        start = time.perf_counter()
        timer, timed_tokens, compile_s, eval_s = start, 0, 0.0, 0.0
        for i in range(1, args.steps + 1):
            batch = {"tokens": random_windows(rng, train, bsz, seq)}
            model, opt_state, loss = step(model, opt_state, batch)
            if i == 1:
                # The first step compiles; leave it out of the throughput.
                loss.block_until_ready()
                compile_s = time.perf_counter() - start
                timer, timed_tokens = time.perf_counter(), 0
            else:
                timed_tokens += bsz * seq
            if i % log_every == 0 or i == 1 or i == args.steps:
                train_loss = float(loss)  # waits for the step
                elapsed = time.perf_counter() - timer
                speed = f"{timed_tokens / elapsed:9,.0f} tokens/s" if timed_tokens else "(compiled)"
                print(f"step {i:5d}  train loss {train_loss:.4f} nats  {train_loss / LN2:.3f} bits/byte  {speed}")
                timer, timed_tokens = time.perf_counter(), 0
            if args.eval_every and i % args.eval_every == 0 and i != args.steps:
                t0 = time.perf_counter()
                val_loss = evaluate(model, val_tokens)
                print(f"            val loss   {val_loss:.4f} nats  {val_loss / LN2:.3f} bits/byte")
                eval_s += time.perf_counter() - t0
                timer += time.perf_counter() - t0  # keep evaluation out of the throughput
        train_s = time.perf_counter() - start - eval_s
        steady_tokens_per_s = (args.steps - 1) * bsz * seq / max(train_s - compile_s, 1e-9)

        val_after = evaluate(model, val_tokens)
        colls = zoo.collectives(step.lower(model, opt_state, batch), mesh=mesh)

    bits_after = val_after / LN2
    print(f"val loss after training:  {val_after:.4f} nats = {bits_after:.3f} bits/byte")
    print(
        f"time: {train_s:.1f} s training ({compile_s:.1f} s of it compiling), "
        f"{steady_tokens_per_s:,.0f} tokens/s after compiling"
    )
    print(
        f"final val / unigram entropy: {bits_after:.3f} / {unigram:.3f} bits/byte = {bits_after / unigram:.2f}"
    )

    # Sampling runs batch 1, which cannot split over the data axis: move the (replicated)
    # parameters to a one-device mesh rather than run the same forward on every device.
    one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    with jax.set_mesh(one):
        single = zoo.shard(model, zoo.rules("dp"), one)
        key = jax.random.key(args.seed + 1)
        text = sample(single, args.prompt.encode(), args.sample_bytes, seq, args.temperature, key)
    print(f"\nsample (temperature {args.temperature}):")
    print("-" * 72)
    print(text.decode("utf-8", errors="replace"))
    print("-" * 72)

    print("\ncollectives in the compiled training step:")
    print(zoo.report(colls))

    learned = bits_after < unigram
    if learned:
        print(f"\nOK: final val loss {bits_after:.3f} bits/byte is below the unigram entropy {unigram:.3f}")
    else:
        print(
            f"\nFAILED: final val loss {bits_after:.3f} bits/byte is NOT below the unigram entropy {unigram:.3f}; "
            "the model did not learn to use context (train longer, or raise --lr)"
        )
    return 0 if learned else 1


if __name__ == "__main__":
    sys.exit(main())
