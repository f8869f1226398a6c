"""End-to-end expansions of real-format checkpoints, checked the way users load them."""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from otdus_cli.bundled import STORIES260K
from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.options import ExpandOptions
from tests.support.expansion_checks import (
    BUILT_METHODS,
    COPY_METHODS,
    EXPECTED_PRESERVING,
    assert_layers_match_sources,
    assert_random_layers,
    base_reference,
    check_expansion,
    expected_sources,
    method_options,
)
from tests.support.tiny_models import (
    DENSE_TYPES,
    MOE_TYPES,
    TINY_CONFIGS,
    load_causal_lm,
    logits,
    quick_or_slow,
)


@pytest.mark.parametrize("model_type", DENSE_TYPES + MOE_TYPES)
@pytest.mark.parametrize("method", COPY_METHODS + BUILT_METHODS)
def test_every_family_and_method(tiny_models, tmp_path, model_type, method):
    manifest = check_expansion(tiny_models[model_type], tmp_path / "out", method)
    assert manifest["source"]["family"]


@pytest.mark.parametrize("model_type", DENSE_TYPES + MOE_TYPES)
@pytest.mark.parametrize("method", ["average", "copy", "random"])
def test_zero_init_makes_any_method_function_preserving(tiny_models, tmp_path, model_type, method):
    manifest = check_expansion(tiny_models[model_type], tmp_path / "out", method, zero_init=True)
    assert manifest["function_preserving"]


# llama-pro, solar and stack fix their own placement; the others take every --position
STORIES_CASES = [(m, "top") for m in ("llama-pro", "solar", "stack")] + [
    (m, p)
    for m in ("copy", "average", "interpose", "random", "ot")
    for p in ("top", "bottom", "mid", "top-bottom")
]


@pytest.mark.parametrize("method, position", STORIES_CASES)
def test_stories260k_every_method_and_position(stories, tmp_path, method, position):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    result = expand(str(stories), out, method_options(method, 5, position=position))
    model = load_causal_lm(out)
    assert model.config.num_hidden_layers == len(result.plan.layer_map)
    assert_layers_match_sources(stories, out, result.manifest)
    preserving = EXPECTED_PRESERVING.get(method, False)
    assert result.plan.function_preserving == preserving
    assert torch.equal(base_reference(STORIES260K)[1], logits(model)) == preserving
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("Once upon a time").input_ids[0] == 1


def _expected_fingerprints(folder: Path) -> dict:
    """io/fingerprint.py's scheme recomputed from the safetensors file (every stories260K tensor is
    under 1 MiB, so each is hashed whole: dtype, shape, bytes)."""
    from safetensors import safe_open

    def fp(name: str, f) -> str:
        t = f.get_tensor(name)
        code = {torch.float32: "F32"}[t.dtype]
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        return hashlib.sha256(f"{code}{list(t.shape)}".encode() + data).hexdigest()[:32]

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        layers = []
        for i in range(5):
            prefix = f"model.layers.{i}."
            parts = sorted(n[len(prefix) :] for n in names if n.startswith(prefix))
            joined = "".join(f"{p}={fp(prefix + p, f)};" for p in parts)
            layers.append(hashlib.sha256(joined.encode()).hexdigest()[:32])
        other = {n: fp(n, f) for n in sorted(names) if not n.startswith("model.layers.")}
    return {"scheme": "sampled-sha256-v1", "layers": layers, "other": other}


