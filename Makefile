# Everything a fresh machine needs: `make demo` runs the embedded example, `make test` runs the tests.
# TORCH selects the torch wheel; the default pin installs quickly from local disk on our machines.
# GPU users who want a specific CUDA build: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# The oldest transformers pyproject.toml accepts: `make test` also runs the tests marked compat (verify,
# ppl, widen, wrappers, trainable, with their expand -> verify passes) under it, in a second environment.
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
OLDEST_TRANSFORMERS ?= transformers==4.57.6

.PHONY: setup setup-compat demo test test-main test-long test-compat check-docs lint evidence bench bench-copy bench-8b-copy faults coverage \
	lm-eval-check lm-eval-record clean

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
	$(PY) -m pytest -m "not slow"

# the slow tests (docs commands from a fresh copy, the device-check dry run, thread identity, verify under
# a memory limit, two ranks on two emulated GPUs): CI runs them after `make test`
test-long: setup
	$(PY) -m pytest -m slow

# one intra-op thread: these tests run tiny models, where a second thread only adds synchronisation
test-compat: setup-compat
	$(COMPAT_PY) -c "import transformers; print('transformers', transformers.__version__)"
	OMP_NUM_THREADS=1 $(COMPAT_PY) -m pytest -m "compat and not slow"

# every command block of README.md and docs/*.md, run from a fresh clone of HEAD, offline, long ones
# with quick options (scripts/check_docs.py --list shows what runs, what is shortened or skipped and
# why); `make test-long` runs the quick part (tests/test_docs.py, marked slow)
check-docs: setup
	$(PY) scripts/check_docs.py

lint: setup
	$(VENV)/bin/ruff check otdus_cli tests scripts
	$(VENV)/bin/ruff format --check otdus_cli tests scripts

# docs/evidence.md's generated tables, verdicts and inline figures, from the stored results under
# docs/evidence/ and the recipes' declared primary families (no training: seconds)
evidence: setup
	$(PY) scripts/evidence.py render

# the 1B-shaped table (every method, memory, OT, verify), the paired warm/cold copy runs against
# `cp -r && sync` and mergekit side by side; then the copy runs at Llama-3.1-8B width (8 layers: ~15 GB
# of disk at the peak). Each prints its figures with their targets; docs/benchmarks.md gets them.
bench: setup
	$(PY) scripts/bench.py --against mergekit
	$(MAKE) bench-8b-copy

# only the copy figures (warm and cold against cp, both shapes) and the mergekit table: about an hour on
# these 2 cores
bench-copy: setup
	$(PY) scripts/bench.py --no-table --methods solar,llama-pro,stack --against mergekit
	$(MAKE) bench-8b-copy

bench-8b-copy: setup
	$(PY) scripts/bench.py --model llama-3.1-8b --layers 8 --no-table --methods solar,llama-pro,stack \
		--note "8B-wide layers, 8 of the 32 (paired copy runs only; the 16-layer entry has the per-command table)"

# kill expand, widen and expand --experts at random moments, start-up included (SIGINT, SIGTERM, SIGHUP,
# SIGKILL) on tiny synthetic checkpoints: no data lost (--dense llama-3.2-1b --layers 4: ~1 GB source)
faults: setup
	$(PY) scripts/fault_inject.py --runs 120

# every causal LM of the installed transformers: tiny model, expand, reload; writes docs/compatibility.md
# (minutes; tests/test_arch_breadth.py and tests/test_derived.py hold a fast subset)
coverage: setup
	$(PY) scripts/coverage.py

# real lm-eval releases (each pip-installed into its own venv under /tmp/otdus-lm-eval) against
# `otdus ppl --lm-eval` on stories260K, and against the figures the tests pin; LM_EVAL_ARGS=--quick
# leaves out the three whole-split runs (scripts/check_lm_eval.py --help)
lm-eval-check: setup
	$(PY) scripts/check_lm_eval.py $(LM_EVAL_ARGS)

# the same runs, their lm-eval figures written to the file the tests read
lm-eval-record: setup
	$(PY) scripts/check_lm_eval.py --record tests/data/lm_eval_reference.json $(LM_EVAL_ARGS)

clean:
	rm -rf $(VENV) $(COMPAT_VENV) demo-out
