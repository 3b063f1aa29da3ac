"""Peak host memory of loading a Hugging Face checkpoint with a quantised base.

A Llama-shaped decoder of ~0.35B parameters (random weights saved by transformers in
float32) is loaded four ways, each in its own process:

- `float32`: `zoo.hf.from_pretrained(path)`;
- `float32, then nf4`: the float model loaded, then every projection of its layer stack
  quantised (`zoo.nn.FourBitLinear.quantize`): what a user without `quantize=` does;
- `nf4` and `int8`: `zoo.hf.from_pretrained(path, quantize=...)`, which quantises each
  stacked projection as soon as it is read (issue 46).

Printed per way: the peak of the process's anonymous resident memory over its level
before loading (sampled every 5 ms from /proc/self/status `RssAnon`: the memory-mapped
checkpoint's pages are file-backed and not counted, they are the page cache's), the
loaded model's parameter bytes, and each peak's ratio to the float32 load's.

    python benchmarks/quantized_load.py [--layers 24]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _harness

WAYS = ("float32", "float32, then nf4", "nf4", "int8")


def _anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status (this benchmark reads Linux's)")


def worker(path: str, way: str) -> None:
    """Load `path` one `way`; print {"peak_mib", "params_mib"} as one JSON line."""
    import equinox as eqx
    import jax

    import zoo

    base, peak, done = _anon_kib(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anon_kib())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if way in ("nf4", "int8"):
        model = zoo.hf.from_pretrained(path, quantize=way)
    else:
        model = zoo.hf.from_pretrained(path)
        if way == "float32, then nf4":
            kinds = (zoo.nn.Linear,)

            def quantize(m):
                return zoo.nn.FourBitLinear.quantize(m, "nf4") if isinstance(m, kinds) and m.weight.ndim == 3 else m

            model = jax.tree.map(quantize, model, is_leaf=lambda x: isinstance(x, kinds))
    jax.block_until_ready(eqx.filter(model, eqx.is_array))
    done.set()
    sampler.join()
    params = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(json.dumps({"peak_mib": (max(peak[0], _anon_kib()) - base) / 1024, "params_mib": params / 2**20}))


def save_model(folder: Path, layers: int) -> float:
    """A ~0.35B (24 layers) Llama-shaped model with random weights, saved by transformers;
    returns its parameter count in billions."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters()) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24, help="decoder layers (24: ~0.35B parameters)")
    p.add_argument("--worker", nargs=2, metavar=("PATH", "WAY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        billions = save_model(Path(tmp), args.layers)
        results = {}
        for way in WAYS:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", tmp, way], check=True, capture_output=True, text=True
            ).stdout
            results[way] = json.loads(out.strip().splitlines()[-1])
    full = results["float32"]["peak_mib"]
    rows = [
        [way, f"{r['peak_mib']:,.0f}", f"{r['peak_mib'] / full:.2f}", f"{r['params_mib']:,.0f}"]
        for way, r in results.items()
    ]
    print(f"Loading a Llama-shaped decoder of {billions:.2f}B parameters (float32 safetensors), one process each:")
    print("\n".join(_harness.table(["load", "peak MiB", "vs float32", "params MiB"], rows, left=1)))


if __name__ == "__main__":
    main()
