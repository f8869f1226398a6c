#!/usr/bin/env bash
# GPU benchmark, one call, under 10 minutes on one large GPU (written for an H200, 16 cores,
# 128 GB RAM, 64 GB disk):
#   1. writes a Llama-3.1-8B-shaped synthetic bf16 checkpoint (16 GB, random values generated on
#      the GPU), 2. times `cp -r` of it, 3. times `otdus plan` (fixed overhead), 4. times
#   `otdus expand --method ot --device cuda --position top` (32 -> 48 layers), and prints wall
#   times, peak RSS of the process tree, bytes read/written, peak GPU memory (nvidia-smi polled
#   every 100 ms; plus any GPU figure otdus reports in its --json) and the ratio to cp.
# All measuring is done by scripts/bench.py; this script only checks the environment.
#
# On the device machine (no network): run scripts/device_wheels.sh here first and carry ".whl"
# (scripts/device_check.sh runs the CUDA tests and then this script, in one call);
# the wheels in it (POT, pydantic, typer: what the device image lacks) are installed before otdus runs.
#
# Assumptions (nothing is downloaded unless pip can reach an index):
#   - a Python with a CUDA build of torch is already installed: $PYTHON, else the repo's .venv
#     if its torch sees a GPU, else python3. If torch is missing, `pip install torch` is tried
#     (the default PyPI wheel for Linux x86_64 is CUDA-enabled); with no network it fails fast.
#   - otdus's other dependencies (safetensors, transformers, typer, rich, pydantic, pyyaml, POT,
#     numpy, huggingface_hub) are importable; missing ones are pip-installed if possible.
#   - otdus itself need not be installed: it runs from this working tree as
#     `python -m otdus_cli.cli` (an installed `otdus` on PATH is not used, so the code measured
#     is the code next to this script).
#   - nvidia-smi is on PATH (GPU memory column; without it that column is left out).
#
# Environment knobs: PYTHON, MODEL (llama-3.1-8b), LAYERS (base depth; default the model's,
# reduced automatically when the disk cannot hold source + output), DEVICE (cuda), WORK (where
# checkpoints go; default bench-out/gpu-work in the repo), OUT (where the report goes; the device
# runner sets it, default bench-out/gpu), CMD_TIMEOUT (per command, 360 s), CP_REPEAT (cp runs, 1;
# the median is the reference), TRANSPORT_BUDGET (seconds of POT per module solve in the OT-solve
# section, 5; 0 skips it), VERIFY=1 (also run
# `otdus verify` on the output), EXTRA (more flags for expand, e.g. "--ot-variant official").
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
MODEL=${MODEL:-llama-3.1-8b}
LAYERS=${LAYERS:-}
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-$ROOT/bench-out/gpu-work}
OUT=${OUT:-$ROOT/bench-out/gpu}
CMD_TIMEOUT=${CMD_TIMEOUT:-360}
VERIFY=${VERIFY:-0}
CP_REPEAT=${CP_REPEAT:-1}
TRANSPORT_BUDGET=${TRANSPORT_BUDGET:-5}
EXTRA=${EXTRA:-}
T0=$(date +%s)
say() { echo "[bench_gpu $(date +%H:%M:%S)] $*"; }

# ---- pick a Python with torch (CUDA when DEVICE is cuda) -----------------------------------
has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
PY=""
for cand in "${PYTHON:-}" "$ROOT/.venv/bin/python" "$(command -v python3 || true)" "$(command -v python || true)"; do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    if [ "$DEVICE" = cpu ] || has_cuda_torch "$cand"; then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
    PY=${PYTHON:-$(command -v python3)}
    if ! "$PY" -c 'import torch' 2>/dev/null; then
        say "no torch in $PY; trying: pip install torch (needs network)"
        "$PY" -m pip install --retries 0 --timeout 10 torch || { say "FAILED: install a CUDA torch first"; exit 2; }
    fi
    has_cuda_torch "$PY" || { say "FAILED: $PY has torch but no usable GPU (torch.cuda.is_available() is False)"; exit 2; }
fi
say "python: $PY"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'

