"""transformers' load check of a written config.json, run beside the copy instead of after it.

Importing transformers costs seconds of CPU (it imports torch), which a copy-type expansion
otherwise never needs. So the check starts in a child process as soon as config.json is written,
before the first tensor byte moves, runs on another core while the copy waits on memory and disk,
and its answer is collected at the end: the same check, off the critical path. When transformers
is already imported in this process (a library caller, or a family whose plan asked transformers
for its layer_types), the check runs here instead and costs milliseconds. A child that cannot start
or dies without an answer is not trusted: the check is then redone in this process.

Child protocol: ``python -m otdus_cli.arch.config_check FOLDER LAYERS`` prints one JSON object,
``{"skipped": null | reason}`` or ``{"error": message}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from otdus_cli.arch.config_rules import validate_with_transformers
from otdus_cli.errors import OtdusError


def _child_rusage_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


class ConfigCheck:
    """One load check of ``folder/config.json``: ``start()`` early, ``result()`` at the end."""

    def __init__(self, folder: Path, expected_layers: int, in_child: bool | None = None):
        """``in_child``: True or False forces where the check runs; None decides by whether
        transformers is imported already."""
        self.folder = Path(folder)
        self.expected_layers = expected_layers
        self.in_child = in_child
        self.where = ""  # "child process" or "in process", once decided
        self.wait_s = 0.0  # time result() spent waiting for the child
        self.cpu_s: float | None = None  # the child's CPU time (user + system)
        self._child: subprocess.Popen | None = None

    def start(self) -> None:
        in_child = self.in_child if self.in_child is not None else "transformers" not in sys.modules
        if not in_child:
            return  # checked here at the end: cheap once transformers is imported
        argv = [sys.executable, "-m", __name__, str(self.folder), str(self.expected_layers)]
        with contextlib.suppress(OSError):  # cannot spawn: result() checks in-process
            self._child = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
            )

    def result(self) -> str | None:
        """None when transformers loaded the config, else why the load check was skipped; raises
        OtdusError when transformers rejects it (see validate_with_transformers)."""
        answer = self._child_answer()
        if answer is None:
            self.where = "in process"
            return validate_with_transformers(self.folder, self.expected_layers)
        self.where = "child process"
        if "error" in answer:
            raise OtdusError(str(answer["error"]))
        skipped = answer.get("skipped")
        return None if skipped is None else str(skipped)

    def _child_answer(self) -> dict | None:
        child, self._child = self._child, None
        if child is None:
            return None
        t0 = time.perf_counter()
        cpu0 = _child_rusage_cpu()
        try:
            out = child.stdout.read() if child.stdout else b""
            child.wait()
        finally:
            if child.stdout:
                child.stdout.close()
        self.wait_s = time.perf_counter() - t0
        # the child's CPU since it started is charged to RUSAGE_CHILDREN once reaped; other children
        # reaped meanwhile would be counted too, but none are while a copy runs
        self.cpu_s = _child_rusage_cpu() - cpu0
        if child.returncode != 0:
            return None
        try:
            answer = json.loads(out)
        except ValueError:
            return None
        return answer if isinstance(answer, dict) and ("error" in answer or "skipped" in answer) else None

    def cancel(self) -> None:
        """Stop a running child (the expansion failed or was interrupted) and reap it."""
        child, self._child = self._child, None
        if child is None:
            return
        with contextlib.suppress(OSError):
            child.kill()
        child.wait()
        if child.stdout:
            child.stdout.close()


def _main(argv: list[str]) -> int:
    folder, layers = Path(argv[0]), int(argv[1])
    try:
        answer: dict = {"skipped": validate_with_transformers(folder, layers)}
    except OtdusError as exc:
        answer = {"error": str(exc)}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    # SIGINT from the terminal reaches this child too: the parent reports the interrupt, not us
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        sys.exit(_main(sys.argv[1:]))
    os._exit(130)
