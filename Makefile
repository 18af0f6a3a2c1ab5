# The two commands a fresh machine needs: `make demo` and `make test`. Each creates .venv when
# missing and installs what it needs, with the exact pins of constraints.txt. Every installed
# module is compiled to bytecode: these machines set PYTHONDONTWRITEBYTECODE=1, so nothing would
# ever be compiled after (measured: the suite ran about twice as long, every process compiling
# torch from source). compileall does it on every core, leaving out the packages' own test
# suites, which nothing here imports; pip compiled on one core, all of it (measured on 2 cores:
# 50 s for pip's way, 25 s for this). pip itself comes first, at
# constraints.txt's version: the venv's pip 23.2 spends ~50 s resolving these requirements,
# 26.3 ~17 s (measured: the install took 156 s, now 125 s).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# pip's notes about the machine's local wheel folders are noise, not problems.
QUIET_PIP := grep -v "is ignored: it is neither a file nor a directory" || true

.PHONY: install demo test test-slow test-large test-python docs lint format browser screenshot bench bench-data bench-pipeline bench-predict bench-launch bench-queue bench-workers bench-elastic bench-scale bench-collections bench-store bench-sweep bench-fsdp bench-strategies bench-checkpoint bench-gpt gpu-check test-shuffled clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt pip 2>&1 | $(QUIET_PIP)
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e '.[test,notebook,mlflow,timm,sweep,docs]' 2>&1 | $(QUIET_PIP)
	$(BIN)/python -m compileall -q -j 0 -x '/(tests?|testing/_internal)/' "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
	$(BIN)/python -c "import dask_cuda, distributed, torch, torchvision; print('installed torch', torch.__version__, '/ distributed', distributed.__version__, '/ dask-cuda', dask_cuda.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dask-train run workflows/configs/digits_ddp.toml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The Training page's browser test needs Debian's chromium; where apt cannot install it
# (not root, no network), that one test is skipped with the reason.
browser:
	@command -v chromium >/dev/null || { apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || echo "chromium not installed: the Training page browser test will be skipped"; }

# The documentation site, into site/ (ignored). --strict: a broken link, a missing reference or a
# docstring that does not parse fails the build. The configuration page is generated from the
# pydantic models, the API reference from docstrings, the CLI page from click.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Other CPUs' kernel paths (ATen's plain C, AVX2, AVX-512 crossed with oneDNN's SSE4.1, AVX2
# and native) run inside the suite: tests/test_kernel_paths.py starts workers on each. The
# slowest tests are listed at the end: the suite has a time budget of 12 minutes on a 2-core
# machine (docs/development.md). The tests marked slow (each 10-40 s: the notebook, the
# README's examples run as pasted, stock and namespace clusters, Ctrl-C of real commands) are
# left to make test-slow, which CI runs after it.
test: lint browser docs
	$(BIN)/pytest -m "not slow" --durations=25

# The slow tests (-m slow): whole commands and examples run as a user runs them; CI runs them
# after make test.
test-slow: $(STAMP)
	$(BIN)/pytest -m slow --durations=15

# The tests too large for the suite (-m large): a model larger than a worker, trained split
# on workers whose nanny kills them past their limit; 6-8 minutes and ~18 GB of host memory.
test-large: $(STAMP)
	$(BIN)/pytest -m large --durations=5

# The suite's subset on another Python: `make test-python PY=3.13.0` (a pyenv version; or
# PY_INTERPRETER=/path/to/python3.13). It installs as a user does, `pip install -e
# '.[$(PY_EXTRAS)]'` (test and sweep unless given), under constraints.txt's pins (the top of each
# range in pyproject.toml), into a venv of its own: .venv-<PY>-<extras>, ignored. FLOORS=1
# installs the bottom of each range instead (constraints-floors.txt, which
# tests/test_dependencies.py holds to pyproject.toml), with the extras whose floors the added
# tests run (FLOORS_SUBSET), into .venv-<PY>-<extras>-floors. The subset has a module of each
# kind: the compat modules' checks, equivalence against one process, elastic jobs, object
# storage, the CLI, CIFAR-10's batches.
PY ?= 3.12.1
PYENV_ROOT ?= $(HOME)/.pyenv
PY_INTERPRETER ?= $(or $(wildcard $(PYENV_ROOT)/versions/$(PY)/bin/python),python$(basename $(PY)))
FLOORS ?=
PY_EXTRAS ?= $(if $(FLOORS),test$(COMMA)sweep$(COMMA)mlflow$(COMMA)timm,test$(COMMA)sweep)
COMMA := ,
PY_VENV ?= .venv-$(PY)-$(subst $(COMMA),-,$(PY_EXTRAS))$(if $(FLOORS),-floors)
PY_CONSTRAINTS := $(if $(FLOORS),constraints-floors.txt,constraints.txt)
PYTHON_SUBSET := tests/test_compat.py tests/test_ddp.py tests/test_elastic.py \
	tests/test_object_storage.py tests/test_cli.py tests/test_cifar_batches.py
