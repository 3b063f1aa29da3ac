"""Serving throughput and latency of `zoo.serve.Engine` against one request at a time.

One Llama-shaped model (random weights made by transformers and loaded with
`zoo.hf.from_pretrained`, so all run the same numbers; default d=512, 8 layers, GQA 8/2,
vocab 8192), one CPU device, greedy decoding, a workload of requests with mixed prompt
lengths (16-64 tokens) and output lengths (16-128 new tokens):

- **engine, C clients**: `zoo.serve.Engine(slots=C)` stepping in its thread; C closed-loop
  clients, each submitting its next request when the last one finished, for C in
  `--clients` (1, 4, 16, 64). Reported: generated tokens/s over the run, time to first
  token (submit → first token) and per-token latency (between a request's consecutive
  tokens), p50 / p99.
- **zoo.generate, one at a time**: the same requests, each `zoo.generate` alone (compiled
  for each shape beforehand, so only decoding is timed).
- **transformers, one at a time**: `LlamaForCausalLM.generate(do_sample=False)`,
  `torch.set_num_threads` = the machine's cores.

The engine's tokens are checked equal to zoo.generate's for the baseline requests. Prints
one table with each row's throughput as a ratio of one-at-a-time zoo.generate.

`--adapters K` (default 4; 0 skips it) adds the many-adapter run at `--adapter-clients`
clients: the same workload served (a) by one plain LoRA model (`add_lora`, the first of the
K adapters, alone in the engine) and (b) by one engine holding all K adapters of different
ranks and targets beside the base (`Engine(base, adapters=...)`), each request routed to
adapter `i % K`; the two run side by side in one process. The requests of adapter 0 are
checked to get the same tokens both ways. Goal: (b) ≥ 0.8× (a).

Run: `python benchmarks/serve.py [--clients 1 4 16 64 --requests 64 --baseline 8 --adapters 4 --json out.json]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import threading
import time

import jax
import numpy as np
import torch
import transformers

import zoo
from zoo.serve import Engine, Request


def make_model(args):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d, intermediate_size=4 * args.d, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    folder = tempfile.mkdtemp()
    hf.save_pretrained(folder)
    return hf, zoo.hf.from_pretrained(folder)


def workload(n: int, vocab: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [
        Request(rng.integers(1, vocab, size=int(rng.integers(16, 65))).tolist(), max_tokens=int(rng.integers(16, 129)))
        for _ in range(n)
    ]


def percentile(values, q):
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def run_engine(model, requests: list[Request], clients: int, adapters=None, rounds: int = 1, before=None) -> list:
    """C closed-loop clients over `requests`, `rounds` times on one engine (compiled once;
    `before()` is called before each round); timings from the engine thread's callbacks."""
    engine = Engine(model, slots=clients, max_len=256, adapters=adapters)
    # Compile every prefill bucket and decode span the workload uses before timing it.
    engine.warm_up([len(r.prompt) for r in requests], max(len(r.prompt) + r.max_tokens for r in requests))
    engine.start()
    results = []
    for _ in range(rounds):
        extra = before() if before is not None else {}
        results.append(closed_loop(engine, requests, clients) | extra)
    engine.stop()
    return results


def closed_loop(engine, requests: list[Request], clients: int) -> dict:
    pending = list(range(len(requests)))
    lock = threading.Lock()
    done = threading.Event()
    stamps: dict[int, list[float]] = {}
    submitted: dict[int, float] = {}
    outputs: dict[int, list[int]] = {}
    remaining = [len(requests)]

    def launch():
        with lock:
            if not pending:
                return
            i = pending.pop(0)
        stamps[i] = []
        submitted[i] = time.perf_counter()

        def on_update(token, i=i):
            if token is not None:
                stamps[i].append(time.perf_counter())
                return
            outputs[i] = handles[i].ids
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()
            launch()

        handles[i] = engine.submit(requests[i], on_update=on_update)

    handles: dict[int, object] = {}
    start = time.perf_counter()
    for _ in range(min(clients, len(requests))):
        launch()
    done.wait()
    elapsed = time.perf_counter() - start
    tokens = sum(len(v) for v in outputs.values())
    ttft = [stamps[i][0] - submitted[i] for i in stamps]
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    return {
        "tokens_per_s": tokens / elapsed,
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "token_p50": percentile(gaps, 50), "token_p99": percentile(gaps, 99),
        "outputs": outputs, "compiles": len(engine.compiles), "seconds": elapsed, "kernels": dict(engine.kernels),
    }  # fmt: skip


