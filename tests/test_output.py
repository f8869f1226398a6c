"""otdus_cli/output.py: the staged write every otdus output goes through, driven here by a command
of the test's own (drop the last decoder layer) as a new command would drive it, and the typed
manifest it writes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from otdus_cli.errors import Interrupted, OtdusError
from otdus_cli.io.file_hashes import file_changes
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.io.writer import PlannedTensor, ShardedWriter
from otdus_cli.manifest import (
    MANIFEST,
    Manifest,
    ManifestLayer,
    ManifestSource,
    created_now,
    read_manifest,
)
from otdus_cli.output import ConfigCheck, Finished, RankWrite, write_output
from otdus_cli.source import SourceModel, open_source, source_record


@dataclass
class DropLast:
    """A plan (output.OutputPlan) that keeps every tensor but those of the last decoder layer."""

    source: SourceModel
    config: dict
    tensors: list[PlannedTensor]


def _plan(folder: Path) -> DropLast:
    source = open_source(str(folder))
    dropped = set(source.layers[-1].name(s) for s in source.layers[-1].suffixes())
    names = [n for n in source.reader.names if n not in dropped]
    tensors = [PlannedTensor(n, source.reader.meta(n).dtype, source.reader.meta(n).shape) for n in names]
    return DropLast(source, {**source.config, "num_hidden_layers": source.depth - 1}, tensors)


def _copy_all(plan: DropLast, writer: ShardedWriter) -> RankWrite[None]:
    for t in plan.tensors:
        writer.copy_raw(t.name, plan.source.reader.raw(t.name))
    return RankWrite(None, None)


def _manifest(plan: DropLast, finished: Finished[None]) -> Manifest:
    depth = plan.source.depth - 1
    return Manifest(
        **created_now(),
        source=source_record(plan.source),
        method="drop-last",
        num_hidden_layers=depth,
        layers=[ManifestLayer(index=i, source=i, new=False) for i in range(depth)],
        copied_files=finished.copied_files,
        warnings=[],
    )


def _no_config_check(plan: DropLast, folder: Path) -> ConfigCheck:
    return ConfigCheck("otdus depth rules")


def _left_beside(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if "otdus-" in p.name)


def test_a_command_of_its_own_writes_a_whole_output(stories, tmp_path):
    out = tmp_path / "out"
    written = write_output(
        out, lambda: _plan(stories), _copy_all, _no_config_check, _manifest, max_shard_size="100KB"
    )
    source = CheckpointReader(stories)
    result = CheckpointReader(out)
    assert written.out == out and not written.replaced and written.reports == [None]
    assert (
        json.loads((out / "config.json").read_text())["num_hidden_layers"]
        == source.config["num_hidden_layers"] - 1
    )
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    assert sorted(result.names) == sorted(t.name for t in written.plan.tensors)
    for name in result.names:  # the bytes of the source's tensors
        assert result.read_bytes(name, 0, result.nbytes(name)) == source.read_bytes(
            name, 0, source.nbytes(name)
        )
    for side in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / side).read_bytes() == (stories / side).read_bytes()
    manifest = read_manifest(out)
    assert manifest == written.manifest
    assert manifest["copied_files"] == sorted(
        ["LICENSE", "generation_config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    )
    # every other file recorded with the hash --force checks, the card among them
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} - {MANIFEST}
    assert file_changes(out, manifest["files"]) == []
    assert manifest["card"]["sha256"] == manifest["files"]["README.md"]["sha256"]
    # the keys the command set, in the model's order; the ones it did not set are not written
    assert list(manifest) == [
        "otdus_version", "created", "source", "method", "num_hidden_layers", "layers", "copied_files",
        "warnings", "card", "files", "manifest_sha256",
    ]  # fmt: skip
    assert _left_beside(tmp_path) == []


@pytest.mark.parametrize(
    ("failure", "raised"),
    [(OtdusError("the command failed"), OtdusError), (KeyboardInterrupt(), Interrupted)],
)
def test_a_write_that_fails_half_way_leaves_nothing(stories, tmp_path, failure, raised):
    def half(plan: DropLast, writer: ShardedWriter) -> RankWrite[None]:
        for t in plan.tensors[: len(plan.tensors) // 2]:
            writer.copy_raw(t.name, plan.source.reader.raw(t.name))
        raise failure

    with pytest.raises(raised):
        write_output(
            tmp_path / "out", lambda: _plan(stories), half, _no_config_check, _manifest, max_shard_size="5GB"
        )
    assert not (tmp_path / "out").exists()
    assert _left_beside(tmp_path) == []


def test_a_write_that_misses_a_planned_tensor_fails(stories, tmp_path):
    def short(plan: DropLast, writer: ShardedWriter) -> RankWrite[None]:
        for t in plan.tensors[1:]:
            writer.copy_raw(t.name, plan.source.reader.raw(t.name))
        return RankWrite(None, None)

    with pytest.raises(RuntimeError, match="never written"):
        write_output(
            tmp_path / "out", lambda: _plan(stories), short, _no_config_check, _manifest, max_shard_size="5GB"
        )
    assert not (tmp_path / "out").exists()
    assert _left_beside(tmp_path) == []


def test_the_manifest_writes_its_keys_in_order_and_method_sections_after_transport():
    manifest = Manifest(
        otdus_version="0",
        source=ManifestSource(id="m", revision=None, kind="local"),
        method="ot",
        num_hidden_layers=1,
        layers=[ManifestLayer(index=0, source=0, new=False, widened=True)],
        copied_files=[],
        transport={"0": {"cost": 1.5}},
        method_sections={"ot_choices": {"zero": 1}, "lesa": {"check": 2}},
        function_preserving=True,
    )
    written = manifest.to_json()
    assert list(written) == [
        "otdus_version", "source", "method", "num_hidden_layers", "function_preserving", "layers",
        "transport", "ot_choices", "lesa", "copied_files",
    ]  # fmt: skip
    assert written["source"] == {"id": "m", "revision": None, "kind": "local"}  # None set: written
    assert written["layers"] == [{"index": 0, "source": 0, "new": False, "widened": True}]
    # read back, the sections are extra keys in place; what was written is what is read
    assert Manifest.model_validate(written).to_json() == written
    assert list(Manifest.model_validate(written).to_json()) == list(written)
