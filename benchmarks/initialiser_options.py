"""Compile + run time of a decoder's initialiser with zoo's options for programs run once
(`zoo._jit.ONCE_COMPILER_OPTIONS`: LLVM's optimisation off) vs XLA's defaults, by model
size: the measurements behind `zoo._jit.ONCE_OPTIMISED_FROM_BYTES`, the size from which
`once_compiler_options` takes XLA's defaults.

Each (size, options) in a fresh process (no in-process or persistent cache), the two
options interleaved, the median of `--repeats` runs; the ratio is once / default (below 1:
zoo's fast-compile options win).

    python benchmarks/initialiser_options.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_RUN = """
import sys, time
import jax, equinox as eqx
import zoo
from zoo._jit import ONCE_COMPILER_OPTIONS

d, layers, mlp, vocab = map(int, sys.argv[1:5])
options = dict(ONCE_COMPILER_OPTIONS) if sys.argv[5] == "once" else {}
config = zoo.models.TransformerConfig(
    vocab_size=vocab, d_model=d, num_heads=4, num_layers=layers, mlp_dim=mlp, max_len=256
)
lowered = jax.jit(lambda k: eqx.filter(zoo.models.Transformer(config, key=k), eqx.is_array)).lower(jax.random.key(0))
start = time.perf_counter()
jax.block_until_ready(lowered.compile(compiler_options=options)(jax.random.key(0)))
made = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(lowered.out_info))
print(made, time.perf_counter() - start)
"""

SIZES = [  # d_model, layers, mlp_dim, vocabulary
    (64, 2, 256, 1000),
    (256, 4, 1024, 8000),
    (512, 4, 2048, 32000),
    (1024, 8, 4096, 32000),
]


def _time(size: tuple[int, ...], options: str) -> tuple[int, float]:
    out = subprocess.run(
        [sys.executable, "-c", _RUN, *map(str, size), options], check=True, capture_output=True, text=True
    ).stdout.split()
    return int(out[0]), float(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from zoo._jit import ONCE_OPTIMISED_FROM_BYTES

    print(f"threshold: {ONCE_OPTIMISED_FROM_BYTES / 2**20:.0f} MiB")
    print(f"{'outputs':>10}  {'once s':>7}  {'default s':>9}  {'once/default':>12}")
    for size in SIZES:
        once, default = [], []
        for _ in range(args.repeats):
            made, seconds = _time(size, "once")
            once.append(seconds)
            default.append(_time(size, "default")[1])
        a, b = statistics.median(once), statistics.median(default)
        print(f"{made / 2**20:8.1f} MiB  {a:7.2f}  {b:9.2f}  {a / b:12.2f}")


if __name__ == "__main__":
    main()
