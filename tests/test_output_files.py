"""A study's `--out` goes through the life cycle of every otdus output (output_files.py over
io/output_dir.py): never through a link, never over a file or folder otdus did not write, never the
source or a model output, `--force` only over an unchanged earlier study output, every refusal
before any training."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from otdus_cli.errors import OtdusError
from otdus_cli.io.output_dir import TMP_TAG, earlier_output_files
from otdus_cli.manifest import read_manifest
from otdus_cli.output_files import STUDY
from otdus_cli.study import StudyResult
from tests.support.cli_checks import one_error_line
from tests.support.file_checks import leftovers, run_cli, tree_digest

# a study of seconds: one arm, one seed, two steps
STUDY_ARGS = ["study", "bundled:stories260k", "--train", "bundled:tinystories-sample", "--methods", "copy"]
STUDY_ARGS += ["--reference", "copy", "--seeds", "0", "--steps", "2", "--batch", "2", "--seq-len", "64"]
STUDY_ARGS += ["--eval-every", "2", "--eval-windows", "2", "--layers", "1"]


def refused_before_training(result, message: str) -> None:
    """One error line, and no study progress: nothing was trained."""
    one_error_line(result, message=message)
    assert "study: run" not in result.output


@pytest.fixture(scope="module")
def earlier(tmp_path_factory) -> Path:
    """A study output, as `otdus study --out` wrote it."""
    out = tmp_path_factory.mktemp("earlier") / "study"
    result = run_cli(*STUDY_ARGS, "--out", out)
    assert result.exit_code == 0, result.output
    return out


def test_a_study_output_is_an_otdus_output_with_hashes(earlier):
    manifest = json.loads((earlier / "otdus.json").read_text())
    assert manifest["output"] == STUDY
    assert set(manifest["files"]) == {p.name for p in earlier.iterdir()} - {"otdus.json"}
    assert "study.json" in manifest["files"]
    assert earlier_output_files(earlier, STUDY) == {p.name for p in earlier.iterdir()}
    assert StudyResult.load(earlier).methods[0].label == "copy"
    assert not leftovers(earlier.parent)


def test_a_study_json_linked_to_a_users_file_is_left_alone(tmp_path):
    users = tmp_path / "notes.txt"
    users.write_text("mine\n")
    out = tmp_path / "d"
    out.mkdir()
    (out / "study.json").symlink_to(users)
    refused_before_training(run_cli(*STUDY_ARGS, "--out", out), "already exists")
    refused_before_training(run_cli(*STUDY_ARGS, "--out", out, "--force"), "not an otdus output")
    assert users.read_text() == "mine\n" and (out / "study.json").is_symlink()


def test_an_out_linked_to_a_folder_elsewhere_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    refused_before_training(run_cli(*STUDY_ARGS, "--out", tmp_path / "link"), "symbolic link")
    assert not list(elsewhere.iterdir())


def test_an_existing_file_is_refused_before_training(tmp_path):
    out = tmp_path / "results"
    out.write_text("someone's\n")
    refused_before_training(run_cli(*STUDY_ARGS, "--out", out), "existing file")
    refused_before_training(run_cli(*STUDY_ARGS, "--out", out, "--force"), "existing file")
    assert out.read_text() == "someone's\n"


def test_the_source_and_a_model_output_are_refused(tmp_path, stories):
    from otdus_cli.expand import expand
    from otdus_cli.options import ExpandOptions

    before = tree_digest(stories)
    source = [*STUDY_ARGS]
    source[1] = str(stories)
    refused_before_training(run_cli(*source, "--out", stories, "--force"), "source model")
    refused_before_training(run_cli(*source, "--out", stories / "results"), "inside the source model")
    assert tree_digest(stories) == before
    model = tmp_path / "deeper"
    expand(str(stories), model, ExpandOptions(method="copy", layers=1))
    written = tree_digest(model)
    refused_before_training(run_cli(*STUDY_ARGS, "--out", model), "already exists")
    refused_before_training(run_cli(*STUDY_ARGS, "--out", model, "--force"), "not a study one")
    assert tree_digest(model) == written and read_manifest(model) is not None


def test_a_model_command_does_not_replace_a_study_output(earlier, stories):
    written = tree_digest(earlier)
    result = run_cli("shrink", stories, "--out", earlier, "--layers", "1", "--force")
    one_error_line(result, message="not a model one")
    assert tree_digest(earlier) == written


def test_force_replaces_only_an_unchanged_earlier_study_output(earlier, tmp_path):
    out = tmp_path / "study"
    StudyResult.load(earlier).save(out, plot=False)
    refused_before_training(run_cli(*STUDY_ARGS, "--out", out), "already exists")
    (out / "study.json").write_text((out / "study.json").read_text().replace('"copy"', '"edited"'))
    edited = tree_digest(out)
    refused_before_training(run_cli(*STUDY_ARGS, "--out", out, "--force"), "changed since otdus wrote them")
    assert tree_digest(out) == edited
    again = tmp_path / "again"
    StudyResult.load(earlier).save(again, plot=False)
    result = run_cli(*STUDY_ARGS, "--out", again, "--force")
    assert result.exit_code == 0, result.output
    assert "study.json" in earlier_output_files(again, STUDY) and not leftovers(tmp_path)


def test_save_is_staged_too(earlier, tmp_path):
    """The library's StudyResult.save: the same refusals (an existing folder; --force over a folder
    otdus did not write), and the same study output."""
    result = StudyResult.load(earlier)
    out = tmp_path / "saved"
    assert [p.name for p in result.save(out, plot=False)] == ["study.json"]
    with pytest.raises(OtdusError, match="already exists"):
        result.save(out, plot=False)
    result.save(out, plot=False, force=True)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "study.json").write_text("{}")
    with pytest.raises(OtdusError, match="not an otdus output"):
        result.save(tmp_path / "theirs", plot=False, force=True)
    assert (tmp_path / "theirs" / "study.json").read_text() == "{}"


def test_a_recipe_checks_every_studys_folder_before_the_first(tmp_path):
    from otdus_cli.study import run_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "base: bundled:stories260k\nreference: copy\nexpand: {layers: 1}\n"
        "settings: {seeds: [0], steps: 2, batch: 2, seq_len: 64, eval_every: 2, eval_windows: 2}\n"
        "runs: [{name: copy, expand: {method: copy}}]\n"
        "studies: [{name: a, train_text: bundled:tinystories-sample}, "
        "{name: b, train_text: bundled:tinystories-sample}]\n"
    )
    out = tmp_path / "out"
    (out / "b").mkdir(parents=True)
    (out / "b" / "study.json").write_text("someone's")
    with pytest.raises(OtdusError, match="already exists"):
        run_recipe(recipe, out, force=False)
    with pytest.raises(OtdusError, match="not an otdus output"):
        run_recipe(recipe, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["b"]  # study a never ran
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(OtdusError, match="symbolic link"):
        run_recipe(recipe, tmp_path / "link")
    (out / "b" / "study.json").unlink()
    (out / "b").rmdir()
    results = run_recipe(recipe, out)
    assert sorted(results) == ["a", "b"]
    for name in ("a", "b"):
        assert "study.json" in earlier_output_files(out / name, STUDY)


def test_diagnose_png_is_a_new_file_or_refused_before_any_work(tmp_path):
    users = tmp_path / "mine.png"
    users.write_bytes(b"not otdus's")
    (tmp_path / "link.png").symlink_to(users)
    args = ["diagnose", "bundled:stories260k", "--max-tokens", "64", "--seq-len", "32", "--pair", "3,4"]
    for taken in (users, tmp_path / "link.png"):
        one_error_line(run_cli(*args, "--png", taken), message="already exists")
    one_error_line(run_cli(*args, "--png", tmp_path / "no" / "x.png"), message="does not exist")
    assert users.read_bytes() == b"not otdus's"
    result = run_cli(*args, "--png", tmp_path / "profile.png", "--json")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)["figures"]
    drawn = ["profile.png"] if figures else []  # without matplotlib: no figure, and nothing written
    assert figures == [str(tmp_path / name) for name in drawn]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["link.png", "mine.png", *drawn])
    if figures:
        assert (tmp_path / "profile.png").read_bytes().startswith(b"\x89PNG")


def test_diagnose_png_sweeps_what_a_killed_run_to_it_left(tmp_path):
    """A SIGKILLed `diagnose --png` leaves its temporary folder beside the file; the next run to the
    same file removes it (its owner is dead) and says so, and keeps one whose owner still runs."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    left = tmp_path / f".profile.png.{TMP_TAG}{dead.pid}@{host}.abcd"
    left.mkdir()
    (left / "profile.png").write_bytes(b"half a png")
    running = tmp_path / f".profile.png.{TMP_TAG}{os.getpid()}@{host}.efgh"
    running.mkdir()
    args = ["diagnose", "bundled:stories260k", "--max-tokens", "64", "--seq-len", "32", "--pair", "3,4"]
    result = run_cli(*args, "--png", tmp_path / "profile.png", "--json")
    assert result.exit_code == 0, result.output
    said = json.loads(result.stdout)["warnings"]
    assert not os.path.lexists(left) and any(f"removed {left}" in line for line in said)
    assert running.is_dir() and any(f"{running} belongs to otdus pid {os.getpid()}" in line for line in said)
