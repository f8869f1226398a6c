"""A model laid out in a huggingface_hub cache, and otdus run against that cache offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_hub_cache(root: Path, repo: str, model: Path) -> Path:
    """Lay out a model the way huggingface_hub caches it: blobs, symlinked snapshot, refs/main."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    blobs, snap = repo_dir / "blobs", repo_dir / "snapshots" / COMMIT
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(model.iterdir())):
        blob = blobs / f"blob{i}"
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return snap


def otdus(*args, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent)}
    return subprocess.run(
        [sys.executable, "-m", "otdus_cli.cli", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
