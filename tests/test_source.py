"""Hub ids resolve through huggingface_hub's real cache.

Offline, a cached model works and a missing one is one error line.
"""

from __future__ import annotations

import json
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


def test_cached_hub_model_expands_offline_and_missing_one_is_one_error(sharded_llama, tmp_path):
    cache = tmp_path / "hub"
    make_hub_cache(cache, "tiny-org/tiny-llama", sharded_llama)
    done = otdus(
        "expand",
        "tiny-org/tiny-llama",
        "--out",
        tmp_path / "out",
        "--method",
        "llama-pro",
        "--layers",
        "2",
        "--json",
        cache=cache,
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "out" / "otdus.json").read_text())
    assert manifest["source"]["id"] == "tiny-org/tiny-llama"
    assert manifest["source"]["revision"] == COMMIT
    missing = otdus("plan", "tiny-org/not-cached", cache=cache)
    assert missing.returncode == 2
    assert (
        missing.stderr.strip().startswith("error:")
        and "not in the local Hugging Face cache" in missing.stderr
    )
    assert len(missing.stderr.strip().splitlines()) == 1
