"""The `otdus.json` manifest written beside every expanded checkpoint (see README: Output)."""

from __future__ import annotations

import os
from pathlib import Path

from otdus_cli.io.reader import read_json_object

MANIFEST = "otdus.json"


def read_manifest(folder: str | os.PathLike[str]) -> dict | None:
    """The manifest of an expanded checkpoint, or None for a folder that has none."""
    path = Path(folder) / MANIFEST
    return read_json_object(path) if path.is_file() else None


def manifest_source(folder: str | os.PathLike[str]) -> tuple[str, str | None] | None:
    """The base model an expansion came from: a folder that still exists, else its hub id and revision."""
    source = (read_manifest(folder) or {}).get("source")
    if not isinstance(source, dict):
        return None
    path = source.get("path")
    if path and Path(path).is_dir():
        return str(path), None
    return (str(source["id"]), source.get("revision")) if source.get("id") else None
