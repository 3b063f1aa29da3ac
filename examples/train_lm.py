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
import sys
import time

import _lm_common as common
from _lm_common import LN2


def parse_args(argv=None) -> argparse.Namespace:
    p = common.new_parser(__doc__)
    common.add_flags(p, "devices", "microbatches")
    p.add_argument("--steps", type=int, default=600, help="training steps")
    common.add_flags(p, "batch-size", "seq-len", batch_size=128)
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (warmup, then cosine decay)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--seed", type=int, default=0, help="seed for the model, the batches and the sample")
    common.add_flags(p, "d-model", "layers", "heads")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    common.add_flags(p, "data-mb", data_mb=4.0)
    p.add_argument("--log-every", type=int, default=0, help="print train loss every k steps (0: steps/20)")
    p.add_argument("--eval-every", type=int, default=0, help="validation loss every k steps (0: start and end only)")
    p.add_argument("--eval-windows", type=int, default=256, help="validation windows (fixed, evenly spaced)")
    p.add_argument("--prompt", default="def ", help="start of the generated sample")
    p.add_argument("--sample-bytes", type=int, default=200, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    common.add_cache_flag(p)
    return p.parse_args(argv)


# Parsed first: the device count must be set before jax starts its backend, so before
# anything (zoo included) can touch a device.
args = parse_args()
common.use_cpu_devices(args.devices)
common.use_compile_cache(args)

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo

# --- data -----------------------------------------------------------------------------


def load_stdlib_bytes(max_bytes: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(train bytes, validation bytes, number of files) from the stdlib's top-level sources
    (`_lm_common.stdlib_sources`): every 10th file is validation, so the validation text
    comes from modules the model never saw."""
    parts = common.stdlib_sources(max_bytes, min_files=1)
    if len(parts) < 10:
        raise SystemExit(f"too little text under {common.STDLIB} for a validation split; raise --data-mb")
    return (*common.split_files(parts), len(parts))


def unigram_entropy_bits(data: np.ndarray) -> float:
    """Entropy of the byte frequencies, in bits/byte: the best loss without context."""
    counts = np.bincount(data, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


# --- model helpers ----------------------------------------------------------------------


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
    n, m, bsz, seq = common.batch_layout(args)
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

    optimizer = common.make_optimizer(args.lr, args.steps, args.weight_decay)

    rng = np.random.default_rng(args.seed)
    mesh = jax.make_mesh((n,), ("data",))
    with jax.set_mesh(mesh):
        model = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(zoo.models.next_token_loss, optimizer, microbatches=m)
        opt_state = step.init(model)

        # Validation windows split over the data axis, so evaluation is data-parallel too.
        val_tokens = jax.device_put(common.fixed_windows(val, args.eval_windows, seq), NamedSharding(mesh, P("data")))
        val_before = common.evaluate(model, val_tokens)
        print(f"val loss before training: {val_before:.4f} nats = {val_before / LN2:.3f} bits/byte")

        start = time.perf_counter()
        timer, timed_tokens, compile_s, eval_s = start, 0, 0.0, 0.0
        previous = None
        for i in range(1, args.steps + 1):
            batch = {"tokens": common.random_windows(rng, train, bsz, seq)}
            model, opt_state, loss = step(model, opt_state, batch)
            # At most two steps in flight: the next batch is prepared while a step runs, but
            # the queue stays short. With many steps queued, XLA's CPU runtime (simulated
            # devices on a few busy cores) was seen to hang for good in the all-reduce.
            if previous is not None:
                previous.block_until_ready()
            previous = loss
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
                val_loss = common.evaluate(model, val_tokens)
                print(f"            val loss   {val_loss:.4f} nats  {val_loss / LN2:.3f} bits/byte")
                eval_s += time.perf_counter() - t0
                timer += time.perf_counter() - t0  # keep evaluation out of the throughput
        train_s = time.perf_counter() - start - eval_s
        steady_tokens_per_s = (args.steps - 1) * bsz * seq / max(train_s - compile_s, 1e-9)

        val_after = common.evaluate(model, val_tokens)
        colls = zoo.collectives(step.lower(model, opt_state, batch), mesh=mesh)

    bits_after = val_after / LN2
    print(f"val loss after training:  {val_after:.4f} nats = {bits_after:.3f} bits/byte")
    print(
        f"time: {train_s:.1f} s training ({compile_s:.1f} s of it compiling), "
        f"{steady_tokens_per_s:,.0f} tokens/s after compiling"
    )
    print(f"final val / unigram entropy: {bits_after:.3f} / {unigram:.3f} bits/byte = {bits_after / unigram:.2f}")

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
