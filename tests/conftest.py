"""Shared set-up: 8 simulated CPU devices, XLA flags, fixtures. Helpers live in helpers.py.

zoo is not imported at module level here, so jaxtyping's import hook
(`--jaxtyping-packages=zoo,...` in pyproject) instruments the package when tests import it.
"""

import os

import jax

# Must run before jax initialises its backend.
jax.config.update("jax_num_cpu_devices", 8)

# Tests compile many small programs and run each a few times: skip LLVM's machine-code
# optimisation (about half the compile time), and emit fusions with XLA's older CPU emitters
# (`--xla_cpu_use_fusion_emitters=false`: half the remaining compile time, measured side by
# side on four of the costliest files, 285 -> 135 compile seconds, with no slower running).
# XLA's HLO passes, which decide sharding and place every collective, run unchanged. Only
# this process: a subprocess gets them where a test asks (`helpers.short_run_env`: short
# CLI runs, the docs' blocks, the examples of tiny models); the demo and the MiniLM example
# keep optimised code (MiniLM's running dominates: twice the CPU unoptimised, measured in
# docs/testing.md session 28). A run that names the emitters itself (the kernel rerun,
# which keeps the default ones: another code path for the same comparisons) is left as it
# asks.
# On a loaded CI machine one simulated device can lag the others for long: XLA's CPU
# collectives abort the process after 40 s by default. 300 s tolerates a loaded machine,
# and a real deadlock still ends the process in 5 minutes, not an hour (kept for
# subprocesses too; pytest-timeout's limit in pyproject is the second net).
_xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_collective_call_terminate_timeout_seconds=300"
os.environ["XLA_FLAGS"] = f"{_xla_flags} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# LLVM's code generation in one part, not split into many compiled on a thread pool: on the
# suite's tiny programs the split costs more CPU than it overlaps (3 workers on 2 cores),
# measured side by side on tests/test_presets.py: 66 -> 60 CPU s (twice each). The same
# HLO passes (sharding, collectives): only how LLVM's module is cut for threads.
if "xla_cpu_parallel_codegen_split_count" not in _xla_flags:
    os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"
if "xla_cpu_use_fusion_emitters" not in _xla_flags:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
jax.devices()  # initialise the backend with these flags
# The CLI and examples turn on zoo's persistent compilation cache; tests never read or fill
# the user's. `make test` gives the CLI processes the tests start one fresh folder of their
# own instead (ZOO_TEST_COMPILE_CACHE, emptied first): a program compiled once (the same tiny
# step in a hundred CLI runs, a run and its resume) is loaded, not compiled again. Unset: the
# cache is off in subprocesses. The cache's own test turns it on with a temporary folder.
# The test processes themselves never use it, even where a test runs the CLI in process:
# their programs are compiled with other flags (above), so subprocesses never shared them,
# and keying and writing every program cost the fast tests about half their time.
if os.environ.get("ZOO_TEST_COMPILE_CACHE"):
    os.environ["ZOO_COMPILE_CACHE_DIR"] = os.environ["ZOO_TEST_COMPILE_CACHE"]
    os.environ.pop("ZOO_NO_COMPILE_CACHE", None)
else:
    os.environ["ZOO_NO_COMPILE_CACHE"] = "1"
jax.config.update("jax_enable_compilation_cache", False)  # this process only
# Each op's location in the lowered program: the line that made it, not the whole Python
# stack (jax's default keeps up to 100 frames; under pytest they run deep). The stacks are
# turned into MLIR locations when lowering and imported again by XLA's Shardy pass in every
# compile: measured side by side on tests/test_presets.py, 101 -> 77 CPU s. Same HLO
# otherwise. Tests that read a collective's call stack (`zoo inspect`'s "called from")
# turn it back on (the `full_tracebacks` fixture); CLI subprocesses keep jax's default, and
# so does a run that sets JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS itself.
if "JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS" not in os.environ:
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
# Likewise zoo.keep_freed_memory (the CLI's --keep-memory) is a no-op here: the test
# processes keep glibc's defaults; tests/test_host_memory.py checks it in subprocesses.
os.environ["ZOO_NO_KEEP_MEMORY"] = "1"
os.environ["XLA_FLAGS"] = _xla_flags
# Tests download nothing: a model id missing from the cache (or a path that does not exist,
# read as one) is refused offline instead of asking the Hub. tests/test_hub.py turns it off
# against its local server.
os.environ["HF_HUB_OFFLINE"] = "1"

import gc
import sys

