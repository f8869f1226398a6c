"""Peak memory and time of OT-DUS and widen on a Mixtral-8x7B-shaped MoE layer (docs/benchmarks.md).

Writes a synthetic Mixtral-8x7B checkpoint with a few layers (random bf16 weights, the real names and
shapes), then measures, each with scripts/bench.py's sampler (peak RSS of the process tree, its
anonymous part, wall and CPU time) and the load average next to it:

  * `otdus widen` of the whole checkpoint (8 -> 16 experts, default noise),
  * `otdus expand --method ot --layers 1` (one new layer from the top pair: 8 expert pairs, each a
    14336 x 14336 plan for gate and for up; several CPU-minutes per pair).

Results go to a JSON file (--json); the work folder is deleted at the end.

    python -m scripts.bench_moe --work /tmp/moe-bench --json /tmp/moe-bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from scripts import bench, measuring

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(label: str, argv: list[str], out: str, timeout: float) -> dict:
    before = list(measuring.load_average())
    r = bench.run_measured(label, "expand", None, argv, timeout, 0.5, out_dir=out)
    row = {
        "label": label,
        "argv": argv,
        "status": r.status,
        "reason": r.reason,
        "wall_s": r.wall_s,
        "cpu_s": (r.utime_s or 0) + (r.stime_s or 0),
        "peak_tree_rss_gb": r.peak_tree_rss_bytes / 1e9,
        "peak_tree_anon_gb": r.peak_tree_anon_bytes / 1e9,
        "max_proc_rss_gb": (r.max_proc_rss_bytes or 0) / 1e9,
        "peak_at_s": r.peak_at_s,
        "output_gb": (r.output_bytes or 0) / 1e9,
        "other_cpu_s": r.other_cpu_s,
        "load_before": before,
        "load_after": list(measuring.load_average()),
        "stderr_tail": r.stderr_tail,
        "otdus_json": r.otdus_json,
    }
    print(json.dumps({k: v for k, v in row.items() if k != "otdus_json"}), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="work folder (deleted at the end)")
    ap.add_argument("--json", required=True, help="where the results go")
    ap.add_argument("--layers", type=int, default=2, help="base depth of the synthetic checkpoint")
    ap.add_argument("--timeout", type=float, default=4 * 3600)
    ap.add_argument("--skip", default="", help="comma-separated: widen, expand")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    otdus = [os.path.join(os.path.dirname(sys.executable), "otdus")]
    base, widened, expanded = (os.path.join(args.work, n) for n in ("base", "widened", "expanded"))
    os.makedirs(args.work, exist_ok=True)
    results: dict = {"conditions": {"nproc": os.cpu_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ")}}
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "scripts.make_synthetic", "mixtral-8x7b", "--out", os.path.abspath(base),
         "--layers", str(args.layers), "--dtype", "bf16", "--force"],
        check=True, cwd=ROOT,
    )  # fmt: skip
    results["synthetic_s"] = time.perf_counter() - t0
    results["base_gb"] = bench.dir_bytes(base) / 1e9
    runs = []
    skip = set(filter(None, args.skip.split(",")))

    def save() -> None:
        results["runs"] = runs
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)

    try:
        if "widen" not in skip:
            runs.append(
                measure("widen", [*otdus, "widen", base, "--out", widened, "--json"], widened, args.timeout)
            )
            save()
            shutil.rmtree(widened, ignore_errors=True)
        if "expand" not in skip:
            argv = [*otdus, "expand", base, "--out", expanded, "--method", "ot", "--layers", "1", "--json"]
            runs.append(measure("expand --method ot --layers 1", argv, expanded, args.timeout))
            manifest = os.path.join(expanded, "otdus.json")
            if os.path.exists(manifest):  # per-pair plan statistics (seconds, iterations)
                with open(manifest) as f:
                    results["expand_transport"] = json.load(f).get("transport")
            save()
    finally:
        save()
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
