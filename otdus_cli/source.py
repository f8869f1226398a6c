"""The source model of a command that writes one: its argument resolved to a local folder (a path,
or a hub id fetched into the local cache), opened as a layer stack, and the side files an output
carries from it.

Only the files expansion needs are fetched: config, index, the shards the index names, tokenizer
and generation files. With HF_HUB_OFFLINE=1 (or no network) a cached model works and a missing one
is one clear error.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from otdus_cli.arch.family_lookup import family_for
from otdus_cli.bundled import BUNDLED_MODELS
from otdus_cli.errors import OtdusError
from otdus_cli.io.fingerprint import stack_fingerprints
from otdus_cli.io.reader import CheckpointReader, read_json_object
from otdus_cli.io.stack import LayerStack, read_stack
from otdus_cli.manifest import MANIFEST, ManifestSource, read_manifest

# Small files worth carrying to the expanded model (everything else a repo holds is left behind).
SIDE_FILE_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template.*",
    "preprocessor_config.json",
    "LICENSE*",
    "NOTICE*",
    "USE_POLICY*",
]
# fetched with the side files, but written by otdus itself for the output
_NOT_SIDE_FILES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", MANIFEST}
# the hub's rules for "owner/name": letters, digits, "-", "_", "."; neither part starts or ends with
# "-" or ".", nor holds "--" or ".."; at most 96 characters
_HUB_PART = r"[A-Za-z0-9_](?:[\w.\-]*[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^{_HUB_PART}/{_HUB_PART}$")


def is_hub_id(text: str) -> bool:
    return len(text) <= 96 and "--" not in text and ".." not in text and _HUB_ID.match(text) is not None


_DRIVE = re.compile(r"^[A-Za-z]:")


def looks_local(text: str) -> bool:
    """Whether a model argument is meant as a path, never a hub id ("owner/name"): it starts with
    ".", "/", "~" or a drive ("C:"), holds a backslash or more than one "/", ends with a separator, or
    the folder it would sit in exists here (``out/nothere`` beside an ``out/`` folder)."""
    if text.startswith((".", "/", "~")) or _DRIVE.match(text) or "\\" in text:
        return True
    if text.count("/") > 1 or text.endswith("/"):
        return True
    parent = Path(text).parent
    return parent != Path(".") and parent.is_dir()


@dataclass(frozen=True)
class ResolvedSource:
    folder: Path
    id: str  # what the user gave: a hub id, a folder path or a bundled name
    revision: str | None  # resolved commit for hub models
    kind: str = "local"  # "local", "hub" or "bundled": how the id is to be resolved again


def resolve_source(model: str, revision: str | None = None, kind: str | None = None) -> ResolvedSource:
    """A folder for a model argument. ``kind`` ("local", "hub", "bundled") pins how it is read, as a
    manifest records it; by default a bundled name, then an existing path, then a hub id."""
    if model in BUNDLED_MODELS and kind in (None, "bundled"):
        _no_revision(model, revision, "a bundled model")
        return ResolvedSource(BUNDLED_MODELS[model], model, None, "bundled")
    if kind == "bundled":
        raise OtdusError(f"{model} is not a model bundled with this otdus version")
    path = Path(model).expanduser()
    if kind == "hub":
        return _download(model, revision)
    if path.exists():
        if not path.is_dir():
            raise OtdusError(f"{model} is a file; give the model folder")
        _no_revision(model, revision, "a local folder")
        return ResolvedSource(path, str(path), None)
    if looks_local(model) or not is_hub_id(model):
        raise OtdusError(f"model folder not found: {model}")
    return _download(model, revision)


def _no_revision(model: str, revision: str | None, what: str) -> None:
    """--revision picks a hub commit: on anything else it would be silently ignored."""
    if revision is not None:
        raise OtdusError(
            f"--revision {revision} names a hub revision, but {model} is {what}; leave --revision out"
        )


def _download(repo_id: str, revision: str | None) -> ResolvedSource:
    if not is_hub_id(repo_id):
        raise OtdusError(f"{repo_id!r} is not a Hugging Face hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        raise OtdusError("huggingface_hub is required to download models") from None
    try:
        # the model card too: its licence and base go into the output's card (card.py); never copied
        side = [*SIDE_FILE_PATTERNS, "README.md"]
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=side))
        shards = _weight_files(folder)
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=shards))
        if shards == ["model.safetensors"] and not (folder / "model.safetensors").is_file():
            # an old repo with only a pickle checkpoint (read later with weights_only=True)
            folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=["pytorch_model.bin"]))
    except LocalEntryNotFoundError as exc:
        refused = _access_refused(repo_id, exc.__cause__)
        if refused:
            raise OtdusError(refused) from None
        raise OtdusError(
            f"{repo_id} is not in the local Hugging Face cache and the hub cannot be reached "
            "(offline?); download it once with network access, or give a local folder"
        ) from None
    except HfHubHTTPError as exc:
        refused = _access_refused(repo_id, exc)
        if refused:
            raise OtdusError(refused) from None
        raise OtdusError(f"cannot fetch {repo_id} from the hub: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise OtdusError(f"cannot fetch {repo_id}: {exc}") from None
    return ResolvedSource(folder, repo_id, folder.name, "hub")


def _access_refused(repo_id: str, exc: BaseException | None) -> str | None:
    """What to do when the hub refuses access (HTTP 401/403): gated, private or not logged in."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if not isinstance(exc, HfHubHTTPError):
        return None
    status = getattr(exc.response, "status_code", None)
    login = "log in with `hf auth login` or set HF_TOKEN (a token with read access)"
    local = "or give a local folder holding the model"
    if isinstance(exc, GatedRepoError):
        return (
            f"{repo_id} is a gated repository and the hub refused access (HTTP {status}): accept its "
            f"licence on https://huggingface.co/{repo_id} with your account, {login} for that account, "
            f"{local}"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"{repo_id} was not found on the hub (HTTP {status}); if it is private or gated, {login}, {local}"
        )
    if status in (401, 403):
        return f"the hub refused access to {repo_id} (HTTP {status}); {login}, {local}"
    return None