import pytest


def pytest_configure(config):
    # ZOO_TEST_TIMELINE=FOLDER: record what each test costs (tests/tools/timeline.py).
    if os.environ.get("ZOO_TEST_TIMELINE"):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tools"))
        import timeline

        timeline.register(config)


@pytest.fixture
def key():
    return jax.random.key(0)


@pytest.fixture
def full_tracebacks():
    """jax's default: every op's location holds its Python call stack (conftest keeps only
    its line), for tests that read where a collective was called from."""
    jax.config.update("jax_include_full_tracebacks_in_locations", True)
    yield
    jax.config.update("jax_include_full_tracebacks_in_locations", False)


# Every program XLA compiles for the CPU holds a few memory mappings (code, constants, data)
# until it is freed, and jax's caches keep every program alive. One pytest worker compiles
# tens of thousands over the suite: past Linux's limit of 65,530 mappings a process
# (vm.max_map_count) the next compile or serialisation aborts or segfaults the worker,
# and pytest-xdist then hangs waiting for it. So a test file's own `functools.cache`s are
# let go when the file ends (its models and the programs only it calls), and jax's caches
# too once the process holds FREE_AT_FILE_END mappings or FREE_AT_RSS bytes of memory (a
# small CI machine runs three fast-phase workers: ~11 GiB at the peak of 24), or MAX_MAPPINGS between any two tests. Below those, jax's caches are kept across files: the programs later files share
# with earlier ones (eager ops on the same shapes, zoo's own jitted functions) are not
# compiled again (every file's end used to free them all).
MAX_MAPPINGS = 40_000
FREE_AT_FILE_END = 20_000
FREE_AT_RSS = 4 * 2**30  # a worker holds ~2-3 GiB today with the caches freed at every file end


def _mappings() -> int:
    """How many memory mappings this process holds (0 where there is no /proc)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def _resident_bytes() -> int:
    """This process's resident memory (0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _free_module_caches(module) -> None:
    """Clear `module`'s own `functools.cache`s (not those it imports from helpers.py, which
    later files reuse)."""
    for value in vars(module).values():
        if getattr(value, "__module__", None) == module.__name__ and callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def _free_compiled_programs() -> None:
    """Clear jax's caches and zoo's programs shared between `Jit`s (every compiled program
    they hold)."""
    from zoo._jit import clear_programs

    clear_programs()
    jax.clear_caches()
    gc.unfreeze()  # what was frozen and is garbage now (dropped programs' cycles) goes too
    gc.collect()


# Python's cyclic garbage collector: a full collection walks every object the process holds
# (jax's and XLA's caches, modules: ~500,000 objects after a few files), and tracing makes
# enough objects to start one every few seconds: 10% of a test process's CPU went there
# (a CPU profile of tests/test_budget.py; gc callbacks: 6.0 of 72 CPU s in full collections
# over three files). What outlives a file is frozen after its collection (gc.freeze: full
# collections no longer walk it; unfrozen before the caches are freed, so nothing leaks),
# and the youngest generation is collected every 20,000 allocations instead of 700. The
# package's code is unchanged; tracing makes the same programs.
def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


@pytest.fixture(scope="module")
def torch_one_thread():
    """torch on one thread while a file's tests run (restored after): for files whose torch
    references are tiny models, far below what a second thread pays for; on the suite's
    shared cores the waiting thread spins (test_expert_lora.py's peft tests: ~10% of their
    CPU). One thread is one more summation order, which the float tolerances allow (the
    numerics rerun is single-threaded: Makefile's test-numerics). A file opts in:
    `pytestmark = pytest.mark.usefixtures("torch_one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def _programs_freed_after_each_file(request):
    yield
    _free_module_caches(request.module)
    if _mappings() > FREE_AT_FILE_END or _resident_bytes() > FREE_AT_RSS:
        _free_compiled_programs()
    else:
        gc.collect()
    gc.freeze()


# A test that counts what XLA compiles (a program compiled once, nothing compiled again)
# starts from empty caches, as in a fresh process: what an earlier file compiled would
# otherwise be a cache hit, and the count depend on which files its worker ran before.
_COUNTS_COMPILES = {"backend_compiles", "register_event_duration_secs_listener", "compile_or_get_cached"}


def _counts_compiles(item) -> bool:
    code = getattr(getattr(item, "function", None), "__code__", None)
    return code is not None and bool(_COUNTS_COMPILES & set(code.co_names))


def pytest_runtest_setup(item):
    if _counts_compiles(item):
        _free_compiled_programs()


# Reading /proc/self/maps costs time in proportion to the mappings (~1% of a worker's CPU
# read after every test): read it only once CHECK_EVERY_COMPILES programs were compiled since
# the last read. A program holds a few mappings (~4: code, constants, data), so the 25,000
# between MAX_MAPPINGS and Linux's limit hold several thousand compiles.
CHECK_EVERY_COMPILES = 200
_compiles_since_check = [0]
from helpers import BACKEND_COMPILE  # noqa: E402  (helpers imports no zoo: the import hook still sees it first)


def _count_compile(event: str, duration: float, **_) -> None:
    if event == BACKEND_COMPILE:
        _compiles_since_check[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def pytest_runtest_teardown(item, nextitem):
    if _compiles_since_check[0] >= CHECK_EVERY_COMPILES:
        _compiles_since_check[0] = 0
        if _mappings() > MAX_MAPPINGS:
            _free_compiled_programs()


def _timeout(item) -> float:
    """The test's own pytest-timeout limit (its `timeout` mark), 0 for the default one."""
    mark = item.get_closest_marker("timeout")
    if mark is None:
        return 0.0
    return float(mark.kwargs.get("timeout", mark.args[0] if mark.args else 0.0))


