"""What a newcomer reads: plural agreement, no Python reprs, bundled names rather than installation
paths, and hints on the errors a first day meets."""

from __future__ import annotations

import re

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


def test_an_existing_file_as_out_gets_one_message_with_or_without_force(tmp_path):
    """--out an existing file said "output folder ... already exists (--force replaces ...)" without
    --force and "is an existing file" with it: a file is replaced by neither."""
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    lines = {
        one_error_line(runner.invoke(app, ["expand", "bundled:stories260k", "--out", str(target), *force]))
        for force in ([], ["--force"])
    }
    assert lines == {
        f"error: --out {target} is an existing file; otdus writes a folder and replaces only its own"
    }
    assert target.read_text() == "mine"


def test_one_layer_is_singular():
    """ "--remove names 1 layers", "source layers 2 dropped", "removes layers 2"."""
    from otdus_cli.plan.shrink_map import describe_removal

    line = one_error_line(
        runner.invoke(
            app,
            [
                "plan",
                "bundled:stories260k",
                "--shrink",
                "drop",
                "--select",
                "explicit",
                "--remove",
                "2",
                "--layers",
                "2",
            ],
        )
    )
    assert "--remove names 1 layer, --layers asks for 2" in line
    record = {"removed": [2], "merged": [], "select": "explicit"}
    assert describe_removal(record).startswith("shrink: source layer 2 dropped (explicit selection)")
    text = runner.invoke(
        app, ["plan", "bundled:stories260k", "--shrink", "drop", "--select", "explicit", "--remove", "2"]
    ).stdout
    assert "removes layer 2 (perplexity will move)" in text


def test_plan_shrink_labels_every_column(tmp_path):
    """The scores table's last column (removed or not) had no header."""
    result = runner.invoke(
        app, ["plan", "bundled:stories260k", "--shrink", "drop", "--layers", "2"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if "block influence" in line)
    cells = [cell.strip() for cell in re.split(r"[┃|]", header)[1:-1]]
    assert cells[-1] == "in this shrink" and all(cells), header
    assert sum(line.count(" kept ") for line in result.stdout.splitlines()) == 3
