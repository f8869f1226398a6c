"""Write mergekit-made SOLAR and LLaMA-Pro expansions of the bundled stories260K model (no otdus.json).

    python -m scripts.make_mergekit_outputs OUT_DIR [--venv bench-out/mergekit-venv]

writes OUT_DIR/solar (5 -> 8 layers: base layers [0, 4) then [1, 5), SOLAR with m = 1) and
OUT_DIR/llama-pro (5 -> 10 layers: after every base layer a copy of it whose o_proj and down_proj
are scaled by 0.0, i.e. an exact identity), each by mergekit's passthrough merge in float32, as
`mergekit-yaml` writes them (its mergekit_config.yml, README.md and tokenizer included). The layer maps
are otdus's own (`otdus plan --json`), printed as JSON on stdout: {"solar": [sources...], ...}.

mergekit is installed on first use into its own virtual environment (--venv; pip, ~2 min once);
each merge then takes a few seconds. Existing OUT_DIR/solar and OUT_DIR/llama-pro are replaced only
if they are mergekit outputs (they hold mergekit_config.yml).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from scripts import bench_mergekit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BUNDLED = os.path.join(ROOT, "otdus_cli", "data", "stories260k")
EXPANSIONS = {
    "solar": ["--method", "solar", "--layers", "3"],
    "llama-pro": ["--method", "llama-pro", "--layers", "5"],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="folder that receives solar/ and llama-pro/")
    ap.add_argument("--venv", default=os.path.join(ROOT, "bench-out", "mergekit-venv"))
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    exe = bench_mergekit.ensure_venv(os.path.abspath(args.venv), log)
    otdus = [sys.executable, "-m", "otdus_cli.cli"]
    os.makedirs(args.out_dir, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    maps = {}
    for name, flags in EXPANSIONS.items():
        layers = bench_mergekit.otdus_layer_map(otdus, BUNDLED, flags)
        maps[name] = [lay["source"] for lay in layers]
        out = os.path.join(args.out_dir, name)
        if os.path.exists(out):
            if not os.path.exists(os.path.join(out, "mergekit_config.yml")):
                log(f"error: {out} exists and is not a mergekit output; move it away first")
                return 2
            shutil.rmtree(out)
        config = os.path.join(args.out_dir, f"{name}.mergekit.yml")
        with open(config, "w") as f:
            f.write(bench_mergekit.mergekit_yaml(BUNDLED, layers, "float32"))
        t = time.perf_counter()
        done = subprocess.run([exe, config, out, "--quiet"], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            log(f"error: mergekit failed on {name}:\n{done.stderr[-2000:]}")
            return 1
        os.remove(config)
        log(f"wrote {out} ({len(layers)} layers) in {time.perf_counter() - t:.1f} s")
    print(json.dumps(maps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