def run_generate(model, requests: list[Request]) -> tuple[float, list[list[int]]]:
    for r in requests:  # compile every shape first
        zoo.generate(model, np.asarray([r.prompt]), max_new_tokens=r.max_tokens).block_until_ready()
    start, outs = time.perf_counter(), []
    for r in requests:
        out = np.asarray(zoo.generate(model, np.asarray([r.prompt]), max_new_tokens=r.max_tokens))
        outs.append(out[0, len(r.prompt) :].tolist())
    return sum(r.max_tokens for r in requests) / (time.perf_counter() - start), outs


def run_transformers(hf, requests: list[Request]) -> tuple[float, list[list[int]]]:
    hf.generation_config.eos_token_id = None
    start, outs = time.perf_counter(), []
    with torch.no_grad():
        for r in requests:
            out = hf.generate(torch.tensor([r.prompt]), do_sample=False, max_new_tokens=r.max_tokens, pad_token_id=0)
            outs.append(out[0, len(r.prompt) :].tolist())
    return sum(r.max_tokens for r in requests) / (time.perf_counter() - start), outs


# (rank, alpha, targets) of the K adapters, cycled: different ranks and target layers.
ADAPTER_SHAPES = [
    (8, 16, ("q_proj", "v_proj")),
    (16, 16, ("q_proj", "k_proj", "v_proj", "o_proj")),
    (4, 8, ("up", "gate", "down")),
    (8, 8, ("q_proj", "v_proj", "down")),
]


def make_adapters(model, k: int) -> dict:
    """`k` single-adapter LoRA models over `model`, B filled with noise (trained-like)."""
    import equinox as eqx

    out = {}
    for i in range(k):
        r, alpha, targets = ADAPTER_SHAPES[i % len(ADAPTER_SHAPES)]
        lora = zoo.lora.add_lora(model, zoo.lora.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets),
                                 key=jax.random.key(i))  # fmt: skip
        params, static = eqx.partition(lora, zoo.lora.trainable(lora))
        params = jax.tree.map(
            lambda x, i=i: x + 0.02 * jax.random.normal(jax.random.key(100 + i), x.shape, x.dtype), params
        )
        out[f"adapter{i}"] = eqx.combine(params, static)
    return out


