"""Decoding speed and cache memory of `zoo.generate`, side by side in one run.

One GPT-2-shaped model (random weights, made by transformers and loaded with
`zoo.hf.from_pretrained`, so all three run the same numbers), greedy decoding of
`--new` tokens (default 256) after a prompt of `--prompt` tokens, batch `--batch`, one CPU
device:

- **zoo cached**: `zoo.generate` — one prefill, then a `lax.while_loop` of one-token steps
  over the key/value cache, one compiled program;
- **zoo recompute**: the same loop without a cache: every step runs the model's full
  forward pass over the whole fixed-size token buffer (`prompt + new` columns; causal, so
  the columns not yet written do not change the logits read) and takes the logits of the
  last written column; one compiled program too (`lax.fori_loop`);
- **transformers**: `GPT2LMHeadModel.generate(do_sample=False)` with its own dynamic KV
  cache, `torch.set_num_threads(2)`.

The three must produce the same tokens (checked). Timed interleaved, `--rounds` rounds,
the order rotating each round, so load on a shared machine hits all alike; medians and
the median of per-round ratios are reported, with the machine's load average.

Memory: the cache `zoo.generate` allocates is `2 · layers · batch · columns · kv_heads ·
head_dim · bytes`; the script reads the compiled program's temporary memory
(`memory_analysis().temp_size_in_bytes`) at two lengths and compares its growth per column
with the formula's.

Run: `python benchmarks/generate.py [--new 256 --prompt 32 --batch 1 --rounds 3 --json out.json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from jax import lax

import zoo
from zoo._generate import _generate_program


def recompute_program(model, tokens, new: int):
    """Greedy decoding without a cache: the full forward pass over every column, each step."""
    s = tokens.shape[1]
    buffer = jnp.pad(tokens, ((0, 0), (0, new)))

    def step(i, buffer):
        logits = model(buffer)  # [b, s + new, vocab]; causal: unwritten columns do not matter
        last = lax.dynamic_index_in_dim(logits, s + i - 1, axis=1, keepdims=False)
        tok = jnp.argmax(last, axis=-1).astype(buffer.dtype)
        return lax.dynamic_update_index_in_dim(buffer, tok[:, None], s + i, axis=1)

    return lax.fori_loop(0, new, step, buffer)


def load_average() -> float:
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except OSError:
        return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--torch-threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.torch_threads)

    torch.manual_seed(0)
    columns = args.prompt + args.new
    config = transformers.GPT2Config(
        n_embd=args.width, n_layer=args.layers, n_head=args.heads, vocab_size=args.vocab, n_positions=columns,
        bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1,
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.generation_config.eos_token_id = None
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model = zoo.hf.from_pretrained(d)
    tokens = np.random.default_rng(0).integers(0, args.vocab - 1, (args.batch, args.prompt)).astype(np.int32)
    settings = (args.new, 0.0, None, None, None, 0)
    toks, mask = jnp.asarray(tokens), jnp.ones(tokens.shape, bool)
    recompute = eqx.filter_jit(recompute_program)

    def run_cached():
        return np.asarray(zoo.generate(model, tokens, max_new_tokens=args.new))

    def run_recompute():
        return np.asarray(recompute(model, toks, args.new))

    def run_hf():
        with torch.no_grad():
            return hf.generate(
                torch.from_numpy(tokens.astype(np.int64)), attention_mask=torch.ones(tokens.shape, dtype=torch.long),
                do_sample=False, max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0,
            ).numpy()  # fmt: skip

    runs = {"zoo cached": run_cached, "zoo recompute": run_recompute, "transformers": run_hf}
    t0 = time.perf_counter()
    first = {name: fn() for name, fn in runs.items()}  # compiles (zoo), warms up (torch)
    compile_s = time.perf_counter() - t0
    same = all(np.array_equal(first["zoo cached"], out) for out in first.values())
    load_before = load_average()
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % 3 :] + names[: r % 3]:
            t = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t)
    load_after = load_average()
    new_tokens = args.batch * args.new
    result = {
        "model": {"layers": args.layers, "d_model": args.width, "heads": args.heads, "vocab": args.vocab,
                  "parameters": sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))},
        "prompt": args.prompt, "new_tokens": args.new, "batch": args.batch, "rounds": args.rounds,
        "same_tokens": same, "warmup_and_compile_s": compile_s,
        "load_average": [load_before, load_after], "cpus": os.cpu_count(),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "tokens_per_s": {k: new_tokens / statistics.median(v) for k, v in times.items()},
        "cached_over_recompute": statistics.median(
            [a / b for a, b in zip(times["zoo recompute"], times["zoo cached"], strict=True)]),
        "cached_over_transformers": statistics.median(
            [a / b for a, b in zip(times["transformers"], times["zoo cached"], strict=True)]),
    }  # fmt: skip

    # Memory: temporary bytes of the compiled program at two lengths against the formula.
    cfg = model.config
    kvh, hd = cfg.kv_heads, cfg.head_dim or cfg.d_model // cfg.num_heads
    per_column = 2 * cfg.num_layers * args.batch * kvh * hd * jnp.dtype(cfg.compute_dtype).itemsize
    temp = {}
    for new in (args.new // 2, args.new):
        compiled = _generate_program.lower(model, toks, mask, None, (new,) + settings[1:], None).compile()
        temp[new] = compiled.compiled.memory_analysis().temp_size_in_bytes
    growth = (temp[args.new] - temp[args.new // 2]) / (args.new - args.new // 2)
    result["memory"] = {
        "formula_bytes": per_column * columns,
        "program_temp_bytes": temp[args.new],
        "program_temp_bytes_half_length": temp[args.new // 2],
        "temp_growth_per_column": growth,
        "formula_per_column": per_column,
        "growth_over_formula": growth / per_column,
    }

    print(f"zoo.generate benchmark: GPT-2 shape {args.layers} layers x {args.width}, {args.heads} heads, vocab "
          f"{args.vocab} ({result['model']['parameters']:,} parameters), batch {args.batch}, prompt {args.prompt}, "
          f"{args.new} new tokens, greedy, 1 CPU device; torch threads {torch.get_num_threads()}; "
          f"{args.rounds} rounds interleaved")  # fmt: skip
    print(
        f"load average {load_before:.2f} -> {load_after:.2f} on {os.cpu_count()} CPUs; same tokens from all three: {same}"
    )
    for name in runs:
        print(f"  {name:<14} {result['median_s'][name]:8.3f} s  {result['tokens_per_s'][name]:10.1f} tokens/s")
    print(f"cached / recompute speed: {result['cached_over_recompute']:.1f}x (goal >= 10x)")
    print(f"cached / transformers speed: {result['cached_over_transformers']:.2f}x (goal >= 1x)")
    m = result["memory"]
    print(f"cache formula 2*layers*batch*columns*kv_heads*head_dim*bytes = {m['formula_bytes']:,} bytes "
          f"({m['formula_per_column']:,} per column); program temp {m['program_temp_bytes']:,} bytes at {columns} "
          f"columns, {m['program_temp_bytes_half_length']:,} at {args.prompt + args.new // 2}: grows "
          f"{m['temp_growth_per_column']:,.0f} bytes per column = {m['growth_over_formula']:.2f}x the formula")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
