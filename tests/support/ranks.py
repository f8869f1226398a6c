"""otdus as one process and as two ranks (torchrun on the gloo backend), and what their outputs must
share."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

OTDUS = [sys.executable, "-m", "otdus_cli.cli"]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    # faulthandler: a rank that dies of a signal (one SIGABRT was seen once under load 15) leaves its
    # threads' Python stacks in stderr, which the assertions print
    env.update(OMP_NUM_THREADS="1", OTDUS_DIST_TIMEOUT="120", PYTHONFAULTHANDLER="1", **extra)
    return env


def one_process(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*OTDUS, *args], capture_output=True, text=True, env=env_for(), timeout=600)


def two_ranks(args: list[str]) -> subprocess.CompletedProcess:
    port = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    return subprocess.run(
        [*TORCHRUN, *port, "-m", "otdus_cli.cli", *args],
        capture_output=True,
        text=True,
        env=env_for(),
        timeout=600,
    )


# -- expand on two ranks -----------------------------------------------------------------------------
def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def without_times(value):
    """A manifest less what varies run to run: its creation time, the solvers' seconds, and its hash of
    itself (which covers them)."""
    if isinstance(value, dict):
        return {
            k: without_times(v)
            for k, v in value.items()
            if k not in ("created", "seconds", "manifest_sha256")
        }
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def same_output(one: Path, two: Path) -> None:
    a, b = files_of(one), files_of(two)
    assert sorted(a) == sorted(b)
    for name in a:
        if name == "otdus.json":
            # the card's record: its hash is of each output's own card (compared below)
            (ma, ca, fa), (mb, cb, fb) = [
                (m, m.pop("card"), m["files"].pop("README.md"))
                for m in (json.loads(a[name]), json.loads(b[name]))
            ]
            assert without_times(ma) == without_times(mb)
            for card, files, data in ((ca, fa, a["README.md"]), (cb, fb, b["README.md"])):
                assert card["sha256"] == files["sha256"] == hashlib.sha256(data).hexdigest()
        elif name == "README.md":  # the model card names its folder and the command (its --out, by name)
            same = a[name].replace(str(one).encode(), str(two).encode()).replace(b"# one\n", b"# two\n")
            same = same.replace(f"--out {one.name} ".encode(), f"--out {two.name} ".encode())
            assert same == b[name]
        else:
            assert a[name] == b[name], name
