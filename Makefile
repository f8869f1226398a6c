# Everything a fresh machine needs: `make demo` runs the embedded example, `make test` runs the tests.
# TORCH selects the torch wheel; the default pin installs quickly from local disk on our machines.
# GPU users who want a specific CUDA build: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: setup demo test lint bench faults clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	$(VENV)/bin/otdus demo

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check otdus_cli tests scripts
	$(VENV)/bin/ruff format --check otdus_cli tests scripts

bench: setup
	$(PY) scripts/bench.py

# kill expansions at random moments (SIGINT, SIGTERM, SIGKILL) on a ~1 GB checkpoint: no data lost
faults: setup
	$(PY) scripts/fault_inject.py --runs 50

clean:
	rm -rf $(VENV) demo-out
