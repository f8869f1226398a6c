"""scripts/device_check.sh --dry-run: every step of the GPU run, on the CPU at tiny size.

No GPU is lent to the project, so this is what keeps the prepared GPU run from rotting: each step
must run end to end and leave its figures in device_check.json. The figures themselves say
nothing (the CPU stands in for the GPU), except what must hold on any device: a CPU build
compared with itself differs in no tensor, zero-init OT keeps the function (verify: PARITY), and
two ranks write the bytes of one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def test_device_check_dry_run_runs_every_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHON=sys.executable, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh"), "--dry-run", "--methods", "ot-paper"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    steps = report["steps"]
    assert list(steps) == [
        "environment",
        "agreement_tiny",
        "ranks",
        "expand",
        "verify_speed",
        "agreement_wide_layer",
    ]
    assert all(step["ok"] for step in steps.values()), {k: v.get("error") for k, v in steps.items()}
    assert steps["environment"]["torch"] and steps["environment"]["transformers"]
    for name in ("agreement_tiny", "agreement_wide_layer"):
        ot = steps[name]["methods"]["ot-paper"]
        assert ot["tensors"] > 0 and ot["max_rel_diff"] == 0.0, (name, ot)
        assert ot["verify_verdict"].startswith("PARITY"), (name, ot["verify_verdict"])
    assert steps["ranks"]["same_shard_bytes"] is True
    assert steps["expand"]["layers_out"] == 6 and steps["expand"]["wall_s"] > 0  # tiny: 4 -> 6
    speed = steps["verify_speed"]
    assert speed["tokens"] > 0 and speed["verify_tokens_per_s_both_models"] > 0
    assert speed["plain_tokens_per_s_both_models"] > 0
