"""GRPO-shaped rollouts through `zoo.serve.Engine`: each prompt prefilled once for its group
(`share_prompts`, the default) against every request prefilled on its own.

A GRPO step samples `--generations` completions of each of `--prompts` prompts (TRL's
`num_generations`); `zoo finetune --objective grpo` submits them to the serving engine one
group after another, as OpenAI's `n` does. One decoder with random weights (`--size`:
`small`, d=512, 8 layers, GQA 8/2; `0.4b`, Qwen2-0.5B's shape, 24 layers, d=896, GQA 14/2;
both a 32,000-token vocabulary), one CPU device, `slots` = prompts × generations, prompts
of `--prompt-len` random ids, `--new` tokens each at temperature 1 (no stop id: every
request decodes the same number of steps either way). The two engines run the same
requests in turn, `--rounds` times each, after a warm-up round that compiles their
programs; the tokens and log-probabilities of the two are checked equal. Prints each side's
median seconds a rollout, its prefills and the ratio.

    python benchmarks/rollouts.py --size 0.4b --prompts 4 --generations 8 --prompt-len 128 --new 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import numpy as np

import zoo
from zoo.serve import Engine, Request

SIZES = {
    "tiny": dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=256),
    "small": dict(d_model=512, num_layers=8, num_heads=8, num_kv_heads=2, mlp_dim=2816),
    "0.4b": dict(d_model=896, num_layers=24, num_heads=14, num_kv_heads=2, mlp_dim=4864),
}
VOCAB = 32_000


def make_model(size: str, max_len: int):
    """A Qwen2-shaped decoder of `size` with random weights, float32, on one device."""
    config = zoo.models.TransformerConfig(
        vocab_size=VOCAB, max_len=max_len, positions="rope", activation="swiglu", norm="rmsnorm",
        use_bias=False, qkv_bias=True, tie_embeddings=True, **SIZES[size],
    )  # fmt: skip
    return zoo.models.Transformer(config, key=jax.random.key(0))


def requests(prompts: int, generations: int, prompt_len: int, new: int) -> list[Request]:
    """Each prompt's group one after another, every request seeded apart (as GRPO's)."""
    rng = np.random.default_rng(0)
    out = []
    for p in range(prompts):
        ids = rng.integers(1, VOCAB, size=prompt_len).tolist()
        out += [Request(ids, max_tokens=new, temperature=1.0, seed=p * generations + g) for g in range(generations)]
    return out


def rollout(engine: Engine, batch: list[Request]) -> tuple[float, list]:
    """Seconds to complete `batch` (submitted at once, stepped until done) and each request's
    `(ids, logprobs)`."""
    start = time.perf_counter()
    handles = [engine.submit(r) for r in batch]
    engine.run_until_done()
    seconds = time.perf_counter() - start
    return seconds, [(h.ids, [t.logprob for t in h.tokens]) for h in handles]


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--prompts", type=int, default=4, help="prompts a rollout (default 4)")
    parser.add_argument("--generations", type=int, default=8, help="completions of each (default 8)")
    parser.add_argument("--prompt-len", type=int, default=128, help="each prompt's ids (default 128)")
    parser.add_argument("--new", type=int, default=32, help="new tokens of each completion (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rollouts of each side, alternating (default 3)")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    max_len = args.prompt_len + args.new + 1
    model = make_model(args.size, max_len)
    batch = requests(args.prompts, args.generations, args.prompt_len, args.new)
    slots = args.prompts * args.generations
    engines = {share: Engine(model, slots=slots, max_len=max_len, share_prompts=share) for share in (True, False)}
    outputs = {share: rollout(engine, batch)[1] for share, engine in engines.items()}  # compiles
    for (ids, got), (want_ids, want) in zip(outputs[True], outputs[False]):
        if ids != want_ids or not np.allclose(got, want, atol=1e-5, rtol=0):
            raise SystemExit("the two engines sampled different tokens for the same request: a bug")
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for share, engine in engines.items():
            seconds[share].append(rollout(engine, batch)[0])
    shared, apart = statistics.median(seconds[True]), statistics.median(seconds[False])
    result = {
        "size": args.size,
        "prompts": args.prompts,
        "generations": args.generations,
        "prompt_len": args.prompt_len,
        "new": args.new,
        "shared_s": seconds[True],
        "apart_s": seconds[False],
        "ratio": shared / apart,
        "load": os.getloadavg()[0],
    }
    print(
        f"{args.size}, {args.prompts} prompts x {args.generations} generations, {args.prompt_len} prompt ids, "
        f"{args.new} new tokens, {slots} slots, one {jax.devices()[0].platform} device (load {result['load']:.1f})"
    )
    print("| prefills a rollout | median s | rollouts s |")
    print("|---|---:|---|")
    print(f"| {args.prompts} (shared, the default) | {shared:.2f} | {', '.join(f'{s:.2f}' for s in seconds[True])} |")
    print(f"| {slots} (each its own) | {apart:.2f} | {', '.join(f'{s:.2f}' for s in seconds[False])} |")
    print(f"shared / apart: {result['ratio']:.2f}; tokens and log-probabilities equal")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