def test_new_parameters_and_layer_map_in_manifest(stories, tmp_path):
    import hashlib

    from otdus_cli import __version__

    # side files a release carries: a licence and a chat template travel; other files do not
    (stories / "LICENSE").write_text("MIT License\n")
    (stories / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (stories / "notes.txt").write_text("not part of the model")
    options = ExpandOptions(method="copy", layers=2, zero_init=True)
    result = expand(str(stories), tmp_path / "out", options)
    m = result.manifest
    assert m == json.loads((tmp_path / "out" / "otdus.json").read_text())
    assert [lay["index"] for lay in m["layers"] if lay["new"]] == [3, 5]
    new_layer = [s.removeprefix("model.layers.2.") for s in CheckpointReader(stories).names if ".2." in s]
    assert m["new_parameters"] == [f"model.layers.{i}.{s}" for i in (3, 5) for s in sorted(new_layer)]
    assert len(m["new_parameters"]) == 2 * 9
    assert m["otdus_version"] == __version__
    assert m["source"] == {
        "id": str(stories),
        "revision": None,
        "path": str(stories.absolute()),
        "model_type": "llama",
        "family": "llama",
        "num_hidden_layers": 5,
        "kind": "local",
        "config_sha256": hashlib.sha256((stories / "config.json").read_bytes()).hexdigest(),
        "index_sha256": None,  # a single-file checkpoint has no index
        "fingerprints": _expected_fingerprints(stories),
        "config": json.loads((stories / "config.json").read_text()),
    }
    assert m["method"] == "copy" and m["options"] == options.model_dump()
    assert m["options"]["layers"] == 2 and m["options"]["zero_init"] is True
    assert m["num_hidden_layers"] == 7 and m["function_preserving"] is True
    assert m["config_checked_by_transformers"] is True and m["warnings"] == [] and m["transport"] == {}
    side = ["LICENSE", "chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer.model"]
    assert m["copied_files"] == sorted([*side, "tokenizer_config.json"])
    for name in m["copied_files"]:
        assert (tmp_path / "out" / name).read_bytes() == (stories / name).read_bytes(), name
    assert not (tmp_path / "out" / "notes.txt").exists()
    # README.md is the new model's card (card.py), never the source's own README
    card = (tmp_path / "out" / "README.md").read_text()
    assert card.startswith("---\n") and (stories / "README.md").read_text() not in card
    new = [lay for lay in m["layers"] if lay["new"]]
    assert new[0] == dict(index=3, source=2, new=True, parents=[2], builder="copy", zero_init=True)


def test_manifest_records_the_index_hash_of_a_sharded_source(sharded_llama, tmp_path):
    import hashlib

    result = expand(str(sharded_llama), tmp_path / "out", ExpandOptions(method="copy", layers=1))
    index = sharded_llama / "model.safetensors.index.json"
    assert result.manifest["source"]["index_sha256"] == hashlib.sha256(index.read_bytes()).hexdigest()


def test_zero_init_targets_are_zero_and_others_copied(stories, tmp_path):
    expand(str(stories), tmp_path / "out", ExpandOptions(method="llama-pro", layers=5))
    r = CheckpointReader(tmp_path / "out")
    assert not r.get("model.layers.1.self_attn.o_proj.weight").any()
    assert not r.get("model.layers.1.mlp.down_proj.weight").any()
    src = CheckpointReader(stories)
    assert torch.equal(
        r.get("model.layers.1.mlp.up_proj.weight"), src.get("model.layers.0.mlp.up_proj.weight")
    )


def test_average_is_the_mean_of_the_pair(stories, tmp_path):
    expand(str(stories), tmp_path / "out", ExpandOptions(method="average", layers=1))
    r, src = CheckpointReader(tmp_path / "out"), CheckpointReader(stories)
    a, b = src.get("model.layers.3.mlp.up_proj.weight"), src.get("model.layers.4.mlp.up_proj.weight")
    assert torch.equal(r.get("model.layers.4.mlp.up_proj.weight"), (a + b) * 0.5)


def test_multi_shard_round_trip(sharded_llama, tmp_path):
    assert (sharded_llama / "model.safetensors.index.json").is_file()
    out = tmp_path / "out"
    expand(str(sharded_llama), out, ExpandOptions(method="llama-pro", layers=2, max_shard_size="30KB"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == CheckpointReader(out).total_bytes()
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(out / shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                assert index["weight_map"][name] == shard

    def rank(name: str) -> int:  # embeddings, then layer 0, 1, ..., then the final norm and head
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return 1 + int(m.group(1)) if m else (0 if "embed" in name else 10**6)

    in_file_order = []
    for shard in shards:  # shards in turn, each shard's tensors by byte offset
        raw = (out / shard).read_bytes()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        header.pop("__metadata__")
        in_file_order += sorted(header, key=lambda n: header[n]["data_offsets"][0])
    ranks = [rank(n) for n in in_file_order]
    assert (
        ranks == sorted(ranks)
        and len(set(ranks)) == 2 + 6
        and sorted(in_file_order) == sorted(index["weight_map"])
    )
    assert torch.equal(logits(load_causal_lm(sharded_llama)), logits(load_causal_lm(out)))


def test_early_writeback_keeps_every_byte(sharded_llama, tmp_path, monkeypatch):
    """The writer has a helper thread start the disk writes of its shards while it copies
    (sync_file_range); with a step of one byte it is asked after every tensor, and every byte of
    the multi-shard output is still the source's."""
    import threading

    from otdus_cli.io import writer

    started: list[tuple[int, str]] = []
    real = writer._start_writeback

    def spy(fd: int) -> None:
        started.append((fd, threading.current_thread().name))
        real(fd)

    monkeypatch.setattr(writer, "WRITEBACK_STEP", 1)
    monkeypatch.setattr(writer, "_start_writeback", spy)
    out = tmp_path / "out"
    options = ExpandOptions(method="llama-pro", layers=2, max_shard_size="30KB")
    result = expand(str(sharded_llama), out, options)
    assert any(name == "otdus-writeback" for _, name in started), started  # the helper thread ran
    assert len({fd for fd, _ in started}) > 2  # and every shard was flushed before the fsyncs
    assert not any(t.name == "otdus-writeback" for t in threading.enumerate())  # joined
    assert_layers_match_sources(sharded_llama, out, result.manifest)


def assert_values_converted(src: Path, out: Path, manifest: dict, dtype: torch.dtype) -> None:
    """Every output tensor is its source tensor rounded to `dtype` (for copy-type layers)."""
    a, b = CheckpointReader(src), CheckpointReader(out)
    layers = manifest["layers"]
    sources = {f"model.layers.{lay['index']}.": f"model.layers.{lay['source']}." for lay in layers}
    for name in b.names:
        got = b.get(name)
        assert got.dtype == dtype, name
        layer = next((p for p in sources if name.startswith(p)), None)
        src_name = sources[layer] + name[len(layer) :] if layer else name
        assert torch.equal(got.view(torch.uint8), a.get(src_name).to(dtype).view(torch.uint8)), name


def test_dtype_conversion_and_bf16_source(stories, tmp_path):
    result = expand(str(stories), tmp_path / "bf16", ExpandOptions(method="copy", layers=1, dtype="bfloat16"))
    r = CheckpointReader(tmp_path / "bf16")
    assert {r.meta(n).dtype for n in r.names} == {"BF16"}
    assert_values_converted(stories, tmp_path / "bf16", result.manifest, torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    # a bf16 source keeps bf16: its layers stay byte-identical, the new one is the bf16 of the mean
    result = expand(str(tmp_path / "bf16"), tmp_path / "bf16b", ExpandOptions(method="average", layers=1))
    r2 = CheckpointReader(tmp_path / "bf16b")
    assert {r2.meta(n).dtype for n in r2.names} == {"BF16"}
    assert_layers_match_sources(tmp_path / "bf16", tmp_path / "bf16b", result.manifest)
    (new,) = [lay for lay in result.manifest["layers"] if lay["new"]]
    assert new["parents"] == [4, 5]
    for suffix in ("mlp.up_proj.weight", "input_layernorm.weight"):
        a, b = (r.get(f"model.layers.{i}.{suffix}").float() for i in new["parents"])
        got = r2.get(f"model.layers.{new['index']}.{suffix}")
        assert torch.equal(got, ((a + b) * 0.5).to(torch.bfloat16)), suffix


def test_dtype_float16_through_the_cli(stories, tmp_path):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    out = tmp_path / "fp16"
    args = ["expand", str(stories), "--out", str(out), "--method", "copy", "--layers", "1"]
    result = CliRunner().invoke(app, [*args, "--dtype", "float16"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "otdus.json").read_text())
    assert manifest["options"]["dtype"] == "float16"
    assert_values_converted(stories, out, manifest, torch.float16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"


def test_pickle_checkpoint_loads_weights_only(stories, tmp_path):
    from safetensors.torch import load_file

    src = tmp_path / "bin"
    src.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (src / f).write_bytes((stories / f).read_bytes())
    torch.save(load_file(str(stories / "model.safetensors")), src / "pytorch_model.bin")
    expand(str(src), tmp_path / "out", ExpandOptions(method="llama-pro", layers=5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(logits(load_causal_lm(stories)), logits(load_causal_lm(tmp_path / "out")))


def test_pickle_checkpoint_that_runs_code_is_refused(stories, tmp_path):
    """A pickle that calls a non-allowlisted global (here open(marker, "w"), which creates a file)
    is refused by weights_only loading: one error line, no code run, no output, no advice to
    turn weights_only off."""
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    src = tmp_path / "bin"
    src.mkdir()
    (src / "config.json").write_bytes((stories / "config.json").read_bytes())
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "x": Payload()}, src / "pytorch_model.bin")
    for command in (["plan", str(src)], ["expand", str(src), "--out", str(tmp_path / "o")]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: pytorch_model.bin: cannot load safely"), lines
        assert "weights_only=False" not in result.output and "Traceback" not in result.output
        assert not marker.exists()
    assert not (tmp_path / "o").exists()
    # the payload is real: an unsafe load runs it
    torch.load(src / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_input_is_never_modified(stories, tmp_path):
    before = {p.name: p.read_bytes() for p in stories.iterdir()}
    expand(str(stories), tmp_path / "out", ExpandOptions(method="average"))
    assert {p.name: p.read_bytes() for p in stories.iterdir()} == before


def test_tiny_configs_cover_every_family():
    from otdus_cli.arch.family_lookup import supported_model_types

    # Mllama's text model is built inside its wrapper (tests/test_wrappers.py): transformers builds no
    # causal LM from a bare mllama_text_model config
    assert set(supported_model_types()) == set(TINY_CONFIGS) | {"mllama_text_model"}


@pytest.mark.parametrize("model_type", quick_or_slow(DENSE_TYPES))
@pytest.mark.parametrize("variant", ["paper", "structured", "official"])
def test_ot_every_dense_family_is_an_exact_identity(tiny_models, tmp_path, model_type, variant):
    depth = json.loads((tiny_models[model_type] / "config.json").read_text())["num_hidden_layers"]
    opts = ExpandOptions(method="ot", layers=1 if variant == "official" else depth // 2)
    opts.ot.variant = variant
    result = expand(str(tiny_models[model_type]), tmp_path / "out", opts)
    assert result.plan.function_preserving
    assert torch.equal(base_reference(tiny_models[model_type])[1], logits(load_causal_lm(tmp_path / "out")))
    assert_layers_match_sources(tiny_models[model_type], tmp_path / "out", result.manifest)
    stats = result.manifest["transport"]
    assert stats and all(v["variant"] == variant for v in stats.values())


def test_ot_stories260k_is_deterministic_and_preserving(stories, tmp_path):
    for name in ("a", "b"):
        expand(str(stories), tmp_path / name, ExpandOptions(method="ot"))
    files = ["model.safetensors"]
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    assert torch.equal(logits(load_causal_lm(stories)), logits(load_causal_lm(tmp_path / "a")))


def test_unconverged_transport_is_reported(tmp_path):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    result = CliRunner().invoke(
        app, ["expand", "bundled:stories260k", "--out", str(tmp_path / "o"), "--max-iter", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["transport_warnings"] and "max_iter" in summary["transport_warnings"][0]
    assert "warning:" in result.stderr


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_reader_reads_row_ranges_of_a_tensor(sharded_llama, stories, tmp_path, fmt):
    folder = sharded_llama
    if fmt == "bin":  # a pickle checkpoint: rows sliced from the memory-mapped tensor
        from safetensors.torch import load_file

        folder = tmp_path / "bin"
        folder.mkdir()
        (folder / "config.json").write_bytes((stories / "config.json").read_bytes())
        torch.save(load_file(str(stories / "model.safetensors")), folder / "pytorch_model.bin")
    reader = CheckpointReader(folder)
    for name in reader.names:
        whole = reader.get(name)
        if whole.dim() == 0:
            continue
        rows = len(whole)
        for start, stop in ((0, rows), (1, max(1, rows - 1)), (rows - 1, rows + 5), (rows, rows)):
            assert torch.equal(reader.get_rows(name, start, stop), whole[start:stop]), (name, start, stop)


def test_planning_does_not_import_torch(stories):
    """`otdus plan` / `inspect` and the copy path read headers and move bytes: importing torch
    (seconds) is left to the commands that compute with tensors."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from otdus_cli.cli import app\n"
        "from otdus_cli.expand import make_plan\n"
        "from otdus_cli.source import open_source\n"
        "from otdus_cli.options import ExpandOptions\n"
        f"make_plan(open_source({str(stories)!r}), ExpandOptions(method='copy'))\n"
        "assert 'torch' not in sys.modules, 'planning imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


_RUN_OTDUS_AND_LIST_IMPORTS = """
import atexit, json, sys
heavy = ("torch", "transformers", "numpy", "safetensors", "accelerate")
atexit.register(lambda: print(json.dumps(sorted(m for m in heavy if m in sys.modules))))
sys.argv = ["otdus", *sys.argv[1:]]
from otdus_cli.entry import main
main()
"""


def test_a_copy_expansion_imports_neither_transformers_nor_torch(stories, tmp_path):
    """`otdus expand --method solar` of a llama (transformers derives nothing from its depth), run as
    the console script runs it: otdus's depth rules check the config, and the process never imports
    torch, transformers or numpy (seconds of start-up), neither before the first byte moves nor
    after; every byte is the source's, and the output loads with transformers at the new depth."""
    import subprocess
    import sys

    out = tmp_path / "out"
    argv = ["expand", str(stories), "--out", str(out), "--method", "solar", "--layers", "3", "--json"]
    done = subprocess.run(
        [sys.executable, "-c", _RUN_OTDUS_AND_LIST_IMPORTS, *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    *report, imported = done.stdout.strip().splitlines()
    assert json.loads(imported) == []
    timings = json.loads("\n".join(report))["timings"]
    assert timings["config_check"] == "otdus depth rules"
    assert 0 < timings["startup_cpu_s"] <= timings["startup_s"] * 2 + 0.1, timings  # <= 2 cores busy
    manifest = json.loads((out / "otdus.json").read_text())
    assert manifest["config_check"] == "otdus depth rules" and manifest["warnings"] == []
    assert_layers_match_sources(stories, out, manifest)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out).num_hidden_layers == 8
    assert len(load_causal_lm(out).model.layers) == 8


def test_a_built_expansion_still_imports_torch(stories, tmp_path):
    """The counterpart that keeps the test above honest: the same harness sees torch imported when
    a method computes tensors (average)."""
    import subprocess
    import sys

    argv = ["expand", str(stories), "--out", str(tmp_path / "out"), "--method", "average", "--json"]
    done = subprocess.run(
        [sys.executable, "-c", _RUN_OTDUS_AND_LIST_IMPORTS, *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch" in json.loads(done.stdout.strip().splitlines()[-1])


def test_zero_init_tensors_are_allocated_not_written(stories, tmp_path, monkeypatch):
    """LLaMA-Pro's zeroed o_proj/down_proj: the writer allocates the never-written range
    (posix_fallocate) instead of writing zeros: the process writes that many fewer bytes, the file
    is not sparse (its blocks cover its size) and the tensors read as zeros. Where the filesystem
    refuses, zeros are written as before, and the files are byte for byte the same."""
    import errno
    import os

    def written_by_this_process() -> int:  # bytes passed to write calls (/proc/self/io wchar)
        return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["wchar"])

    options = ExpandOptions(method="llama-pro", layers=5)
    expand(str(stories), tmp_path / "first", options)  # what a first run writes once (caches) is not counted
    before = written_by_this_process()
    result = expand(str(stories), tmp_path / "out", options)
    allocated_run = written_by_this_process() - before
    shard = tmp_path / "out" / "model.safetensors"
    assert shard.stat().st_blocks * 512 >= shard.stat().st_size
    assert_layers_match_sources(stories, tmp_path / "out", result.manifest)

    def refuse(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    before = written_by_this_process()
    expand(str(stories), tmp_path / "again", options)
    written_run = written_by_this_process() - before
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == shard.read_bytes()
    reader = CheckpointReader(tmp_path / "out")
    zero_bytes = sum(
        reader.nbytes(n)
        for n in reader.names
        if n.endswith(("o_proj.weight", "down_proj.weight")) and not reader.get(n).view(torch.uint8).any()
    )
    assert zero_bytes > 0 and written_run - allocated_run >= zero_bytes, (written_run, allocated_run)


def test_unknown_architecture_expands_by_copy_when_allowed(stories, tmp_path):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    cfg = json.loads((stories / "config.json").read_text())
    cfg["model_type"] = "mystery"  # transformers cannot load this config: the check is skipped, and said so
    (stories / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    args = ["expand", str(stories), "--out", str(out), "--method", "copy", "--allow-unknown-arch", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["family"] == "generic" and summary["num_hidden_layers"] == 7
    assert len(summary["warnings"]) == 1 and "mystery" in summary["warnings"][0]
    assert "not load-checked" in summary["warnings"][0] and "warning:" in result.stderr
    manifest = json.loads((out / "otdus.json").read_text())
    assert manifest["config_checked_by_transformers"] is False and manifest["warnings"] == summary["warnings"]
    written = json.loads((out / "config.json").read_text())
    assert written == {**cfg, "num_hidden_layers": 7}
    assert [lay["source"] for lay in manifest["layers"]] == expected_sources("copy", 5)
    assert_layers_match_sources(stories, out, manifest)


def test_uniform_position_through_the_cli(tiny_models, tmp_path):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    src = tiny_models["llama"]
    for layers, sources in ((2, [0, 1, 1, 2, 3, 3]), (4, [0, 0, 1, 1, 2, 2, 3, 3])):
        out = tmp_path / f"u{layers}"
        args = ["expand", str(src), "--out", str(out), "--method", "copy", "--position", "uniform"]
        result = CliRunner().invoke(app, [*args, "--layers", str(layers), "--zero-init", "--json"])
        assert result.exit_code == 0, result.output
        manifest = json.loads((out / "otdus.json").read_text())
        assert [lay["source"] for lay in manifest["layers"]] == sources and manifest["function_preserving"]
        assert_layers_match_sources(src, out, manifest)
        assert torch.equal(base_reference(src)[1], logits(load_causal_lm(out)))


def test_random_init_statistics_and_seed(stories, tmp_path):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    cfg = json.loads((stories / "config.json").read_text())
    cfg["initializer_range"] = 0.05  # the scale is read from the config, not assumed
    (stories / "config.json").write_text(json.dumps(cfg))

    def run(name: str, seed: str) -> tuple[Path, dict]:
        args = ["expand", str(stories), "--out", str(tmp_path / name), "--method", "random", "--layers", "2"]
        result = CliRunner().invoke(app, [*args, "--seed", seed])
        assert result.exit_code == 0, result.output
        return tmp_path / name, json.loads((tmp_path / name / "otdus.json").read_text())

    a, manifest = run("a", "7")
    assert_random_layers(a, manifest, cfg)
    assert_layers_match_sources(stories, a, manifest)
    b, _ = run("b", "7")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    c, _ = run("c", "8")
    ra, rc = CheckpointReader(a), CheckpointReader(c)
    new = [lay["index"] for lay in manifest["layers"] if lay["new"]]
    name = "model.layers.{}.mlp.up_proj.weight"
    assert not torch.equal(ra.get(name.format(new[0])), rc.get(name.format(new[0])))  # the seed matters
    assert not torch.equal(ra.get(name.format(new[0])), ra.get(name.format(new[1])))  # each layer its own
