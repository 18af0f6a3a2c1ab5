# The two commands a fresh machine needs: `make demo` and `make test`. Each creates .venv when
# missing and installs what it needs, with the exact pins of constraints.txt.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# pip's notes about the machine's local wheel folders are noise, not problems.
QUIET_PIP := grep -v "is ignored: it is neither a file nor a directory" || true

.PHONY: install demo test lint format bench bench-data bench-predict clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,notebook]' 2>&1 | $(QUIET_PIP)
	$(BIN)/python -c "import dask_cuda, distributed, torch, torchvision; print('installed torch', torch.__version__, '/ distributed', distributed.__version__, '/ dask-cuda', dask_cuda.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dask-train run workflows/configs/digits_ddp.toml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/pytest

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.ddp_vs_torchrun

bench-data: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.preprocessing

bench-predict: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.inference

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
