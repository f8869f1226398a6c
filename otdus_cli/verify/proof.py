"""What verify may expect, from the checkpoints themselves: base identity and a static proof.

Before any forward pass:

* **base identity**: when the expanded checkpoint's manifest recorded its source (hashes of
  config.json and the index, a fingerprint per layer and per other tensor), the base given to verify
  must match them; a mismatch is "this is not the model the expansion was made from" (exit 2), not a
  broken expansion.
* **static proof**: every expanded layer is matched to the base by fingerprints (io/fingerprint.py):
  a *copy* of base layer i, or *new*. A new layer whose output projections (the family's zero-init
  targets: o_proj, down_proj, every expert's down projection) are exactly zero (and a derived
  template's residual scales exactly 1) adds exactly 0.0 to the residual stream for finite
  activations: an *identity*. The expansion computes the base function
  when every base layer appears once, in order, as a copy, every other layer is an identity, and the
  tensors outside the stack (embeddings, final norm, head) are the base's. Copies are checked by
  sampled fingerprints, zeros by reading every byte.

The layer map a manifest states is a claim; the proof checks it. Parity is expected when the
claim or the proof says the function is preserved, so editing a manifest can never turn a broken
checkpoint into a pass. Without a manifest the map is inferred from the fingerprints alone, which is
how checkpoints made by other tools (mergekit, hand edits) are verified.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from otdus_cli.arch.family_lookup import family_for
from otdus_cli.arch.identity_values import holds
from otdus_cli.errors import OtdusError
from otdus_cli.io.file_hashes import manifest_check
from otdus_cli.io.fingerprint import SCHEME, group_fingerprint, slice_fingerprint, tensor_fingerprint
from otdus_cli.io.reader import CheckpointReader, file_sha256
from otdus_cli.io.safetensors_format import itemsize
from otdus_cli.io.stack import LayerStack, read_stack
from otdus_cli.manifest import MANIFEST, seen_from_first_source
from otdus_cli.verify.widened import is_duplicated_experts

_ZERO_CHUNK = 16 * 2**20


class WrongBase(OtdusError):
    """The base given to verify is not the model the expansion was made from (exit 2)."""


def open_stack(folder: str | os.PathLike[str] | CheckpointReader) -> LayerStack:
    reader = folder if isinstance(folder, CheckpointReader) else CheckpointReader(folder)
    return read_stack(reader, family_for(reader.config, allow_unknown=True))


# -- base identity ------------------------------------------------------------------------------------
# Fields of config.json that say how a file was written, not what the model computes.
_COSMETIC_CONFIG_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures"}


def _semantic_config(config: dict, normalise: bool) -> dict:
    """The config without the fields that only say how it was written; with ``normalise``, as
    transformers reads it (a re-save may rename fields, e.g. rope_theta into rope_parameters)."""
    import warnings

    if normalise:
        try:
            from transformers import AutoConfig

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = AutoConfig.for_model(**config).to_dict()
        except Exception:  # a model_type transformers does not know: compare the fields as written
            pass
    return {k: v for k, v in config.items() if k not in _COSMETIC_CONFIG_KEYS}


def _config_difference(mine: dict, theirs: dict) -> str | None:
    """The first field in which two configs differ as models, or None (transformers is imported
    only when the files differ as written)."""
    for normalise in (False, True):
        a, b = _semantic_config(mine, normalise), _semantic_config(theirs, normalise)
        if a == b:
            return None
    key = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))[0]
    return f"config.json field {key} is {json.dumps(a.get(key))}, the source had {json.dumps(b.get(key))}"


def check_recorded_base(manifest: dict | None, base: LayerStack) -> list[str]:
    """Compare ``base`` with what the manifest recorded of the source; raise WrongBase naming the first
    check that fails. Returns the checks made (for the report).

    With fingerprints recorded, the tensors decide, and config.json is compared field by field
    (without the fields a re-save changes), so a base re-saved or re-sharded still counts as the
    same model. Manifests of earlier versions recorded only file hashes: then those are compared.
    """
    if not manifest:
        return []
    source = manifest["source"]
    where = f"the base {base.reader.folder}"
    not_it = f"{where} is not the model this expansion was made from"
    prints = source.get("fingerprints")
    if not (isinstance(prints, dict) and prints.get("scheme") == SCHEME):
        return _check_file_hashes(source, base, not_it)
    layers, other = prints.get("layers") or [], prints.get("other") or {}
    if not (
        isinstance(layers, list)
        and all(isinstance(x, str) for x in layers)
        and isinstance(other, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in other.items())
    ):
        raise OtdusError(
            f"{MANIFEST} is damaged (source.fingerprints: layers must be a list of hashes, other a table "
            "of tensor names to hashes); it cannot be trusted"
        )
    made = ["tensor fingerprints"]
    recorded_config = source.get("config")
    if isinstance(recorded_config, dict):
        made.insert(0, "config.json fields")
        difference = _config_difference(base.config, recorded_config)
        if difference:
            raise WrongBase(f"{not_it}: {difference}")
    if len(layers) != base.depth:
        raise WrongBase(f"{where} has {base.depth} layers; the expansion was made from {len(layers)}")
    for layer, recorded in zip(base.layers, layers, strict=True):
        if group_fingerprint(layer) != recorded:
            raise WrongBase(
                f"{not_it}: its layer {layer.index} differs from the recorded fingerprint "
                "(modified or retrained since?)"
            )
    for name, recorded in other.items():
        if name not in base.reader or tensor_fingerprint(base.reader, name) != recorded:
            raise WrongBase(f"{not_it}: its {name} differs from the recorded fingerprint")
    return made


def _check_file_hashes(source: dict, base: LayerStack, not_it: str) -> list[str]:
    made = []
    if source.get("config_sha256"):
        made.append("config.json hash")
        if file_sha256(base.reader.folder / "config.json") != source["config_sha256"]:
            raise WrongBase(f"{not_it}: its config.json differs from the one recorded in {MANIFEST}")
    if source.get("index_sha256"):
        made.append("index hash")
        index = base.reader.folder / base.reader.index_file if base.reader.index_file else None
        if index is None or file_sha256(index) != source["index_sha256"]:
            raise WrongBase(f"{not_it}: its weight index differs from the one recorded in {MANIFEST}")
    return made


# -- static proof ----------------------------------------------------------------------------------------
@dataclass
class LayerFinding:
    index: int  # expanded layer
    copy_of: int | None  # base layer whose tensors it holds, byte for byte (by fingerprint)
    base: bool  # counted as that base layer in the base order (first copy in order)
    identity: bool  # a layer whose zero-init targets are all exactly zero
    claim: str  # what the manifest says, "" without one
    note: str = ""


@dataclass
class StaticProof:
    layers: list[LayerFinding]
    outside_equal: bool  # embeddings, final norm, head: the base's
    preserving: bool
    reason: str  # why the proof fails ("" when it holds)
    claims_preserving: bool | None = None  # what the claimed layer map says (None: no claim)
    base_checks: list[str] = field(default_factory=list)
    claimed: list[dict] | None = None  # the layer map checked (the manifest's, seen from the given base)
    # whether the manifest is what otdus wrote (io/file_hashes.manifest_check); None: there is none
    manifest_check: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def layer_map(self) -> list[dict]:
        """The layer map the proof found, in the manifest's format (for the lockstep comparison)."""
        out = []
        for f in self.layers:
            new = not f.base
            out.append({"index": f.index, "source": f.copy_of, "new": new, "zero_init": new and f.identity})
        return out


