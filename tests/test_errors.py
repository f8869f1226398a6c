"""Bad input ends in one clear error line, exit code 2, and no output folder (nor temporary leftovers)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.io import writer
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import no_output_left, one_error_line

runner = CliRunner()


def run_cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean_failure(result, message: str, parent: Path, code: int = 2) -> None:
    one_error_line(result, code, message)
    no_output_left(parent)


def test_unknown_architecture(stories, tmp_path):
    cfg = json.loads((stories / "config.json").read_text())
    cfg["model_type"] = "mystery"
    (stories / "config.json").write_text(json.dumps(cfg))
    assert_clean_failure(
        run_cli("expand", stories, "--out", tmp_path / "out"), "unknown architecture", tmp_path
    )


def test_unknown_architecture_copies_generically_when_allowed(stories, tmp_path):
    cfg = json.loads((stories / "config.json").read_text())
    cfg["model_type"] = "mystery"
    (stories / "config.json").write_text(json.dumps(cfg))
    result = run_cli("plan", stories, "--method", "copy", "--allow-unknown-arch", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["family"] == "generic"
    bad = run_cli("plan", stories, "--method", "average", "--allow-unknown-arch")
    assert bad.exit_code == 2 and "copy-type" in bad.stderr


def test_quantized_checkpoint(stories, tmp_path):
    cfg = json.loads((stories / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (stories / "config.json").write_text(json.dumps(cfg))
    assert_clean_failure(run_cli("expand", stories, "--out", tmp_path / "out"), "quantized", tmp_path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layers", "9"], "at most 4 pairs"),
        (["--method", "average", "--after", "4"], "after the last layer"),
        (["--method", "solar"], "parity"),
        (["--method", "nope"], "'nope' is not one of 'ot'"),
        (["--position", "sideways"], "position"),
        (["--after", "1,x"], "comma-separated"),
        (["--max-shard-size", "lots"], "cannot read size"),
        (["--device", "cuda:0"], "no CUDA GPU"),
    ],
)
def test_impossible_options(stories, tmp_path, args, message):
    import torch

    if "cuda:0" in args and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert_clean_failure(run_cli("expand", stories, "--out", tmp_path / "out", *args), message, tmp_path)


def test_existing_output_folder(stories, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy")
    assert result.exit_code == 2 and "already exists" in result.stderr
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_missing_model_and_bad_recipe(tmp_path):
    assert_clean_failure(
        run_cli("expand", tmp_path / "nothing", "--out", tmp_path / "out"), "not found", tmp_path
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: bundled:stories260k\nexpand:\n  method: ot\n  layerz: 3\n")
    assert_clean_failure(run_cli("expand", "--recipe", recipe, "--out", tmp_path / "out"), "layerz", tmp_path)


def test_a_recipe_placing_no_layer_is_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: bundled:stories260k\nexpand:\n  method: copy\n  after: []\n")
    result = run_cli("expand", "--recipe", recipe, "--out", tmp_path / "out")
    assert_clean_failure(result, "expand.after: List should have at least 1 item", tmp_path)


def test_out_inside_source_is_refused(stories, tmp_path):
    result = run_cli("expand", stories, "--out", stories / "deeper", "--method", "copy")
    assert result.exit_code == 2 and "inside the source" in result.stderr
    assert not (stories / "deeper").exists()


def test_interrupt_leaves_nothing(stories, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = writer.ShardedWriter.copy_raw

    def interrupted(self, name, source):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return real(self, name, source)

    monkeypatch.setattr(writer.ShardedWriter, "copy_raw", interrupted)
    with pytest.raises(KeyboardInterrupt):
        expand(str(stories), tmp_path / "out", ExpandOptions(method="copy"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stories260k"]
    calls["n"] = 0
    result = run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy")
    assert result.exit_code == 130 and not (tmp_path / "out").exists()


def test_full_disk_leaves_nothing(stories, tmp_path, monkeypatch):
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "_pwrite_all", full)
    with pytest.raises(OtdusError, match="disk full"):
        expand(str(stories), tmp_path / "out", ExpandOptions(method="average"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stories260k"]


def test_a_multi_line_library_error_is_printed_as_one_literal_line(stories, tmp_path, monkeypatch):
    # wrapped third-party messages (tokenizers, transformers) can span lines and hold brackets
    import otdus_cli.expand

    def fail(*args, **kwargs):
        raise OtdusError("cannot load X:\n  (1) a [bold]thing[/bold],\n  (2) [default: 3]")

    monkeypatch.setattr(otdus_cli.expand, "expand", fail)
    result = run_cli("expand", stories, "--out", tmp_path / "out")
    assert_clean_failure(result, "cannot load X: (1) a [bold]thing[/bold], (2) [default: 3]", tmp_path)


def test_config_transformers_rejects_leaves_nothing(stories, tmp_path):
    # a known family whose config transformers refuses to load (an attention type it does not have)
    cfg = json.loads((stories / "config.json").read_text())
    cfg["layer_types"] = ["mystery_attention"] * cfg["num_hidden_layers"]
    (stories / "config.json").write_text(json.dumps(cfg))
    assert_clean_failure(
        run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy"),
        "transformers rejects the rewritten config",
        tmp_path,
    )


@pytest.mark.parametrize("method", ["copy", "average"])  # bytes moved by the kernel / tensors written
def test_full_disk_through_the_cli(stories, tmp_path, monkeypatch, method):
    """A disk that fills after 100 kB, at the system calls the writer uses: one error line, exit 2,
    nothing left behind."""
    import errno

    room = {"left": 100_000}
    real_pwrite, real_copy = os.pwrite, os.copy_file_range

    def take(n: int) -> None:
        if n > room["left"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        room["left"] -= n

    def pwrite(fd, data, offset):
        take(len(data))
        return real_pwrite(fd, data, offset)

    def copy_file_range(src, dst, count, offset_src=None, offset_dst=None):
        take(count)
        return real_copy(src, dst, count, offset_src, offset_dst)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    result = run_cli("expand", stories, "--out", tmp_path / "out", "--method", method)
    assert_clean_failure(result, "disk full while writing", tmp_path)
    assert room["left"] < 100_000  # the writes did start


def test_unexpected_error_is_exit_3_in_one_line(stories, tmp_path, monkeypatch):
    import otdus_cli.expand

    def bug(*args, **kwargs):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(otdus_cli.expand, "expand", bug)
    result = run_cli("expand", stories, "--out", tmp_path / "out")
    assert_clean_failure(result, "unexpected RuntimeError: an internal bug (OTDUS_DEBUG=1", tmp_path, code=3)
    monkeypatch.setenv("OTDUS_DEBUG", "1")
    debug = run_cli("expand", stories, "--out", tmp_path / "out")
    assert debug.exit_code == 1 and isinstance(debug.exception, RuntimeError)  # the traceback is kept