def run_adapters(model, args) -> list[tuple[str, float, dict]]:
    """One plain LoRA model alone vs K adapters mixed in one engine: the same requests,
    `--adapter-rounds` times each, alternating (a shared machine's load drifts)."""
    adapters = make_adapters(model, args.adapters)
    names = list(adapters)
    clients = args.adapter_clients
    requests = workload(max(args.requests, 2 * clients), args.vocab, seed=1)
    mixed_requests = [dataclasses.replace(r, adapter=names[i % len(names)]) for i, r in enumerate(requests)]
    rows = []
    for round_ in range(args.adapter_rounds):
        single = run_engine(adapters[names[0]], requests, clients)[0]
        mixed = run_engine(model, mixed_requests, clients, adapters=adapters)[0]
        ratio = mixed["tokens_per_s"] / single["tokens_per_s"]
        print(f"round {round_}: one adapter {single['tokens_per_s']:.0f} tokens/s, {len(names)} adapters mixed "
              f"{mixed['tokens_per_s']:.0f} tokens/s: {ratio:.2f}x", flush=True)  # fmt: skip
        same = [mixed["outputs"][i] == single["outputs"][i] for i in range(0, len(requests), len(names))]
        assert all(same), "adapter 0's requests got other tokens mixed than alone"
        rows += [(f"one LoRA adapter, {clients} clients (round {round_})", single["tokens_per_s"], single),
                 (f"{len(names)} adapters mixed, {clients} clients (round {round_})", mixed["tokens_per_s"], mixed)]  # fmt: skip
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=64, help="requests per engine run (default 64)")
    parser.add_argument("--baseline", type=int, default=8, help="requests timed one at a time (default 8; 0: skip)")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--adapters", type=int, default=4, help="adapters in the mixed run (default 4; 0: skip)")
    parser.add_argument("--adapter-clients", type=int, default=16, help="clients of the adapter runs (default 16)")
    parser.add_argument("--adapter-rounds", type=int, default=2, help="alternating rounds of the two (default 2)")
    parser.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                        help="time transformers one at a time too (default yes; slow on a loaded machine)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1,
                        help="engine runs per client count, each after timing zoo.generate again (default 1)")  # fmt: skip
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    hf, model = make_model(args)
    requests = workload(max(args.requests, args.baseline), args.vocab)
    base = requests[: args.baseline]
    rows, gen_rate, hf_rate, gen_outs, hf_outs = [], float("nan"), float("nan"), [], []
    if base:
        gen_rate, gen_outs = run_generate(model, base)
        print(f"zoo.generate one at a time: {gen_rate:.0f} tokens/s", flush=True)
        rows = [("zoo.generate, one at a time", gen_rate, None)]
        if args.transformers:
            hf_rate, hf_outs = run_transformers(hf, base)
            print(f"transformers one at a time: {hf_rate:.0f} tokens/s", flush=True)
            rows.append(("transformers generate, one at a time", hf_rate, None))
    same_hf = sum(a == b for a, b in zip(gen_outs, hf_outs))
    results = {"generate": gen_rate, "transformers": hf_rate, "engine": {}}
    for clients in args.clients:
        n = max(args.requests, 2 * clients)
        # With --rounds R > 1, zoo.generate is timed again before each round (the load drifts).
        before = (lambda: {"generate": run_generate(model, base)[0]}) if args.rounds > 1 and base else None
        rounds = run_engine(model, workload(n, args.vocab), clients, rounds=args.rounds, before=before)
        for k, result in enumerate(rounds):
            same = [result["outputs"][i] == gen_outs[i] for i in range(len(base))]
            assert all(same), f"engine tokens differ from zoo.generate's for requests {np.flatnonzero(~np.array(same))}"
            result["ratio"] = result["tokens_per_s"] / result.get("generate", gen_rate)
            print(f"engine, {clients} clients, round {k}: {result['tokens_per_s']:.0f} tokens/s, "
                  f"zoo.generate {result.get('generate', gen_rate):.0f}: {result['ratio']:.2f}x; "
                  f"decode kernels by rows {result['kernels']}", flush=True)  # fmt: skip
        result = sorted(rounds, key=lambda r: r["ratio"])[len(rounds) // 2]  # the median round
        ratios = [r["ratio"] for r in rounds]
        name = f"engine, {clients} clients"
        if len(rounds) > 1:
            name += f" (median of {len(rounds)} rounds: {result['ratio']:.2f}×, {min(ratios):.2f}-{max(ratios):.2f})"
        rows.append((name, result["tokens_per_s"], result))
        results["engine"][clients] = [{k: v for k, v in r.items() if k != "outputs"} for r in rounds]
    if args.adapters:
        pairs = run_adapters(model, args)
        rows += pairs
        single, mixed = sum(r for _, r, _ in pairs[0::2]), sum(r for _, r, _ in pairs[1::2])
        results["adapters"] = {"single": [r for _, r, _ in pairs[0::2]], "mixed": [r for _, r, _ in pairs[1::2]],
                               "ratio": mixed / single}  # fmt: skip
    same = f"transformers' tokens equal zoo.generate's for {same_hf}/{len(base)} requests"
    print(f"\nLlama d={args.d} layers={args.layers} vocab={args.vocab}, greedy, prompts 16-64, outputs 16-128 tokens, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, load {os.getloadavg()[0]:.1f}; "
          f"{same if args.transformers else 'transformers not run'}\n")  # fmt: skip
    print("| run | tokens/s | × zoo.generate | TTFT p50 / p99 (ms) | per-token p50 / p99 (ms) |")
    print("|---|---|---|---|---|")
    for name, rate, r in rows:
        lat = "" if r is None else f"{1e3 * r['ttft_p50']:.0f} / {1e3 * r['ttft_p99']:.0f}"
        tok = "" if r is None else f"{1e3 * r['token_p50']:.1f} / {1e3 * r['token_p99']:.1f}"
        # A round's own ratio: against zoo.generate timed just before it (--rounds).
        ratio = r["ratio"] if r is not None and "ratio" in r else rate / gen_rate
        print(f"| {name} | {rate:.0f} | {ratio:.2f}× | {lat} | {tok} |")
    if args.adapters:
        ratio = results["adapters"]["ratio"]
        print(f"\n{args.adapters} adapters mixed / one adapter alone, all rounds: {ratio:.2f}× (goal >= 0.8×)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