# maps each byte to itself but for the sign bit: -0.0 (another tool's `w * 0.0`) is a zero too
_SIGN_CLEARED = bytes(b & 0x7F for b in range(256))


def _all_zero(reader: CheckpointReader, name: str) -> bool:
    """Every element of ``name`` is zero: +0, or for floats -0.0 (little-endian: the sign bit is the
    top bit of each element's last byte)."""
    meta = reader.meta(name)
    width = itemsize(meta.dtype) if meta.dtype.startswith(("F", "BF")) else 0
    nbytes = reader.nbytes(name)
    for offset in range(0, nbytes, _ZERO_CHUNK):  # a multiple of every width: elements stay whole
        chunk = bytearray(reader.read_bytes(name, offset, _ZERO_CHUNK))
        if width:
            chunk[width - 1 :: width] = chunk[width - 1 :: width].translate(_SIGN_CLEARED)
        if chunk.strip(b"\0"):
            return False
    return True


def _identity(stack: LayerStack, index: int) -> bool:
    layer = stack.layers[index]
    targets = [s for s in layer.suffixes() if stack.family.is_zero_target(s)]
    # a derived template's residual scales at 1 (arch/identity.py): a layer is no identity without them
    values = [(s, v) for s in layer.suffixes() if (v := stack.family.identity_value(s)) is not None]
    shapes = {s: layer.shape(s) for s in layer.suffixes()} if values else {}
    # o_proj and a down projection at least: a family without zero targets proves nothing
    return (
        len(targets) >= 2
        and all(_all_zero(stack.reader, layer.name(s)) for s in targets)
        and all(holds(stack.reader.get(layer.name(s)), v, shapes) for s, v in values)
    )


