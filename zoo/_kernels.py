"""Which CPU matmul kernels the inference programs are compiled with.

XLA's CPU backend runs matmuls through YNNPACK by default. For the few rows of a decode
step (one token per request) Eigen's matmuls are faster on the 2-core AVX2 machines this
project measures on: the engine's decode step at 16 slots 1.24-1.50× faster, `zoo.generate`
at batch 8 1.21-1.65× and at batch 32 1.21-1.47×, batch 1 unchanged (interleaved A/B in
one process, docs/performance.md "CPU matmul kernels for decoding"). For a prompt of 64
tokens and more YNNPACK was faster (the engine's prefill of 64, 96 and 128 tokens 1.16×,
1.13× and 1.16× slower with Eigen's; of 32 and 48 tokens 1.31× and 1.15× faster), so the
engine prefills long prompts with XLA's default. Training steps keep the default: the
LoRA step was 1.04× slower with Eigen's matmuls (docs/performance.md).

Which kernels win depends on the CPU: on a 2-core AVX-512 machine XLA's default was the
faster one for the engine's decode step at 8 and 16 rows (1.14×; 16 clients served 1.10×
faster); at 1 to 4 rows neither won every time. So the engine does not guess for its
decode step: `Engine.warm_up` times both (`matmul_kernels`) at each row count on the
machine it runs on and keeps the faster (`zoo.serve.Engine.kernels`).

The choice is a per-program compile option (`jax.jit(..., compiler_options=...)`), so it
touches no other program of the process; a user who names the kernels in `XLA_FLAGS`
(`--xla_cpu_experimental_ynn_fusion_type=...`) keeps theirs. The option is a CPU one: other
backends ignore it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

_YNN = "xla_cpu_experimental_ynn_fusion_type"

# A prefill of more rows (requests × prompt width) than this keeps XLA's default kernels.
EIGEN_PREFILL_ROWS = 48


# The kernels' names (`matmul_kernels`): Eigen's, and XLA's default (YNNPACK on CPU).
EIGEN, XLA_DEFAULT = "eigen", "xla"

# Timed calls of each kernel when `fastest_kernel` chooses.
TUNING_CALLS = 5


def eigen_matmuls() -> dict[str, Any] | None:
    """The compile options that give a program Eigen's CPU matmuls (YNNPACK's fusions off),
    or None when `XLA_FLAGS` already chooses (the user's choice stands)."""
    if _YNN in os.environ.get("XLA_FLAGS", ""):
        return None
    return {_YNN: ""}


def matmul_kernels(platform: str) -> dict[str, dict[str, Any] | None]:
    """The matmul kernels a program can be compiled with on `platform`, by name, as their
    compile options: `EIGEN` and `XLA_DEFAULT` on a CPU, XLA's default alone elsewhere or
    when `XLA_FLAGS` already chooses (then there is nothing to choose between)."""
    eigen = eigen_matmuls()
    if platform != "cpu" or eigen is None:
        return {XLA_DEFAULT: None}
    return {EIGEN: eigen, XLA_DEFAULT: None}


def fastest_kernel(call: Callable[[str], Any], kernels) -> str:
    """The one of `kernels` (names) that `call(kernel)` (queuing a program compiled with it)
    runs fastest here: each called once (compiled), then timed `TUNING_CALLS` times,
    interleaved (a shared machine's load drifts), and compared by their medians."""
    seconds: dict[str, list[float]] = {kernel: [] for kernel in kernels}
    for kernel in seconds:
        jax.block_until_ready(call(kernel))
    for _ in range(TUNING_CALLS):
        for kernel, times in seconds.items():
            start = time.perf_counter()
            jax.block_until_ready(call(kernel))
            times.append(time.perf_counter() - start)
    return min(seconds, key=lambda kernel: float(np.median(seconds[kernel])))
