"""Compile time of a 24-layer decoder whose layers differ (a per-layer pattern) vs a uniform one.

The per-layer pattern (`TransformerConfig.sliding_layers`, `rope_layers`, `rope_thetas`)
is data the layer scan reads, so the patterned model's program holds one layer body, as the
uniform one's does. Both models: 24 layers, d_model 256, 8 heads (4 key/value heads), RoPE,
SwiGLU, RMSNorm. The pattern: Gemma 3's five sliding layers (window 128) to one global,
every fourth layer without RoPE (SmolLM3's), and two RoPE bases (10k on sliding layers, 1M
on global ones). Timed: `jax.jit(...).lower(...).compile()` of the training step (loss and
gradients) and of the forward pass on a `[4, 256]` batch, each in a fresh process (no
in-process or persistent cache), the median of `--repeats` runs, the two models' runs
interleaved.

    python benchmarks/pattern_compile.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_RUN = """
import sys, time
import jax, jax.numpy as jnp, equinox as eqx
import zoo
from zoo.models import Transformer, TransformerConfig

LAYERS = 24
patterned = sys.argv[1] == "patterned"
sliding = tuple(i % 6 != 5 for i in range(LAYERS))
extra = dict(
    sliding_window=128,
    sliding_layers=sliding,
    rope_layers=tuple(i % 4 != 3 for i in range(LAYERS)),
    rope_thetas=tuple(1e4 if s else 1e6 for s in sliding),
) if patterned else {}
config = TransformerConfig(
    vocab_size=1024, d_model=256, num_heads=8, num_kv_heads=4, num_layers=LAYERS, mlp_dim=512, max_len=256,
    positions="rope", activation="swiglu", norm="rmsnorm", use_bias=False, **extra,
)
model = Transformer(config, key=jax.random.key(0))
tokens = jnp.ones((4, 256), jnp.int32)
def loss(m, t):
    sums, counts = zoo.models.next_token_loss(m, {"tokens": t, "mask": t > 0})
    return sums.sum() / counts.sum()
grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
forward = eqx.filter_jit(lambda m, t: m(t))
times = []
for fn in (grad, forward):
    t = time.perf_counter()
    fn.lower(model, tokens).compile()
    times.append(time.perf_counter() - t)
print(*times)
"""


def _time(kind: str) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", _RUN, kind], capture_output=True, text=True, check=True)
    step, forward = (float(x) for x in out.stdout.split())
    return step, forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = {"uniform": [], "patterned": []}
    for _ in range(args.repeats):  # interleaved: a shared machine's load falls on both alike
        for kind in runs:
            runs[kind].append(_time(kind))
    results = {}
    for kind, times in runs.items():
        results[kind] = tuple(statistics.median(r[i] for r in times) for i in range(2))
        print(f"{kind:9s}: step {results[kind][0]:.2f} s, forward {results[kind][1]:.2f} s (median of {args.repeats})")
    (us, uf), (ps, pf) = results["uniform"], results["patterned"]
    print(f"patterned / uniform: step {ps / us:.2f}x, forward {pf / uf:.2f}x")


if __name__ == "__main__":
    main()