# What the floors of pandas and pyarrow (predictions as Parquet), MLflow, TensorBoard and timm
# are run with, beside the subset.
FLOORS_SUBSET := tests/test_dependencies.py tests/test_cli_predict.py tests/test_tracking.py \
	tests/test_models.py::test_a_timm_model_under_ddp_equals_one_process

test-python:
	test -x $(PY_VENV)/bin/python || $(PY_INTERPRETER) -m venv $(PY_VENV)
	$(PY_VENV)/bin/python -m pip install -q -c constraints.txt pip 2>&1 | $(QUIET_PIP)
	$(PY_VENV)/bin/python -m pip install -q --no-compile -c $(PY_CONSTRAINTS) -e '.[$(PY_EXTRAS)]' 2>&1 | $(QUIET_PIP)
	$(PY_VENV)/bin/python -m compileall -q -j 0 -x '/(tests?|testing/_internal)/' "$$($(PY_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
	$(PY_VENV)/bin/python -m pip list --format=freeze 2>/dev/null > $(PY_VENV)/installed.txt
	$(PY_VENV)/bin/python -c "import sys, dask, pandas, torch; print('Python', sys.version.split()[0], '/ torch', torch.__version__, '/ dask', dask.__version__, '/ pandas', pandas.__version__)"
	$(PY_VENV)/bin/python -m pytest $(PYTHON_SUBSET) $(if $(FLOORS),$(FLOORS_SUBSET)) --durations=10

# The suite in a shuffled order (modules shuffled, and tests within each): no test may depend on
# another having run before it. SEED=N replays an order; the seed is printed at the top.
SEED ?= $(shell date +%s)
test-shuffled: $(STAMP)
	$(BIN)/pytest --random-order-bucket=module --random-order-seed=$(SEED)

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.ddp_vs_torchrun

bench-data: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.preprocessing

bench-pipeline: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.pipeline

screenshot: $(STAMP) browser
	$(BIN)/python -m workflows.runs.screenshot --output docs/assets/training-page.png

bench-predict: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.inference

bench-launch: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.launch_vs_torchrun --steps 100 --repeats 2

bench-queue: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.queue_overhead

bench-workers: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.long_lived_workers

bench-elastic: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.elastic

bench-scale: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.scale

bench-collections: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.collections

bench-store: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.array_store

bench-sweep: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.sweep

bench-fsdp: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.fsdp

# FSDP2, TP and PP on the built-in GPT, 2 CPU ranks: dask-train's trainer and the hand-written
# torchrun script under dask-train launch, each against the same script under torchrun.
bench-strategies: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.strategies

# Synchronous against asynchronous checkpoints of 101 M parameters, on local disk and on a
# local S3 server (moto's, as the tests start it).
bench-checkpoint: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.checkpoint

# The built-in GPT on the standard library's sources: under DDP against torchrun, then its
# peak memory under FSDP against DDP at 101 M parameters, then its loss under SGD and AdamW
# (the plot in docs/assets/).
bench-gpt: $(STAMP)
	$(BIN)/python -m workflows.benchmarks.ddp_vs_torchrun --model gpt --steps 40
	$(BIN)/python -m workflows.benchmarks.fsdp --model gpt
	$(BIN)/python -m workflows.benchmarks.optimizers --plot docs/assets/gpt_optimizers.png

# The GPU checks (.ci/gpu-check): the gpu tests and a short DDP benchmark on nccl, within
# 10 minutes on one GPU. In this project's .venv by default; `make gpu-check PYTHON_ENV=system`
# uses python3 from PATH as it is (a machine with torch preinstalled), creating and installing
# nothing.
PYTHON_ENV ?= venv
ifeq ($(PYTHON_ENV),system)
gpu-check:
	PYTHON=python3 .ci/gpu-check
else
gpu-check: $(STAMP)
	PYTHON=$(BIN)/python .ci/gpu-check
endif

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
