"""Size and hash of every file otdus writes, recorded in the manifest, so that `--force` can tell an
output otdus wrote from one that was changed since (a fine-tune saved into it, a file edited).

A file up to ``WHOLE_LIMIT`` bytes is hashed whole. A larger one (a multi-GB shard) is hashed by
samples: its size, then ``BLOCKS`` blocks of ``BLOCK`` bytes at fixed, evenly strided offsets, the
first at 0 (the safetensors header, which any re-save rewrites) and the last at the end. That reads
16 MiB of a shard whatever its size, right after it was written (from the page cache), instead of a
second pass over the whole checkpoint; an edit that keeps the size and touches no sampled block of a
large shard goes unseen, which the README says.

The manifest covers itself too: :data:`SELF_HASH` records the SHA-256 of its canonical content (sorted
keys, no spaces, that field left out), so an edit of otdus.json is seen (:func:`manifest_check`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

WHOLE_LIMIT = 64 * 2**20
BLOCK = 2**20
BLOCKS = 16
_READ = 8 * 2**20


SELF_HASH = "manifest_sha256"


def _canonical_digest(manifest: dict) -> str:
    content = {k: v for k, v in manifest.items() if k != SELF_HASH}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(manifest: dict) -> dict:
    """``manifest`` as JSON reads it back (integer keys become strings, which sort otherwise), with the
    hash of its own canonical content as its last key."""
    content = json.loads(json.dumps({k: v for k, v in manifest.items() if k != SELF_HASH}))
    return content | {SELF_HASH: _canonical_digest(content)}


def manifest_check(manifest: dict) -> str:
    """'unchanged' when ``manifest`` (read back) still hashes to the value it records, 'edited' when it
    does not, 'unrecorded' when it records none (written by an otdus before the field existed)."""
    recorded = manifest.get(SELF_HASH)
    if recorded is None:
        return "unrecorded"
    return "unchanged" if recorded == _canonical_digest(manifest) else "edited"


def edited_line(folder: Path) -> str:
    """What every command says of a manifest :func:`manifest_check` finds edited."""
    return f"{folder / 'otdus.json'} was edited since otdus wrote it (its {SELF_HASH} does not match it)"


def plain_name(name: object) -> bool:
    """Whether ``name`` (read from a manifest: untrusted) names a file directly inside the output
    folder: a non-empty string, no separator, no NUL, not '.' or '..'."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\x00" not in name


def _offsets(size: int) -> list[int]:
    last = size - BLOCK
    return sorted({k * last // (BLOCKS - 1) for k in range(BLOCKS)})


def _digest(fd: int, size: int) -> tuple[str, str]:
    """(how, sha256 hex) of the open file ``fd`` of ``size`` bytes."""
    h = hashlib.sha256()
    if size <= WHOLE_LIMIT:
        offset = 0
        while offset < size:
            chunk = os.pread(fd, min(_READ, size - offset), offset)
            if not chunk:
                break
            h.update(chunk)
            offset += len(chunk)
        return "whole", h.hexdigest()
    h.update(size.to_bytes(8, "little"))
    for offset in _offsets(size):
        h.update(os.pread(fd, BLOCK, offset))
    return "sampled", h.hexdigest()


def file_record(path: Path) -> dict:
    """What the manifest records of one file otdus wrote: size, how it was hashed, the hash."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        how, digest = _digest(fd, size)
    finally:
        os.close(fd)
    return {"size": size, "hashed": how, "sha256": digest}


def record_files(folder: Path, skip: set[str]) -> dict[str, dict]:
    """name -> file_record for every plain file of ``folder`` (all otdus wrote there) but ``skip``."""
    files = sorted(p for p in folder.iterdir() if p.name not in skip and p.is_file() and not p.is_symlink())
    return {p.name: file_record(p) for p in files}


def valid_records(records: object) -> bool:
    """Whether ``records`` (read from a manifest: untrusted) is a name -> record map file_changes reads."""
    if not isinstance(records, dict):
        return False
    for name, rec in records.items():
        if not plain_name(name):
            return False
        if not isinstance(rec, dict) or rec.get("hashed") not in ("whole", "sampled"):
            return False
        if not isinstance(rec.get("size"), int) or not isinstance(rec.get("sha256"), str):
            return False
    return True


def file_changes(folder: Path, records: dict[str, dict]) -> list[str]:
    """The files of ``folder`` that are no longer what ``records`` says otdus wrote, each as
    'NAME (what changed)'; empty when all are unchanged. Links are never followed."""
    changed = []
    for name, rec in sorted(records.items()):
        path = folder / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            changed.append(f"{name} (deleted)")
            continue
        except OSError:
            changed.append(f"{name} (now a link or unreadable)")
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                changed.append(f"{name} (no longer a plain file)")
            elif st.st_size != rec["size"]:
                changed.append(f"{name} (size {rec['size']} -> {st.st_size} bytes)")
            elif _digest(fd, st.st_size) != (rec["hashed"], rec["sha256"]):
                changed.append(f"{name} (content)")
        finally:
            os.close(fd)
    return changed
