"""The two token dispatches of `zoo.nn.Experts` at 8 experts top-2: time and memory.

`"dense"` runs every expert on every token and weights the outputs by the router's sparse
weights (einsums over the batch); `"sorted"` sorts the token-expert pairs by expert and runs
grouped matmuls (`jax.lax.ragged_dot`), then scatters back. Both are compiled on one device
(the default backend) for the layer's forward pass and for its gradient (parameters and
input); printed per dispatch and pass: the median time over interleaved rounds and the
compiled program's peak temporaries (`memory_analysis().temp_size_in_bytes`), then their
largest output difference.

    python benchmarks/moe_dispatch.py [--tokens 2048] [--dim 512] [--hidden 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import zoo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per call (batch 4 x this / 4)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024, help="each expert's hidden width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    x = jax.random.normal(jax.random.key(1), (4, args.tokens // 4, args.dim))
    layers, programs = {}, {}
    for dispatch in ("dense", "sorted"):
        layer = zoo.nn.Experts(
            args.dim, args.hidden, args.experts, args.top_k, dispatch=dispatch, key=jax.random.key(0)
        )
        params, static = eqx.partition(layer, eqx.is_array)
        layers[dispatch] = params

        def run(p, x, static=static):
            return eqx.combine(p, static)(x)

        backward = jax.grad(lambda p, x, run=run: jnp.sum(run(p, x) ** 2), argnums=(0, 1))
        for name, f in (("forward", run), ("forward+backward", backward)):
            compiled = jax.jit(f).lower(params, x).compile()
            memory = compiled.memory_analysis()
            programs[dispatch, name] = (compiled, memory.temp_size_in_bytes if memory is not None else float("nan"))
    times = {key: [] for key in programs}
    for _ in range(args.rounds):  # interleaved: a busy machine slows both alike
        for (dispatch, name), (f, _) in programs.items():
            jax.block_until_ready(f(layers[dispatch], x))  # compiled on first call; warm
            start = time.perf_counter()
            jax.block_until_ready(f(layers[dispatch], x))
            times[dispatch, name].append(time.perf_counter() - start)
    print(
        f"zoo.nn.Experts, {args.experts} experts top-{args.top_k}, {args.tokens} tokens x {args.dim}, "
        f"experts {args.hidden} wide, {jax.devices()[0].device_kind}, median of {args.rounds} rounds"
    )
    print(f"{'dispatch':8} {'pass':17} {'time ms':>9} {'peak temp MiB':>14}")
    for (dispatch, name), (_, temp) in programs.items():
        ms = 1e3 * statistics.median(times[dispatch, name])
        print(f"{dispatch:8} {name:17} {ms:9.1f} {temp / 2**20:14.1f}")
    dense, grouped = (programs[d, "forward"][0](layers[d], x) for d in ("dense", "sorted"))
    diff = jnp.max(jnp.abs(dense - grouped))
    print(f"max |dense - sorted| output difference: {float(diff):.2e}")


if __name__ == "__main__":
    main()
