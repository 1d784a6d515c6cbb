# Set-up and run targets. `make train` and `make test` work on a fresh machine:
# they create .venv, install the package (CPU torch first when there is no GPU,
# so nothing pulls the CUDA wheels), then run.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
CPU_TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# Two pytest workers, one test file each at a time (a file's module-scoped process groups run
# once): the suite's multi-rank runs leave a core idle about 40 % of the time on 2 cores.
PYTEST_WORKERS ?= 2
TRAIN_ARGS ?=

.PHONY: install install-dev train test gpu-check gpu-wheels clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(VENV)/bin/python
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: torch comes with the package's dependencies"; \
	else \
		echo "no GPU: installing the CPU build $(CPU_TORCH)"; \
		$(PIP) install -q "$(CPU_TORCH)"; \
	fi
	@touch $@

install: $(VENV)/.torch
	$(PIP) install -q -e .

install-dev: $(VENV)/.torch
	$(PIP) install -q -e ".[dev]"

train: install
	$(PY) -m lightning_mhc.cli.train $(TRAIN_ARGS)

test: install-dev
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# A lent GPU machine: its image's Python (CUDA PyTorch, Triton, Lightning) runs the checkout
# within one time budget, results in $OUT; what the image lacks comes from .whl/, which
# `make gpu-wheels` fills here (MEGATRON_LM=CHECKOUT also copies Megatron-LM's mHC into
# .megatron-lm/) and which the device call must carry. See benchmarks/gpu_check.py.
# the image's Python on the GPU machine (no .venv travels there); .venv's here: a CPU dry run
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=
MEGATRON_LM ?=

gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

gpu-wheels:
	$(PYTHON) benchmarks/gpu_check.py --download-wheels .whl $(if $(MEGATRON_LM),--megatron-lm $(MEGATRON_LM))

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .gpu-site
