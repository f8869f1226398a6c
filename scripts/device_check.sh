#!/usr/bin/env bash
# Everything a GPU machine is asked, in one device call that ends well inside 8 minutes on a fresh
# H200: scripts/device_check.py runs the steps (its docstring lists them: expansion at Llama-3.1-8B
# width, verify's speed against a plain forward, GPU-vs-CPU agreement of every method, two torchrun
# ranks on one GPU) and rewrites $OUT/device_check.json after each, so a run cut off keeps what it
# measured. docs/benchmarks.md says what the figures mean.
#
# Before the call, on a machine with a package index: scripts/device_wheels.sh (fills .whl with what
# the device image lacks). Then: run(command="scripts/device_check.sh", carry=[".whl"], timeout_s=540).
#   scripts/device_check.sh --dry-run    # every step on the CPU at tiny size (tests/test_device_check.py)
# Other arguments go to device_check.py (--big-layers 16, --methods ot-paper,average, --budget 300).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/bench-out/device}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    # carried wheels (POT, pydantic, typer: what the device image lacks), installed beside the image's
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/otdus-site "$ROOT"/.whl/*.whl || exit 2
    export PYTHONPATH="/tmp/otdus-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# the whole run stays inside 8 minutes: the steps share a 420 s budget, and this is the backstop
timeout 470 "$PY" -m scripts.device_check --out "$OUT" --budget 420 "$@" 2>&1 | tee "$OUT/device_check.log"
rc=${PIPESTATUS[0]}
echo "device_check exit $rc; figures in $OUT/device_check.json"
exit "$rc"
