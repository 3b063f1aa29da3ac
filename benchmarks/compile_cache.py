"""Compile time of a first and a second identical run with zoo's persistent compilation cache.

Two measurements, each run twice in fresh processes against one new, empty cache folder:

- **library**: `zoo.enable_compilation_cache(folder)`, then the all-MiniLM-L6-v2 LoRA step of
  `vs_torch.py` (r=8 on every linear layer, batch 32 × 48) compiled with `step.compile`;
  the seconds of that call are printed (the second run reads the program from the folder);
- **CLI**: the wall time of `python -m zoo inspect minilm --lora r=8,targets=all-linear`
  (the process end to end: imports, loading the weights, compiling, inspecting), with
  `ZOO_COMPILE_CACHE_DIR=folder`.

    python benchmarks/compile_cache.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

_LIBRARY = """
import sys, time
sys.path.insert(0, {here!r})
import jax, jax.numpy as jnp, zoo, vs_torch
hits = []
jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e.endswith("cache_hits") else None)
zoo.enable_compilation_cache(sys.argv[1])
model, step, batch = vs_torch.zoo_workload("minilm-lora")
batch = jax.tree.map(jnp.asarray, batch)
opt_state = step.init(model)
t = time.perf_counter()
step.compile(model, opt_state, batch)
print(f"{{time.perf_counter() - t:.2f}} {{len(hits)}}")
"""


def main() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ZOO_NO_COMPILE_CACHE"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "lib")
        for run in ("first", "second"):
            out = subprocess.run(
                [sys.executable, "-c", _LIBRARY.format(here=HERE), folder],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode:
                raise SystemExit(out.stderr)
            seconds, hits = out.stdout.split()[-2:]
            files = sum(len(f) for _, _, f in os.walk(folder))
            print(
                f"library, {run} run: MiniLM LoRA step.compile {seconds} s, cache hits {hits}, files in cache {files}",
                flush=True,
            )
        cli_env = env | {"ZOO_COMPILE_CACHE_DIR": os.path.join(tmp, "cli")}
        for run in ("first", "second"):
            t = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-m", "zoo", "inspect", "minilm", "--lora", "r=8,targets=all-linear"],
                env=cli_env,
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode:
                raise SystemExit(out.stderr)
            print(
                f"CLI, {run} run: zoo inspect minilm --lora r=8,targets=all-linear: {time.perf_counter() - t:.1f} s wall",
                flush=True,
            )
    with open("/proc/loadavg") as f:
        print("loadavg", " ".join(f.read().split()[:3]))


if __name__ == "__main__":
    main()
