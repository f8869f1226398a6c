"""`expand --method ot` writes the same bytes whatever the number of intra-op CPU threads.

docs/cluster.md and docs/ot.md promise that the bytes of a build do not depend on the thread count
(on one machine, one device kind, the same library versions). Two real processes build the
bundled stories260K expansion with 1 and 2 threads, set as users set them (OMP_NUM_THREADS and
MKL_NUM_THREADS, which torch reads at start); each process first checks that torch took the count,
so the comparison cannot pass by running both builds at the same count.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

# Checks the thread count torch took from the environment, then runs the CLI as `otdus` does.
RUN_AT_THREADS = (
    "import os, sys, torch\n"
    "want = int(os.environ['OMP_NUM_THREADS'])\n"
    "assert torch.get_num_threads() == want, (torch.get_num_threads(), want)\n"
    "from otdus_cli.cli import main\n"
    "sys.argv = ['otdus', *sys.argv[1:]]\n"
    "main()\n"
)


def build(out: Path, threads: int, args: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", RUN_AT_THREADS, "expand", "bundled:stories260k", "-o", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    shards = sorted(out.glob("*.safetensors"))
    assert shards
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in shards}


@pytest.mark.parametrize(
    "args",
    [
        ["--method", "ot"],  # paper variant, our Sinkhorn: dense plans applied by matrix products
        ["--method", "ot", "--ot-variant", "official", "--max-iter", "300"],  # POT's Sinkhorn
    ],
    ids=["paper", "official"],
)
def test_ot_bytes_do_not_depend_on_thread_count(tmp_path, args):
    one = build(tmp_path / "one", 1, args)
    two = build(tmp_path / "two", 2, args)
    assert one == two
