#!/usr/bin/env bash
# Everything that needs a GPU, in one device call (under 10 minutes on one H200):
#   1. the CUDA tests (pytest -k cuda: Sinkhorn, the OT builder and verify on the GPU against the CPU),
#   2. scripts/bench_gpu.sh (Llama-3.1-8B-shaped expansion with OT-DUS on the GPU, against cp),
#   3. a torchrun smoke test: `ppl` on the GPU as one process and as two torchrun ranks sharing it
#      (docs/cluster.md): the same figures, one JSON object.
# Logs and reports land in $OUT (the device runner's folder that comes back).
#
# Before the call, on a machine with a package index: scripts/device_wheels.sh (fills .whl with what
# the device image lacks). Then: run(command="scripts/device_check.sh", carry=[".whl"], timeout_s=600).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/bench-out/device}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/otdus-site "$ROOT"/.whl/*.whl || exit 2
    export PYTHONPATH="/tmp/otdus-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -m pytest -q -p no:cacheprovider -k cuda tests 2>&1 | tee "$OUT/cuda-tests.log"
tests_rc=${PIPESTATUS[0]}
PYTHON="$PY" OUT="$OUT" timeout 480 scripts/bench_gpu.sh 2>&1 | tee "$OUT/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}
# torchrun smoke test: two ranks on the one GPU (each sees it as its device) against one process
PPL=(ppl bundled:stories260k --device cuda --max-tokens 4000 --quiet --json)
"$PY" -m otdus_cli.cli "${PPL[@]}" > "$OUT/ppl-1proc.json"
OTDUS_DIST_TIMEOUT=120 timeout 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m otdus_cli.cli "${PPL[@]}" > "$OUT/ppl-torchrun2.json" 2> "$OUT/ppl-torchrun2.err"
"$PY" - "$OUT/ppl-1proc.json" "$OUT/ppl-torchrun2.json" <<'PYEOF' 2>&1 | tee "$OUT/torchrun.log"
import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:])
on_gpu = one["device"].startswith("cuda") and two["device"].startswith("cuda")
same = one["metrics"] == two["metrics"] and two["compute"]["ranks"] == 2 and on_gpu
print("torchrun smoke:", one["device"], two["device"], one["metrics"]["token_perplexity"],
      two["metrics"]["token_perplexity"], "same figures" if same else "DIFFERENT")
sys.exit(0 if same else 1)
PYEOF
torchrun_rc=${PIPESTATUS[0]}
echo "cuda tests exit $tests_rc, bench_gpu exit $bench_rc, torchrun smoke exit $torchrun_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$torchrun_rc" = 0 ]
