"""zoo.keep_freed_memory: XLA's per-call CPU buffers reuse the process's pages."""

import os
import subprocess
import sys
import textwrap

from helpers import zoo_ok

import zoo

# A gradient whose temporaries are one 32 MiB block (the hidden activations of a [4096, 128]
# batch through a 1024-wide layer, and their derivative): above the size from which glibc
# serves blocks with mmap, so by default every call maps and faults the block in afresh.
# Prints what keep_freed_memory returned, the temp pages, the faults per call (median of
# windows) and warnings.
_SCRIPT = textwrap.dedent(
    """
    import resource, sys, warnings
    import jax, jax.numpy as jnp
    import zoo
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = zoo.keep_freed_memory() if sys.argv[1] != "default" else None
    x, w1, w2 = jnp.ones((4096, 128)), jnp.full((128, 1024), 0.01), jnp.full((1024, 8), 0.01)
    grad = jax.grad(lambda w1, w2, x: jnp.sum(jnp.tanh(x @ w1) @ w2), argnums=(0, 1))
    compiled = jax.jit(grad).lower(w1, w2, x).compile()
    pages = compiled.memory_analysis().temp_size_in_bytes // 4096
    for _ in range(20):  # the first calls grow the heap to the peak the calls need
        jax.block_until_ready(compiled(w1, w2, x))
    # The median over 7 windows of 5 calls: now and then the threads' interleaving needs a
    # higher peak and the heap grows once more (faults in one window, ~1 run in 6), which
    # says nothing about the steady state measured here.
    windows = []
    for _ in range(7):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            jax.block_until_ready(compiled(w1, w2, x))
        windows.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
    faults = sorted(windows)[len(windows) // 2]
    print(kept, pages, faults, len(caught))
    """
)


def _run(mode, **env):
    base = {k: v for k, v in os.environ.items() if k != "ZOO_NO_KEEP_MEMORY"}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], env=base | env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    kept, pages, faults, warned = out.stdout.split()
    return kept, int(pages), float(faults), int(warned)


def test_keep_freed_memory_stops_the_per_call_page_faults():
    kept, pages, faults, warned = _run("keep")
    assert pages >= 8192  # the 32 MiB block
    assert kept == "True" and faults < 0.2 * pages and warned == 0
    # Without it (glibc's defaults) every call faults the block in again.
    _, _, faults_default, _ = _run("default")
    assert faults_default > 0.5 * pages


def test_keep_freed_memory_after_the_backend_started_says_false_and_warns(monkeypatch):
    """Called after jax's backend started (this process's has): False and a warning (the
    settings may miss XLA's threads). glibc's `mallopt` is a recorder here: the settings
    are process-wide and would stay for the rest of the test run."""
    import warnings

    import zoo._host_memory as host_memory

    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.delenv("ZOO_NO_KEEP_MEMORY")
    monkeypatch.setattr(host_memory, "_glibc", Libc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = zoo.keep_freed_memory()
    assert kept is False and len(caught) == 1 and "after jax started its backend" in str(caught[0].message)
    assert calls == list(host_memory._SETTINGS)  # applied all the same


def test_the_opt_out_leaves_malloc_alone():
    # conftest sets ZOO_NO_KEEP_MEMORY=1 for the test processes: nothing is changed here.
    assert os.environ["ZOO_NO_KEEP_MEMORY"] == "1" and zoo.keep_freed_memory() is False


def test_the_cli_keeps_freed_memory_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(zoo, "keep_freed_memory", lambda: calls.append(1) or True)
    zoo_ok("info", "mlp")
    assert calls == []  # opt-in: it slows multi-device CPU runs and compiling
    zoo_ok("info", "mlp", "--keep-memory")
    zoo_ok("--keep-memory", "info", "mlp")
    assert calls == [1, 1]