def prove(base: LayerStack, expanded: LayerStack, claimed: Sequence[dict] | None = None) -> StaticProof:
    """Match expanded layers to base layers and decide whether the base function is preserved."""
    indices_of: dict[str, list[int]] = {}
    for lay in base.layers:
        indices_of.setdefault(group_fingerprint(lay), []).append(lay.index)
    findings: list[LayerFinding] = []
    consumed = -1
    for j, layer in enumerate(expanded.layers):
        matches = indices_of.get(group_fingerprint(layer), [])
        claim = ""
        if claimed is not None:
            entry = claimed[j]
            claim = "new" if entry.get("new") else f"copy of base layer {entry.get('source')}"
        in_order = consumed + 1 in matches
        widened_note = ""
        if not in_order and claimed is not None and claimed[j].get("widened") and consumed + 1 < base.depth:
            # otdus widen: base layer i with its experts duplicated (verify/widened.py)
            in_order = is_duplicated_experts(base, consumed + 1, expanded, j)
            widened_note = (
                "widened: its experts are exact copies of the base layer's"
                if in_order
                else "widened with noise: its expert copies differ from the base layer's"
            )
            matches = [consumed + 1] if in_order else matches
        copy_of = consumed + 1 if in_order else (matches[0] if matches else None)
        if in_order:
            consumed += 1
        identity = not in_order and _identity(expanded, j)
        note = ""
        if widened_note:
            note = widened_note
        elif claimed is not None and not claimed[j].get("new") and claimed[j].get("source") not in matches:
            note = f"claimed a copy of base layer {claimed[j].get('source')}, but its tensors differ"
        findings.append(LayerFinding(j, copy_of, in_order, identity, claim, note))

    outside = sorted(base.head + base.tail)
    outside_equal = outside == sorted(expanded.head + expanded.tail) and all(
        _outside_same(base, expanded, n, findings) for n in outside
    )
    reason = ""
    if not outside_equal:
        reason = "embeddings, final norm or head differ from the base's"
    elif consumed != base.depth - 1:
        missing = consumed + 1
        reason = f"base layer {missing} does not appear, in order, as a copy"
    else:
        bad = next((f for f in findings if not f.base and not f.identity), None)
        if bad is not None:
            what = f"a copy of base layer {bad.copy_of}" if bad.copy_of is not None else "new"
            reason = f"layer {bad.index} is {what} and not an identity (its output projections are not zero)"
    claims = None if claimed is None else map_claims_preserving(claimed, base.depth)
    return StaticProof(findings, outside_equal, reason == "", reason, claims)


def _outside_same(base: LayerStack, expanded: LayerStack, name: str, findings: list[LayerFinding]) -> bool:
    """A tensor outside the layers is the base's: the same, or, where it holds a slice per layer (Gemma
    4's per-layer inputs: arch/layer_slices.py), each base layer's slice where the expansion holds that
    layer (a new layer's slice feeds that layer alone, which the layer check judges)."""
    from otdus_cli.arch.layer_slices import slices_of

    before, after = base.reader.meta(name).shape, expanded.reader.meta(name).shape
    sliced = slices_of(tuple(before), tuple(after), len(base.layers), len(expanded.layers))
    if sliced is None:
        return tensor_fingerprint(base.reader, name) == tensor_fingerprint(expanded.reader, name)
    axis, width = sliced.axis, sliced.width
    return all(
        slice_fingerprint(base.reader, name, axis, width, f.copy_of)
        == slice_fingerprint(expanded.reader, name, axis, width, f.index)
        for f in findings
        if f.base and f.copy_of is not None
    )


def map_claims_preserving(entries: Sequence[dict], base_depth: int) -> bool:
    """A layer map describes a function-preserving expansion: base layers once each, in order, and
    every new layer zero-initialised."""
    base_order = [e.get("source") for e in entries if not e.get("new")]
    # a layer widened with noise (otdus widen) does not compute its source layer's function
    noisy = any(e.get("widened") and e.get("noise") != 0 for e in entries)
    return (
        base_order == list(range(base_depth))
        and all(e.get("zero_init") for e in entries if e.get("new"))
        and not noisy
    )


