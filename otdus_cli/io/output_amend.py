"""Changing files of an existing otdus output in place (`verify --card` puts its verdict on the
card): only an output that is still what otdus wrote, and never half way.

* **checked** before any work and again under the output's lock (io/output_lock.py, the one a
  ``--force`` run to that folder takes): the folder is not a link, holds an otdus manifest with the
  size and hash of every file, and every one of those files is unchanged (io/file_hashes.py). An
  output edited since (a fine-tune saved into it, a card rewritten) is the user's: left alone.
* **staged**: the new files are written into a temporary folder beside the output, named after its
  owner like every otdus temporary folder (a SIGKILLed run's is swept by the next run there).
* **swapped**: each file is renamed over its old version, then the manifest, updated with the new
  sizes and hashes, likewise; signals are held back throughout, and a failure part way puts the old
  files back (kept as hard links in the temporary folder), so the manifest always describes the files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from otdus_cli.errors import Interrupted, OtdusError
from otdus_cli.io.file_hashes import (
    edited_line,
    file_changes,
    file_record,
    manifest_check,
    sealed,
    valid_records,
)
from otdus_cli.io.output_dir import MANIFEST, held_signals, make_temporary, read_output_manifest, sweep_stale
from otdus_cli.io.output_lock import OutputLock


@dataclass
class Amendment:
    """What the caller writes into: ``folder`` (the new versions of the files, by name) and
    ``manifest`` (the output's manifest as read, every field kept; the caller may set its own keys)."""

    folder: Path
    manifest: dict
    notes: list[str] = field(default_factory=list)  # stale temporary folders removed or found


def check_amendable(folder: str | os.PathLike[str], what: str) -> dict:
    """The manifest of the otdus output ``folder`` when every file it lists is still what otdus
    wrote; otherwise one error, starting with ``what``, saying why it is left alone."""
    folder = Path(folder)
    if folder.is_symlink():
        raise OtdusError(f"{what}: {folder} is a symbolic link; give the real folder of the otdus output")
    manifest = read_output_manifest(folder)
    if manifest is None:
        raise OtdusError(f"{what}: {folder} is not an otdus output (no {MANIFEST}); it is left alone")
    if manifest_check(manifest) == "edited":  # new hashes written into it would cover the edit
        raise OtdusError(f"{what}: {edited_line(folder)}; the output is left alone")
    records = manifest.get("files")
    if not valid_records(records):
        raise OtdusError(
            f"{what}: the otdus.json of {folder} records no valid sizes and hashes of its files (an earlier "
            "otdus version, or damaged), so otdus cannot tell whether they changed since; it is left alone"
        )
    changed = file_changes(folder, records)
    if changed:
        raise OtdusError(
            f"{what}: {len(changed)} file(s) of {folder} changed since otdus wrote them: "
            f"{', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}; the output is left alone"
        )
    return manifest


@contextlib.contextmanager
def amended_output(folder: str | os.PathLike[str], names: list[str], what: str) -> Iterator[Amendment]:
    """Replace the files ``names`` of the otdus output ``folder`` with those the caller writes into
    ``Amendment.folder`` (module docstring); the manifest is updated to record them."""
    out = Path(os.path.abspath(folder))
    lock = OutputLock(out)
    with held_signals() as arrived:
        lock.acquire()
        tmp: Path | None = None
        try:
            amendment = Amendment(out, check_amendable(out, what), sweep_stale(out))
            # one that records a hash of itself gets the new one; an earlier otdus's stays without
            covered = manifest_check(amendment.manifest) == "unchanged"
            tmp = amendment.folder = make_temporary(out)
            yield amendment
            for name in names:
                amendment.manifest["files"][name] = file_record(tmp / name)
            written = sealed(amendment.manifest) if covered else amendment.manifest
            (tmp / MANIFEST).write_text(json.dumps(written, indent=2) + "\n")
            _swap_files(tmp, out, [*names, MANIFEST])
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            lock.release()
    if arrived() is not None:
        raise Interrupted(arrived(), f"the run had already finished: {out} holds the new {', '.join(names)}")


def _swap_files(tmp: Path, out: Path, names: list[str]) -> None:
    """Rename each ``tmp/NAME`` over ``out/NAME`` (the manifest last); on a failure, the old files back."""
    kept = tmp / ".old"
    kept.mkdir()
    for name in names:
        if os.path.lexists(out / name):
            os.link(out / name, kept / name)
    done: list[str] = []
    try:
        for name in names:
            os.replace(tmp / name, out / name)
            done.append(name)
    except BaseException:
        for name in reversed(done):
            with contextlib.suppress(OSError):
                if os.path.lexists(kept / name):
                    os.replace(kept / name, out / name)
                else:
                    os.unlink(out / name)
        raise
