# gradwatch developer commands. Everything a fresh clone needs is set up by these targets.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# DeepSpeed (test dependency: the ZeRO tests) ships an sdist whose build imports torch; built
# without isolation against the pinned torch above (an isolated build would fetch an unpinned,
# possibly CUDA, torch), with no compiled op (DS_BUILD_OPS=0: the tests use torch's Adam).
DEEPSPEED_SPEC ?= deepspeed==0.19.8
# Where torch comes from: empty = pip's configured index (which decides CPU or CUDA build); e.g.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU build, .../whl/cu126 for CUDA 12.6.
TORCH_INDEX ?=
BIN := $(VENV)/bin
LINT_PATHS := $(wildcard src tests benchmarks scripts examples)
STAMP := $(VENV)/.installed

.PHONY: help venv demo test test-fast lint bench deploy-assets system-deps clean

help:
	@echo "make demo   - run the gradwatch demo (torchrun, 2 ranks, live table, endpoint)"
	@echo "make test   - install everything and run all tests (unit, distributed, e2e)"
	@echo "make bench  - run the benchmarks and regenerate docs/performance.md"
	@echo "make lint   - ruff"

# The pinned torch goes in first, so the package's own `torch>=2.6` is already satisfied and pulls
# nothing more; DeepSpeed next, built against it, so the test extra's pin is already satisfied.
# The first run downloads a few hundred MB: each step says what it does, and pip shows its
# progress (what it collects, a bar per download).
$(STAMP): pyproject.toml
	@echo "gradwatch: [1/5] creating $(VENV) (first run only; the next steps download ~1 GB at most)"
	$(PYTHON) -m venv $(VENV)
	@echo "gradwatch: [2/5] upgrading pip"
	$(BIN)/pip install -q --upgrade pip
	@echo "gradwatch: [3/5] installing $(TORCH_SPEC) (the largest download)"
	$(BIN)/pip install --progress-bar on $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	@echo "gradwatch: [4/5] building $(DEEPSPEED_SPEC) against it (test dependency, no compiled op)"
	DS_BUILD_OPS=0 $(BIN)/pip install --progress-bar on --no-build-isolation setuptools wheel "$(DEEPSPEED_SPEC)" "$(TORCH_SPEC)"
	@echo "gradwatch: [5/5] installing gradwatch and its extras (editable)"
	$(BIN)/pip install --progress-bar on -e ".[test,cli,plot,transformers,lightning,auth,tensorboard,wandb,mlflow]"
	touch $(STAMP)
	@echo "gradwatch: $(VENV) is ready"

venv: $(STAMP)

# Prometheus server and promtool (Debian package), used by e2e tests; needs root when missing.
system-deps:
	@bash scripts/install-system-deps.sh

demo: venv
	$(BIN)/gradwatch demo

test: venv system-deps
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: venv
	$(BIN)/python -m pytest -q -x -m "not e2e and not distributed"

lint: venv
	$(BIN)/ruff check $(LINT_PATHS)

bench: venv
	$(BIN)/python benchmarks/run.py --out docs/performance.md

deploy-assets: venv
	$(BIN)/python scripts/gen_mixin.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
