"""The `otdus.json` manifest written beside every expanded checkpoint (see README: Output).

A manifest is read as untrusted input: a damaged or hand-edited one is one clear error, never a
traceback, and nothing in it decides by itself what verify expects (see verify/proof.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from otdus_cli.errors import OtdusError
from otdus_cli.io.file_hashes import record_files
from otdus_cli.io.reader import read_json_object

MANIFEST = "otdus.json"


class ManifestLayer(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    index: int
    source: int
    new: bool
    parents: list[int] = []
    builder: str = "base"
    zero_init: bool = False


class ManifestSource(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    id: str
    revision: str | None = None
    path: str | None = None
    kind: str | None = None  # "local", "hub", "bundled" (absent in manifests of otdus <= 0.1.0 runs)
    config_sha256: str | None = None
    index_sha256: str | None = None
    fingerprints: dict | None = None


class Manifest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    otdus_version: str
    source: ManifestSource
    method: str
    num_hidden_layers: int
    layers: list[ManifestLayer]
    new_parameters: list[str] = []
    copied_files: list[str] = []
    # every other file of the output as otdus wrote it: name -> size, sha256, "whole" or "sampled"
    # (io/file_hashes.py); absent in manifests of otdus <= 0.1.x, whose outputs --force never replaces
    files: dict[str, dict] | None = None


def write_manifest(folder: Path, manifest: dict) -> dict:
    """Write ``manifest`` into the staged output ``folder``, with the size and hash of every other
    file there (what `--force` checks before it replaces this output); returns what was written."""
    manifest = {**manifest, "files": record_files(folder, skip={MANIFEST})}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(folder: str | os.PathLike[str]) -> dict | None:
    """The manifest of an expanded checkpoint (validated), or None for a folder that has none."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    data = read_json_object(path)
    try:
        Manifest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "top level"
        raise OtdusError(f"{path} is damaged ({where}: {err['msg']}); it cannot be trusted") from None
    if len(data["layers"]) != data["num_hidden_layers"]:
        raise OtdusError(f"{path} is damaged (its layer map does not have num_hidden_layers entries)")
    return data


def manifest_source(folder: str | os.PathLike[str]) -> tuple[str, str | None, str] | None:
    """The base model an expansion came from, as (model, revision, kind) for resolve_source.

    A recorded folder is used only if it still exists: a relative id is never looked up against
    the current directory, nor taken for a hub repository. Hub and bundled ids resolve as such.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    source = manifest["source"]
    path, ident, kind = source.get("path"), source["id"], source.get("kind")
    if kind is None:  # manifests written before "kind" was recorded
        kind = "bundled" if ident.startswith("bundled:") else ("hub" if source.get("revision") else "local")
    if kind in ("bundled", "hub"):
        return ident, source.get("revision"), kind
    if path and Path(path).is_dir():
        return str(path), None, "local"
    raise OtdusError(
        f"the base model recorded in {Path(folder) / MANIFEST} ({path or ident}) no longer exists; "
        "give it with --base"
    )


def seen_from_first_source(manifest: dict) -> dict | None:
    """A manifest of chained otdus steps (``expand`` then ``widen``: each step keeps the earlier
    steps' records under ``history``) as one step from the first step's source: that source, and the
    final layers mapped onto its layers. None when there is no history, or it is not a chain of
    valid records whose layer maps fit together (then only the last step's source can be checked).

    A layer that is new in any step is new; a base layer widened in a later step stays that base
    layer, widened (with the later step's noise). A new layer widened later is still new: its output
    projections decide whether it is an identity, and noise added to copies of zeros leaves zeros.
    """
    history = manifest.get("history")
    if not isinstance(history, list) or not history:
        return None
    layers = [dict(entry) for entry in manifest["layers"]]
    for record in reversed(history):
        try:
            earlier = Manifest.model_validate(record)
        except ValidationError:
            return None
        mapped = []
        for entry in layers:
            source = entry["source"]
            if not 0 <= source < len(earlier.layers):
                return None
            below = earlier.layers[source].model_dump()
            if entry["new"]:
                mapped.append({**entry, "source": below["source"]})
                continue
            out = {**below, "index": entry["index"]}
            if entry.get("widened") and not below["new"]:
                noise = entry.get("noise") or below.get("noise") or 0.0
                out |= {"widened": True, "noise": noise}
            mapped.append(out)
        layers = mapped
    return {**manifest, "source": history[0]["source"], "layers": layers}
