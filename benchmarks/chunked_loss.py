"""Peak memory and step time of one LoRA training step with the next-token loss chunked
(`TransformerConfig.loss_chunk`) and not, at Qwen2's vocabulary of 151,936 words.

Each variant runs in its own process (peak resident memory is per process): a small
Qwen-shaped decoder (tied embedding, `--layers` layers of width `--d-model`), LoRA r=16
on q/v, AdamW, one device, `--batch` × `--seq` tokens. The worker compiles the step,
runs it once and prints one JSON line: the process's peak resident memory (`ru_maxrss`,
compile included) and XLA's own figure for the step's temporary buffers
(`memory_analysis().temp_size_in_bytes`). Step times come from one more process that
compiles every variant and runs them round by round, interleaved (`--rounds` rounds
after a warm-up), so load from other processes hits them alike: the median step time
and the median of per-round ratios to the first variant.

    python benchmarks/chunked_loss.py                       # unchunked vs "auto"
    python benchmarks/chunked_loss.py --chunks none,8,32,64 --batch 4 --seq 512
    python benchmarks/chunked_loss.py --chunks auto --batch 8 --seq 2048 --memory-only
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _step(args: argparse.Namespace, variant: str):
    """(compiled step, its arguments, loss_chunk) of one variant, compiled."""
    import jax
    import jax.numpy as jnp
    import optax

    import zoo

    chunk = None if variant == "none" else "auto" if variant == "auto" else int(variant)
    config = zoo.models.TransformerConfig(
        vocab_size=args.vocab, d_model=args.d_model, num_heads=args.d_model // 64, num_kv_heads=2,
        num_layers=args.layers, mlp_dim=4 * args.d_model, max_len=args.seq, positions="rope", norm="rmsnorm",
        activation="swiglu", use_bias=False, tie_embeddings=True, loss_chunk=chunk,
    )  # fmt: skip
    lora = zoo.lora.LoraConfig(r=16, lora_alpha=32, target_modules=("q_proj", "v_proj"))
    model = zoo.lora.add_lora(zoo.models.Transformer(config, key=jax.random.key(0)), lora, key=jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (args.batch, args.seq), 0, args.vocab)
    batch = {"tokens": tokens, "mask": jnp.ones_like(tokens, dtype=bool)}
    step = zoo.TrainStep(
        zoo.models.next_token_loss, optax.adamw(1e-4), trainable=zoo.lora.trainable(model, lora), donate=False
    )
    opt_state = step.init(model)
    return step.compile(model, opt_state, batch), (model, opt_state, batch), chunk


def _run(compiled, arguments) -> tuple[float, float]:
    """(seconds, loss) of one step."""
    import jax

    start = time.perf_counter()
    loss = jax.block_until_ready(compiled(*arguments)[2])
    return time.perf_counter() - start, float(loss)


def memory_worker(args: argparse.Namespace) -> None:
    """One variant in this process: its peak resident memory and XLA's temporary bytes."""
    start = time.perf_counter()
    compiled, arguments, chunk = _step(args, args.worker)
    compile_s = time.perf_counter() - start
    seconds, loss = _run(compiled, arguments)
    result = {
        "variant": args.worker,
        "chunk": chunk,
        "compile_s": compile_s,
        "first_step_s": seconds,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "loss": loss,
    }
    print(json.dumps(result))


def timing_worker(args: argparse.Namespace, variants: list[str]) -> None:
    """Every variant compiled in this process and run round by round, interleaved, so load
    from other processes hits them alike: the median step time of each and the median of
    per-round ratios to the first."""
    steps = {v: _step(args, v)[:2] for v in variants}
    for v in variants:  # warm up
        _run(*steps[v])
    times = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            times[v].append(_run(*steps[v])[0])
    first = variants[0]
    print(json.dumps({v: {"step_s": statistics.median(ts),
                          "ratio": statistics.median(t / b for t, b in zip(ts, times[first]))}
                      for v, ts in times.items()}))  # fmt: skip


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", default="none,auto", help="variants: none (full logits), auto, or positions")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-only", action="store_true", help="no timing process (one step per variant)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None and args.worker.startswith("time:"):
        return timing_worker(args, args.worker[5:].split(","))
    if args.worker is not None:
        return memory_worker(args)
    shared = [f"--{k}={v}" for k, v in (("vocab", args.vocab), ("d-model", args.d_model), ("layers", args.layers),
              ("batch", args.batch), ("seq", args.seq), ("rounds", args.rounds))]  # fmt: skip
    logits = args.batch * (args.seq - 1) * args.vocab * 4
    print(f"vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, batch {args.batch} x {args.seq} tokens: "
          f"full float32 logits {_gib(logits)}; LoRA r=16 on q/v, AdamW, one device")  # fmt: skip

    def worker(flag: str) -> dict | None:
        out = subprocess.run([sys.executable, __file__, flag, *shared], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(f"{flag}: failed (exit {out.returncode})\n{out.stderr[-2000:]}")
            return None
        return json.loads(out.stdout.strip().splitlines()[-1])

    variants = args.chunks.split(",")
    memory = {v: worker(f"--worker={v}") for v in variants}
    timing = {} if args.memory_only else worker(f"--worker=time:{args.chunks}") or {}
    base = memory.get(variants[0])
    for v in variants:
        if memory.get(v) is not None:
            print(f"{v}: first step (compiled, one process) {memory[v]['first_step_s']:.1f} s")
    print(
        f"{'variant':>8} {'step':>8} {'peak RSS':>10} {'XLA temp':>10} {'loss':>9}   vs {variants[0]}: step, RSS, temp"
    )
    for v in variants:
        m, t = memory.get(v), timing.get(v, {"step_s": float("nan"), "ratio": float("nan")})
        if m is None or base is None:
            continue
        ratios = f"{t['ratio']:.2f}x, {m['peak_rss_bytes'] / base['peak_rss_bytes']:.2f}x, {m['temp_bytes'] / base['temp_bytes']:.2f}x"  # fmt: skip
        print(f"{v:>8} {t['step_s']:7.2f}s {_gib(m['peak_rss_bytes']):>10} {_gib(m['temp_bytes']):>10} "
              f"{m['loss']:9.5f}   {ratios}")  # fmt: skip


if __name__ == "__main__":
    main()