def _weight_files(folder: Path) -> list[str]:
    """The weight files to fetch: those an index names, else the single-file checkpoint."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise OtdusError(f"{index_name} of the downloaded model is corrupt (no weight_map)")
            return sorted({str(v) for v in weight_map.values()})
    return ["model.safetensors"]


@dataclass
class SourceModel(LayerStack):
    """The source checkpoint of a command: its layer stack and where it came from."""

    resolved: ResolvedSource


def open_source(model: str, revision: str | None = None, allow_unknown_arch: bool = False) -> SourceModel:
    resolved = resolve_source(model, revision)
    reader = CheckpointReader(resolved.folder)
    stack = read_stack(reader, family_for(reader.config, allow_unknown_arch))
    return SourceModel(**vars(stack), resolved=resolved)


def readable_side_files(source_folder: Path) -> list[Path]:
    """The source's files an output carries (tokenizer, generation config, licence ...), each checked
    readable now: one that is not must stop the run before any tensor is written, not after."""
    try:
        listed = sorted(source_folder.iterdir())
    except OSError as exc:
        raise OtdusError(f"cannot list the model folder {source_folder} ({exc.strerror})") from None
    found = []
    for path in listed:
        if not path.is_file() or path.name in _NOT_SIDE_FILES:
            continue
        if any(fnmatch.fnmatch(path.name, p) for p in SIDE_FILE_PATTERNS):
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as exc:
                raise OtdusError(f"cannot read {path} ({exc.strerror}); nothing was written") from None
            found.append(path)
    return found


def copy_side_files(source_folder: Path, folder: Path) -> list[str]:
    """Copy the source's side files into ``folder``; their names."""
    copied = []
    for path in readable_side_files(source_folder):
        shutil.copyfile(path, folder / path.name)  # follows hub-cache symlinks
        copied.append(path.name)
    return copied


def source_record(src: SourceModel) -> ManifestSource:
    """What a manifest records of its source, so verify can tell whether a base is that model."""
    return ManifestSource(
        id=src.resolved.id,
        revision=src.resolved.revision,
        # a hub source is found again by id and revision (through the cache): no path of this machine
        **({} if src.resolved.kind == "hub" else {"path": str(src.resolved.folder.absolute())}),
        model_type=src.config.get("model_type"),
        family=src.family.name,
        num_hidden_layers=src.depth,
        **({"zero_init_proof": src.family.zero_init_proof} if src.family.zero_init_proof else {}),
        **({"roles_proof": src.family.roles_proof} if src.family.roles_proof else {}),
        kind=src.resolved.kind,
        **src.reader.fingerprint(),
        fingerprints=stack_fingerprints(src),
        config=src.config,
    )


def earlier_steps(src: SourceModel) -> list[dict] | None:
    """The records of the otdus steps that made a local source (its manifest, after the steps it
    records itself): what ``history`` keeps, so a chain (expand, expand; expand, widen ...) names
    every step and verify can check it against the first source. None for a source otdus did not make."""
    earlier = read_manifest(src.resolved.folder) if src.resolved.kind == "local" else None
    if not earlier:
        return None
    return [*(earlier.get("history") or []), {k: v for k, v in earlier.items() if k != "history"}]
