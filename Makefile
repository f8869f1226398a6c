# Everything a fresh machine needs: `make demo` runs the embedded example, `make test` runs the tests.
# TORCH selects the torch wheel; the default pin installs quickly from local disk on our machines.
# GPU users who want a specific CUDA build: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# The oldest transformers pyproject.toml accepts: `make test` also runs the verify/ppl tests (and their
# expand -> verify passes) under it, in a second environment.
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
OLDEST_TRANSFORMERS ?= transformers==4.57.6
# (the memory-limit verify run is left to the main run: it tests the streaming, not transformers, and is
# the slowest test)
COMPAT_TESTS := tests/test_verify_streaming.py tests/test_verify_compare.py tests/test_verify_cli.py \
	tests/test_verify_families.py tests/test_verify_self_check.py tests/test_verify_static.py \
	tests/test_arch_breadth.py tests/test_wrappers.py \
	--deselect tests/test_verify_cli.py::test_verify_runs_under_a_memory_limit_smaller_than_the_checkpoint

.PHONY: setup setup-compat demo test test-main test-compat lint bench faults coverage clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup-compat: $(COMPAT_VENV)/.installed

$(COMPAT_VENV)/.installed: pyproject.toml
	python3 -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q $(TORCH)
	$(COMPAT_PY) -m pip install -q -e ".[dev]" "$(OLDEST_TRANSFORMERS)"
	touch $@

demo: setup
	$(VENV)/bin/otdus demo

# the whole suite with the newest transformers, then the verify/ppl tests with the oldest accepted one
test: test-main test-compat

test-main: setup
	$(PY) -m pytest

# one intra-op thread: these tests run tiny models, where a second thread only adds synchronisation
test-compat: setup-compat
	$(COMPAT_PY) -c "import transformers; print('transformers', transformers.__version__)"
	OMP_NUM_THREADS=1 $(COMPAT_PY) -m pytest $(COMPAT_TESTS)

lint: setup
	$(VENV)/bin/ruff check otdus_cli tests scripts
	$(VENV)/bin/ruff format --check otdus_cli tests scripts

bench: setup
	$(PY) scripts/bench.py

# kill expansions at random moments (SIGINT, SIGTERM, SIGKILL) on a ~1 GB checkpoint: no data lost
faults: setup
	$(PY) scripts/fault_inject.py --runs 50

# every causal LM of the installed transformers: tiny model, expand, reload; writes docs/compatibility.md
# (minutes; tests/test_arch_breadth.py and tests/test_derived.py hold a fast subset)
coverage: setup
	$(PY) scripts/coverage.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) demo-out