def pytest_collection_modifyitems(config, items):
    """Long tests first, so that the workers of each `make test` phase end together: a test given a
    limit above the default (its `timeout` mark) is a long one; the longest limits first.

    Under `--dist load` (the slow phase: one test at a time to a worker) test by test; else
    file by file (a file's limit is its largest), its tests in their order: `--dist
    loadfile` hands whole files out in that order, and a file's module fixtures may start
    work its later tests use (test_checkpoints.py's first run).

    Within a file, the tests that count compiles come first (in their order): each empties
    jax's caches as it starts (`pytest_runtest_setup`), which in the middle of a file threw
    away what the file's earlier tests compiled for its later ones (test_serve.py's
    warm_up test: 41 programs compiled again after it, 5.7 compile seconds)."""
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (first[item.path], not _counts_compiles(item)))  # stable
    dist = config.getoption("dist", "no") if config.pluginmanager.hasplugin("xdist") else "no"
    if dist == "load":
        items.sort(key=lambda item: -_timeout(item))  # stable: equal limits keep their order
        return
    limits = {}
    for item in items:
        limits[item.path] = max(limits.get(item.path, 0.0), _timeout(item))
    items.sort(key=lambda item: -limits[item.path])


# --- the tiny folders and finished runs the CLI tests share (tests/tiny_runs.py) --------------
# Session-scoped: made once per test process (each xdist worker) and read by every file that
# asks, instead of once per file: a finished run costs a training run's compiles. Tests only
# read them; a test that changes one copies it first.


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """A tiny random Llama saved by transformers, a word-level tokenizer and a chat template."""
    from tiny_runs import make_llama_dir

    return make_llama_dir(tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="session")
def data_files(tmp_path_factory):
    """The CLI tests' tiny data files by kind (tiny_runs.make_data_files)."""
    from tiny_runs import make_data_files

    return make_data_files(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory, llama_dir, data_files):
    """A finished chat SFT run: LoRA on the tiny Llama (tiny_runs.train_chat_run)."""
    from tiny_runs import train_chat_run

    return train_chat_run(tmp_path_factory.mktemp("runs") / "chat", llama_dir, data_files)


@pytest.fixture(scope="session")
def classifier_run(tmp_path_factory, data_files):
    """A finished classifier run: a tiny BERT from scratch on string labels."""
    from tiny_runs import train_classifier_run

    return train_classifier_run(tmp_path_factory.mktemp("runs") / "cls", data_files)


@pytest.fixture(scope="session")
def lora_classifier_run(tmp_path_factory, classifier_run, data_files):
    """A finished LoRA fine-tune of classifier_run's encoder, its head trained in full."""
    from tiny_runs import train_lora_classifier_run

    return train_lora_classifier_run(tmp_path_factory.mktemp("runs") / "cls-lora", classifier_run, data_files)


@pytest.fixture(scope="session")
def finished_mlp_run(tmp_path_factory):
    """A finished 4-step mlp run (checkpoints 2 and 4; lr, seed, model config not the
    defaults) that resume tests copy (tiny_runs.train_finished_mlp_run)."""
    from tiny_runs import train_finished_mlp_run

    return train_finished_mlp_run(tmp_path_factory.mktemp("run4") / "run")
