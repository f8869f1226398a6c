"""The `otdus.json` manifest written beside every otdus output (see docs/output.md).

A manifest is written from the :class:`Manifest` model (otdus_cli/output.py writes it, after the
model card, with the size and hash of every other file of the output) and read as untrusted input:
a damaged or hand-edited one is one clear error, never a traceback, and nothing in it decides by
itself what verify expects (see verify/proof.py).

Its keys are written in the order the models declare them; a key a command did not set is not
written (each command writes the keys it has: ``ignored_options`` and ``config_check`` by expand,
``widen`` by widen, ``history`` by any step whose source an otdus step made ...).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from otdus_cli import __version__
from otdus_cli.errors import OtdusError
from otdus_cli.io.file_hashes import file_changes, plain_name, record_files, sealed, valid_records
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
    """The source an output was made from, so verify can tell whether a base is that model."""

    model_config = ConfigDict(extra="allow", strict=True)

    id: str
    revision: str | None = None
    path: str | None = None
    model_type: str | None = None
    family: str | None = None
    num_hidden_layers: int | None = None
    zero_init_proof: dict | None = None  # a derived template's zero-init targets, proved (arch/identity.py)
    roles_proof: dict | None = None  # a derived template's roles, matched and proved (arch/derived_roles.py)
    kind: str | None = None  # "local", "hub", "bundled" (absent in manifests of otdus <= 0.1.0 runs)
    config_sha256: str | None = None
    index_sha256: str | None = None
    fingerprints: dict | None = None  # io/fingerprint.py: one per base layer, one per other tensor
    config: dict | None = None


class WidenRecord(BaseModel):
    """What `otdus widen` did to the experts (docs/widen.md)."""

    model_config = ConfigDict(extra="allow", strict=True)

    factor: int
    experts: list[int]  # [before, after]
    top_k: list[int]  # [before, after]
    noise: float
    seed: int
    layers: list[int]  # the MoE layers widened
    copies: str
    routing: str


class Manifest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    otdus_version: str
    created: str | None = None
    source: ManifestSource
    method: str
    operation: str | None = None  # "shrink" for `otdus shrink`; absent for an expansion
    options: dict[str, Any] | None = None
    ignored_options: dict[str, str] | None = None  # option -> why it had no effect
    num_hidden_layers: int
    # claimed (verify checks it): the same function as the source's, up to rounding
    function_preserving: bool | None = None
    widen: WidenRecord | None = None
    layers: list[ManifestLayer]
    new_parameters: list[str] = []
    # tensors outside the layers holding a slice per layer (arch/layer_slices.py): name -> the axis and
    # width of a layer's slice; output layer i's slice is the one of its source layer (``layers``)
    layer_slices: dict[str, dict[str, int]] | None = None
    shrink: dict[str, Any] | None = None  # what `otdus shrink` removed or merged, and the scores that chose
    transport: dict[str, Any] | None = None  # output layer -> its transport statistics
    # what the method adds (Method.manifest_extras; a builder's pre-pass report under its name),
    # each key written after ``transport``; read back, every key not declared here is one
    method_sections: dict[str, Any] = Field(default_factory=dict, exclude=True)
    copied_files: list[str] = []
    config_checked_by_transformers: bool | None = None
    config_check: str | None = None  # "transformers" or "otdus depth rules"
    warnings: list[str] = []
    # the records of the earlier otdus steps that made the source (expand, then widen)
    history: list[dict[str, Any]] | None = None
    intermediate: str | None = None  # a step's output that was removed (expand --experts)
    card: dict | None = None  # the model card's record (card.py)
    # every other file of the output as otdus wrote it: name -> size, sha256, "whole" or "sampled"
    # (io/file_hashes.py); absent in manifests of otdus <= 0.1.x, whose outputs --force never replaces
    files: dict[str, dict] | None = None
    # the SHA-256 of this manifest's own canonical content (io/file_hashes.py: sealed); always last
    manifest_sha256: str | None = None

    @field_validator("copied_files", "files")
    @classmethod
    def _names_of_files_in_the_folder(cls, names: list[str] | dict[str, dict] | None):
        for name in names or ():  # a list's items, a map's keys
            if not plain_name(name):
                raise ValueError(f"{name!r} is not the name of a file in the output folder")
        return names

    @model_validator(mode="before")
    @classmethod
    def _undeclared_keys_are_method_sections(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "method_sections" in data:
            return data
        sections = {k: v for k, v in data.items() if k not in cls.model_fields}
        if not sections:
            return data
        return {k: v for k, v in data.items() if k in cls.model_fields} | {"method_sections": sections}

    @model_serializer(mode="wrap")
    def _method_sections_after_transport(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        if not self.method_sections:
            return data
        out = {}
        for key, value in data.items():
            out[key] = value
            if key == "transport":
                out.update(self.method_sections)
        return out

    def to_json(self) -> dict:
        """The manifest as written: the keys set, in the declared order."""
        return self.model_dump(exclude_unset=True)


def created_now() -> dict[str, str]:
    """The first keys of a new manifest: which otdus wrote it, and when (UTC)."""
    return {"otdus_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_manifest(folder: Path, manifest: Manifest) -> dict:
    """Write ``manifest`` into the staged output ``folder``, with the size and hash of every other
    file there (what `--force` checks before it replaces this output); returns what was written."""
    manifest.files = record_files(folder, skip={MANIFEST})
    data = sealed(manifest.to_json())
    (folder / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")
    return data


def read_manifest(folder: str | os.PathLike[str]) -> dict | None:
    """The manifest of an expanded checkpoint (validated), or None for a folder that has none."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    data = read_json_object(path)
    kind = data.get("output", "model")
    if kind != "model":  # output_files.py: a study's results
        raise OtdusError(f"{folder} is an otdus {kind!r} output, not a model")
    try:
        Manifest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        # a key is the manifest's text: shown escaped when it is not printable (a newline, a NUL)
        where = ".".join(str(p) if str(p).isprintable() else repr(p) for p in err["loc"]) or "top level"
        raise OtdusError(f"{path} is damaged ({where}: {err['msg']}); it cannot be trusted") from None
    if len(data["layers"]) != data["num_hidden_layers"]:
        raise OtdusError(f"{path} is damaged (its layer map does not have num_hidden_layers entries)")
    return data


def changed_since_written(folder: str | os.PathLike[str], manifest: dict | None = None) -> list[str]:
    """The files of an otdus output that are no longer what otdus wrote ('NAME (what changed)'), by
    the sizes and hashes its manifest records: its claims (function-preserving ...) were made of the
    files as written, not of weights trained in place since. Empty when nothing changed or nothing is
    recorded (manifests of otdus <= 0.1.x)."""
    manifest = read_manifest(folder) if manifest is None else manifest
    records = (manifest or {}).get("files")
    return file_changes(Path(folder), records) if valid_records(records) else []


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
