# The two commands a newcomer needs (README): `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch (the [fairseq] extra) is for tests/test_fairseq_import.py only: it reads the fairseq checkpoints those
# tests write. Pinned to one exact version: an unpinned `torch` (or a range) resolves to the newest multi-GB
# CUDA build, while unpickling a checkpoint needs only the CPU wheel. Where pip's configured wheel directory has
# no CPU wheel of 2.13.0, point pip at PyTorch's CPU wheel index: make test TORCH_PIP_ARGS="--extra-index-url URL"
TORCH_PIP_ARGS ?=
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	touch $(STAMP)

install: $(STAMP)

# Train a vanilla LM and a TrimeLM on Python stdlib sources (no download), evaluate both + continuous cache.
demo: $(STAMP)
	$(PY) -m trime_jax.launch.demo --workdir=runs/demo

# The whole test suite (CPU; multi-device tests use virtual CPU devices), two test files at a time (pytest-xdist):
# 1,069 tests (2026-12-08); 994 took 32.1 minutes on a 2-core machine (2026-12-07, commit 0c8728e), 998 took 50.0 on a
# slower one (commit 38ea7c1), 1,000 took 42.3 (commit 044ed71), 1,004 took 50.7 (commit 3784647, with make demo beside
# it for 15 minutes), 1,008 took 55.3 (commit 23822c0, make demo beside it for 16 minutes), 1,025 took 54.7
# (commit 6aaa0be, make demo beside it for 15 minutes), 1,054 took 39.8 (commit dc41713, make demo beside it for 9
# minutes), 1,056 took 40.1 (commit 2109ac6), 1,069 took 42.2 (commit 217c0e3, 2026-12-08); docs/performance.md.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

bench: $(STAMP)
	$(PY) -m bench.train_step_overhead
	$(PY) -m bench.loss_memory

clean:
	rm -rf runs .pytest_cache