def static_check(
    base: str | os.PathLike[str] | CheckpointReader,
    expanded: str | os.PathLike[str] | CheckpointReader,
    claimed: Sequence[dict] | None = None,
) -> StaticProof:
    """Base identity (when the expanded checkpoint has a manifest), then the static proof against the
    claimed layer map (default: the manifest's; none: inferred from fingerprints)."""
    from otdus_cli.manifest import read_manifest

    base_stack, expanded_stack = open_stack(base), open_stack(expanded)
    manifest = read_manifest(expanded_stack.reader.folder)
    recorded = None if manifest is None else manifest_check(manifest)
    try:
        checks = check_recorded_base(manifest, base_stack)
    except WrongBase:
        # expand then widen: the base may be the first step's source rather than the last's
        first = seen_from_first_source(manifest) if manifest else None
        if first is None:
            raise
        try:
            checks = check_recorded_base(first, base_stack)
        except WrongBase:
            raise WrongBase(
                f"the base {base_stack.reader.folder} is neither the model the last step was made from "
                f"nor the first step's source ({len(manifest['history']) + 1} otdus steps are recorded)"
            ) from None
        manifest = first
        steps = " then ".join([*(r.get("method", "?") for r in manifest["history"]), manifest["method"]])
        checks = [*checks, f"layer map composed through the recorded steps ({steps})"]
    if claimed is None and manifest is not None:
        claimed = manifest["layers"]
    if claimed is not None and len(claimed) != expanded_stack.depth:
        raise OtdusError(
            f"the layer map lists {len(claimed)} layers, the expanded checkpoint has {expanded_stack.depth}"
        )
    sources = [e.get("source") for e in claimed or ()]
    beyond = [i for i in sources if isinstance(i, int) and not 0 <= i < base_stack.depth]
    if beyond:
        raise OtdusError(
            f"the layer map names base layer {beyond[0]}; the base has layers 0..{base_stack.depth - 1}"
        )
    proof = prove(base_stack, expanded_stack, claimed)
    proof.base_checks = checks
    proof.claimed = None if claimed is None else list(claimed)
    proof.manifest_check = recorded
    return proof


def layer_map_from_sources(sources: Sequence[int | None]) -> list[dict]:
    """A layer map from a list such as [0, 1, 2, 2, 3, None]: expanded layer j holds base layer
    sources[j] (its first appearance is that base layer, a repeat is a new copy), None a new layer.
    Whether new layers are identities is for the static proof to find out."""
    seen: set[int] = set()
    out = []
    for j, i in enumerate(sources):
        if i is not None and (not isinstance(i, int) or isinstance(i, bool) or i < 0):
            raise OtdusError(f"layer map entry {j} is {i!r}; give base layer indices or 'new'")
        new = i is None or i in seen
        if i is not None:
            seen.add(i)
        out.append({"index": j, "source": i, "new": new, "zero_init": False})
    return out


def shrink_summary(proof: StaticProof) -> str:
    """One line: what the static check found of a shrink's layer map (no parity is claimed): whether
    each kept layer holds the source layer the map names (by tensor fingerprints, as copies are found)."""
    if proof.claimed is None:  # no layer map to hold the layers to
        return summary(proof)
    claimed = proof.claimed
    kept = [(f, e.get("source")) for f, e in zip(proof.layers, claimed, strict=True) if not e.get("new")]
    wrong = [f.index for f, source in kept if f.copy_of != source]
    merged = len(proof.layers) - len(kept)
    found = (
        f"{len(kept) - len(wrong)} of {len(kept)} kept layer{'s' * (len(kept) != 1)} hold the source layers "
        f"the layer map names, {merged} merged layer{'s' * (merged != 1)} built from several"
    )
    outside = "the source's" if proof.outside_equal else "not the source's"
    line = f"static check of a shrink: {found}; embeddings, final norm and head {outside}"
    if wrong:
        line += f"; layers {', '.join(map(str, wrong))} differ from the source layers the map names"
    return line


def summary(proof: StaticProof) -> str:
    """One line: what the static check found."""
    copies = sum(f.base for f in proof.layers)
    identities = sum(f.identity for f in proof.layers)
    layers = f"{copies} base layer{'s' * (copies != 1)} in order"
    found = f"{layers}, {identities} identity layer{'s' * (identities != 1)}, {len(proof.layers)} in all"
    if proof.preserving:
        return f"static check: function-preserving ({found}; outside the stack: the base's)"
    return f"static check: not shown function-preserving ({found}): {proof.reason}"
