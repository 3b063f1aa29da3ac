"""`zoo.generate` against transformers' `generate` at several batch sizes, side by side.

The issue's model: a random Llama shape made by transformers (`LlamaForCausalLM`, default
d=512, 8 layers, 8 query / 2 key-value heads, SwiGLU 2048, vocab 8192, untied head) and
loaded with `zoo.hf.from_pretrained`, so both compute the same function; greedy decoding
of `--new` tokens after `--prompt`-token prompts, at each batch in `--batches`, on one CPU
device (torch: `torch.set_num_threads(--torch-threads)`).

For each batch, the two run `--rounds` times interleaved (the order alternating each
round), so load from other processes hits both alike; the tokens must agree (checked).
Printed per batch: the median seconds of each, and the median and spread (min-max) of the
per-round ratios `time(transformers) / time(zoo)` (above 1: zoo faster). Goal: >= 1 at
batch 1, 8 and 32.

Run: `python benchmarks/generate_vs_hf.py [--batches 1 8 32 --new 64 --rounds 5 --json out.json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch
import transformers

import zoo


def make_models(args):
    """The transformers model and the same weights as a zoo model."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d, intermediate_size=4 * args.d, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=args.prompt + args.new,
        tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.generation_config.eos_token_id = None
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        model = zoo.hf.from_pretrained(folder)
    return hf, model


def compare(hf, model, batch: int, args) -> dict:
    """Both decoders on one batch of prompts, `args.rounds` interleaved rounds."""
    tokens = np.random.default_rng(batch).integers(1, args.vocab, (batch, args.prompt)).astype(np.int32)

    def run_zoo():
        return np.asarray(zoo.generate(model, tokens, max_new_tokens=args.new))

    def run_hf():
        with torch.no_grad():
            return hf.generate(
                torch.from_numpy(tokens.astype(np.int64)), attention_mask=torch.ones(tokens.shape, dtype=torch.long),
                do_sample=False, max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0,
            ).numpy()  # fmt: skip

    runs = {"zoo": run_zoo, "transformers": run_hf}
    first = {name: fn() for name, fn in runs.items()}  # compiles (zoo), warms up (torch)
    same = bool(np.array_equal(first["zoo"], first["transformers"]))
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    ratios = [h / z for h, z in zip(times["transformers"], times["zoo"], strict=True)]
    return {
        "batch": batch, "same_tokens": same,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "tokens_per_s": {k: batch * args.new / statistics.median(v) for k, v in times.items()},
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.torch_threads)
    hf, model = make_models(args)
    load = [os.getloadavg()[0]]
    results = []
    for batch in args.batches:
        r = compare(hf, model, batch, args)
        results.append(r)
        print(f"batch {batch:3d}: zoo {r['median_s']['zoo']:.2f} s ({r['tokens_per_s']['zoo']:.0f} tokens/s), "
              f"transformers {r['median_s']['transformers']:.2f} s ({r['tokens_per_s']['transformers']:.0f} tokens/s): "
              f"zoo is {r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}); "
              f"same tokens: {r['same_tokens']}", flush=True)  # fmt: skip
    load.append(os.getloadavg()[0])
    print(f"Llama d={args.d} layers={args.layers} vocab={args.vocab}, prompt {args.prompt}, {args.new} new tokens, "
          f"greedy, {args.rounds} rounds; torch threads {torch.get_num_threads()}; "
          f"load average {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load_average": load, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
