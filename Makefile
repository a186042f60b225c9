# The two commands a newcomer needs (README): `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Train a vanilla LM and a TrimeLM on Python stdlib sources (no download), evaluate both + continuous cache.
demo: $(STAMP)
	$(PY) -m launch.demo --workdir=runs/demo

# The whole test suite (CPU; multi-device tests use virtual CPU devices).
test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m bench.train_step_overhead
	$(PY) -m bench.loss_memory

clean:
	rm -rf runs .pytest_cache
