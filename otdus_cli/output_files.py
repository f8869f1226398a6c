"""Writing an output that is not a model (a study's study.json and figures) through the same life
cycle as a model (io/output_dir.py): the target checked and claimed (lock, temporary folder beside
it) before any long work, the files written into the temporary folder, then an ``otdus.json``
manifest with the output's kind and the size and hash of every file, then the atomic swap. So
``--out`` is never a link, never the source, never someone's folder or file, and ``--force`` replaces
only an earlier output of the same kind that nobody changed since.

A single new file (``diagnose --png``) has no manifest to prove it otdus's, so it is never replaced:
refused before any work when anything is at its name, written in a temporary folder beside it and
renamed into place only if its name is still free.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from otdus_cli.errors import Interrupted, OtdusError
from otdus_cli.io.file_hashes import record_files, sealed
from otdus_cli.io.output_dir import (
    OutputReport,
    held_signals,
    make_temporary,
    move_into_place,
    staged_output,
    sweep_stale,
)
from otdus_cli.manifest import MANIFEST, created_now

STUDY = "study"  # the manifest's "output" of a study's results (io/output_dir.py: MODEL for a model)


def claim_files(
    stack: contextlib.ExitStack,
    out: str | os.PathLike[str],
    kind: str,
    *,
    protected: list[Path],
    force: bool,
    report: OutputReport | None = None,
) -> Path:
    """Claim ``out`` for an output of ``kind`` and return its temporary folder; when ``stack``
    closes without an error, the manifest is written and the folder swapped into place, and on any
    error or signal it is removed with nothing left behind."""
    staged = _staged_files(out, kind, protected=protected, force=force, report=report)
    # held: a signal after the folder is made but before the stack has its exit would leave the
    # folder to the garbage collector
    with held_signals() as arrived:
        tmp = stack.enter_context(staged)
    if arrived() is not None:
        raise Interrupted(arrived())
    return tmp


@contextlib.contextmanager
def _staged_files(
    out: str | os.PathLike[str], kind: str, *, protected: list[Path], force: bool, report: OutputReport | None
) -> Iterator[Path]:
    with staged_output(out, protected=protected, force=force, report=report, kind=kind) as tmp:
        yield tmp
        manifest = sealed({**created_now(), "output": kind, "files": record_files(tmp, skip={MANIFEST})})
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def check_new_file(path: str | os.PathLike[str], what: str) -> None:
    """Refuse, before any work, a new file's ``path`` that is taken (a file, a link, a folder) or
    whose folder does not exist; ``what`` names it in the error (an option)."""
    path = Path(path)
    if os.path.lexists(path):
        raise OtdusError(f"{what} {path} already exists; otdus writes a new file and replaces none")
    if not Path(os.path.abspath(path)).parent.is_dir():
        raise OtdusError(f"{what}: the folder of {path} does not exist")


@contextlib.contextmanager
def new_file(path: str | os.PathLike[str], what: str, report: OutputReport | None = None) -> Iterator[Path]:
    """Yield where to write the new file ``path`` (in a temporary folder beside it); on success it
    is renamed to ``path``, which must still be free (not written: nothing is), and on any failure
    nothing is left. The temporary folders of dead runs to ``path`` (a SIGKILL leaves one) are
    removed first, each said in ``report``."""
    check_new_file(path, what)
    absolute = Path(os.path.abspath(path))
    with held_signals() as arrived:
        (report or OutputReport()).add(sweep_stale(absolute))
        tmp = make_temporary(absolute)
    try:
        if arrived() is not None:
            raise Interrupted(arrived())
        yield tmp / absolute.name
        if not os.path.lexists(tmp / absolute.name):
            return
        with held_signals() as arrived:
            move_into_place(tmp / absolute.name, absolute)
            tmp.rmdir()
        if arrived() is not None:
            raise Interrupted(arrived(), f"the run had already finished: {path} is complete and in place")
    finally:
        with held_signals():
            shutil.rmtree(tmp, ignore_errors=True)
