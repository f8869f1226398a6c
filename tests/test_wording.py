"""What a newcomer reads: plural agreement, no Python reprs, bundled names rather than installation
paths, and hints on the errors a first day meets."""

from __future__ import annotations

from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.verify.proof import LayerFinding, StaticProof, summary
from tests.support.cli_checks import one_error_line

runner = CliRunner()


def test_static_summary_agrees_in_number():
    layer = LayerFinding(index=0, copy_of=0, base=True, identity=False, claim="base layer 0", note="")
    found = summary(StaticProof(layers=[layer], outside_equal=True, preserving=False, reason="x"))
    assert "1 base layer in order, 0 identity layers, 1 in all" in found  # was "1 identity layers"


def test_inspect_shows_dtypes_as_words_and_the_bundled_name():
    text = runner.invoke(app, ["inspect", "bundled:stories260k"], env={"COLUMNS": "200"}).stdout
    assert "F32: 47 tensors" in text and "{" not in text  # was "{'F32': 47}"
    assert text.splitlines()[0].strip() == "bundled:stories260k"


def test_force_onto_a_foreign_folder_counts_one_entry(tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("mine")
    result = runner.invoke(app, ["expand", "bundled:stories260k", "--out", str(out), "--force"])
    assert "it holds 1 entry, e.g. todo.txt" in one_error_line(result)
    assert (out / "todo.txt").read_text() == "mine"


def test_inspect_on_a_hub_id_that_is_not_cached_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    line = one_error_line(runner.invoke(app, ["inspect", "someone/some-model"]))
    assert "not in the local Hugging Face cache" in line  # was "neither a checkpoint folder nor ..."