# ---- otdus's dependencies, from this tree ---------------------------------------------------
# Wheels fetched by scripts/device_wheels.sh (carried as .whl) come first: the device has no network.
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    SITE=${TMPDIR:-/tmp}/otdus-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$ROOT"/.whl/*.whl || { say "FAILED: installing the carried wheels in .whl"; exit 2; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    say "installed the carried wheels: $(cd "$ROOT/.whl" && ls | cut -d- -f1 | tr '\n' ' ')"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
missing=$("$PY" - <<'EOF'
import importlib
mods = {"safetensors": "safetensors", "transformers": "transformers", "typer": "typer", "rich": "rich",
        "pydantic": "pydantic", "yaml": "pyyaml", "ot": "POT", "numpy": "numpy",
        "huggingface_hub": "huggingface_hub"}
print(" ".join(pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
    say "missing packages: $missing; trying pip install (needs network)"
    # shellcheck disable=SC2086
    "$PY" -m pip install --retries 0 --timeout 10 $missing || { say "FAILED: install: $missing"; exit 2; }
fi
"$PY" -m otdus_cli.cli version >/dev/null || { say "FAILED: python -m otdus_cli.cli does not run"; exit 2; }
OTDUS="$PY -m otdus_cli.cli"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# ---- disk: source + largest output must fit (cp's copy is deleted before expand runs) ----------
mkdir -p "$WORK" "$OUT"
free_gb=$(df -P -BG "$WORK" | awk 'NR==2 {gsub("G","",$4); print $4}')
if [ -z "$LAYERS" ] && [ "$MODEL" = llama-3.1-8b ]; then
    # 32 layers: 16.1 GB source + 23.0 GB output (+2 GB margin); each layer is 0.44 GB, 1.5x after
    LAYERS=32
    while [ "$LAYERS" -gt 4 ] && [ "$(awk -v L="$LAYERS" 'BEGIN {print int(2.1*2 + 0.436*L*2.5 + 2)}')" -gt "$free_gb" ]; do
        LAYERS=$((LAYERS - 4))
    done
    [ "$LAYERS" -lt 32 ] && say "only ${free_gb} GB free in $WORK: using $LAYERS base layers (8B-wide)"
fi
LAYER_ARGS=()
[ -n "$LAYERS" ] && LAYER_ARGS=(--layers "$LAYERS")
say "free disk ${free_gb} GB; model $MODEL ${LAYERS:+($LAYERS layers)}; device $DEVICE"

GEN_DEVICE=cpu
[ "$DEVICE" != cpu ] && GEN_DEVICE=$DEVICE
VERIFY_METHODS=""
[ "$VERIFY" = 1 ] && VERIFY_METHODS=ot

# ---- the benchmark ---------------------------------------------------------------------------------
GPU_FLAG=()
command -v nvidia-smi >/dev/null && GPU_FLAG=(--gpu)
rc=0
"$PY" scripts/bench.py \
    --model "$MODEL" "${LAYER_ARGS[@]}" --dtype bf16 \
    --gen-device "$GEN_DEVICE" "${GPU_FLAG[@]}" \
    --cp-repeat "$CP_REPEAT" --methods ot --position top --extra "ot=--device $DEVICE $EXTRA" \
    --transport-device "$DEVICE" --transport-budget "$TRANSPORT_BUDGET" \
    --verify-methods "$VERIFY_METHODS" \
    --otdus "$OTDUS" \
    --workdir "$WORK" --timeout "$CMD_TIMEOUT" \
    --note "GPU run (scripts/bench_gpu.sh), expand on $DEVICE" \
    --md "$OUT/benchmarks_gpu.md" --json-out "$OUT/benchmarks_gpu.json" || rc=$?

# ---- short summary --------------------------------------------------------------------------------
"$PY" - "$OUT/benchmarks_gpu.json" <<'EOF'
import json, sys
e = json.load(open(sys.argv[1]))["entries"][-1]
res = e["results"]
cp = next((r for r in res if r["kind"] == "cp" and r["status"] == "ok"), None)
def durable(r):
    return (r["wall_s"] or 0) + (r["sync_s"] or 0)
print()
print(f"summary: {e['model']} x{e['checkpoint']['num_hidden_layers']} layers, "
      f"{e['checkpoint']['tensor_bytes'] / 1e9:.1f} GB, {e['machine'].get('gpu', 'no GPU')}")
for r in res:
    if r["wall_s"] is None:
        print(f"  {r['label']}: {r['status']} {r['reason']}")
        continue
    line = (f"  {r['label']}: {r['status']} {r['reason']} wall {r['wall_s']:.1f} s (+sync {r['sync_s'] or 0:.1f}), "
            f"peak tree RSS {r['peak_tree_rss_bytes'] / 1e9:.2f} GB, max proc RSS {r['max_proc_rss_bytes'] / 1e9:.2f} GB")
    if r.get("gpu_peak_mib") is not None:
        line += f", GPU peak {r['gpu_peak_mib'] / 1024:.2f} GiB"
    if cp and r["kind"] != "plan":
        line += f", {durable(r) / durable(cp):.2f}x cp time"
        if r.get("output_bytes") and cp.get("output_bytes"):
            per_byte = (durable(r) / r["output_bytes"]) / (durable(cp) / cp["output_bytes"])
            line += f" ({per_byte:.2f}x per output byte)"
    gpu_keys = {k: v for k, v in (r.get("otdus_json") or {}).items() if any(s in k.lower() for s in ("gpu", "cuda", "device"))}
    if gpu_keys:
        line += f", otdus reports {gpu_keys}"
    print(line)
EOF
say "done in $(( $(date +%s) - T0 )) s; report: $OUT/benchmarks_gpu.md"
rm -rf "$WORK"
exit $rc
