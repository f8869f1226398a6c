"""`inspect`, `demo`, `study` and `diagnose` as users run them (small settings: seconds each)."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from otdus_cli import __version__
from otdus_cli.cli import app
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions

runner = CliRunner()


def invoke(*args) -> object:
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result


def test_inspect_table_and_json(stories, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "out"
    expand(str(stories), out, ExpandOptions(method="llama-pro", layers=5))
    info = json.loads(invoke("inspect", out, "--json").stdout)
    numels, nbytes = [], 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            t = f.get_tensor(name)
            numels.append(t.numel())
            nbytes += t.numel() * t.element_size()
    manifest = json.loads((out / "otdus.json").read_text())
    assert info == {
        "path": str(out),
        "model_type": "llama",
        "num_hidden_layers": 10,
        "parameters": sum(numels),
        "tensors": len(numels),
        "dtypes": {"F32": len(numels)},
        "bytes": nbytes,
        "tie_word_embeddings": True,
        "manifest": manifest,
        "manifest_check": "unchanged",  # otdus.json is what otdus wrote
        "changed_since_written": [],  # every file still as otdus wrote it
        "card": {  # the model card's summary (card.py)
            "metadata": {
                "library_name": "transformers",
                "tags": ["otdus", "depth-up-scaling", "llama-pro"],
            },
            "verified": None,
        },
    }
    # the manifest alone, by its path
    assert json.loads(invoke("inspect", out / "otdus.json", "--json").stdout)["manifest"] == manifest
    table = invoke("inspect", out).stdout
    new = ", ".join(str(lay["index"]) for lay in manifest["layers"] if lay["new"])
    for row in (
        ("num_hidden_layers", "10"),
        ("parameters", f"{sum(numels):,}"),
        ("made by", f"otdus {__version__} llama-pro from {stories}"),
        ("function-preserving", "True"),
        ("new layers", new),
        ("new parameters", f"{len(manifest['new_parameters'])} tensors"),
        ("model card", "base_model none; license none; tags otdus, depth-up-scaling, llama-pro"),
    ):
        assert any(row[0] in line and row[1] in line for line in table.splitlines()), row
    assert "manifest " not in table  # no row about the manifest itself while it is what otdus wrote
    (out / "otdus.json").write_text(json.dumps({**manifest, "new_parameters": []}))
    assert json.loads(invoke("inspect", out, "--json").stdout)["manifest_check"] == "edited"
    assert "otdus.json was edited since otdus wrote it" in invoke("inspect", out).stdout
    # a plain base model: no manifest rows
    assert "made by" not in invoke("inspect", stories).stdout
    bad = runner.invoke(app, ["inspect", str(tmp_path)])
    assert bad.exit_code == 2 and "neither a checkpoint folder nor an otdus manifest" in bad.stderr


def test_demo(tmp_path):
    out = tmp_path / "demo"
    invoke("expand", "bundled:stories260k", "--out", out, "--method", "copy", "--layers", "1")
    assert json.loads((out / "otdus.json").read_text())["num_hidden_layers"] == 6
    text = invoke("demo", "--out", out, "--max-tokens", "256").stdout  # an earlier output is replaced
    steps = [
        "1. otdus expand",
        "2. otdus inspect",
        "3. otdus verify (WikiText-2",
        "4. otdus verify (TinyStories",
    ]
    positions = [text.index(s) for s in steps]
    assert positions == sorted(positions)
    assert text.count("PARITY: function preserved") == 2 and "BROKEN" not in text
    manifest = json.loads((out / "otdus.json").read_text())
    assert (
        manifest["method"] == "ot" and manifest["function_preserving"] and manifest["num_hidden_layers"] == 7
    )


def test_study_through_the_cli(tmp_path):
    out = tmp_path / "study"
    args = ["study", "bundled:stories260k", "--train", "bundled:tinystories-sample"]
    args += ["--methods", "average+zero,copy", "--reference", "average+zero", "--seeds", "0", "--steps", "2"]
    args += ["--batch", "2", "--seq-len", "64", "--eval-every", "1", "--eval-windows", "2", "--layers", "1"]
    data = json.loads(invoke(*args, "--out", out, "--json").stdout)["study"]
    assert [m["label"] for m in data["methods"]] == ["average+zero", "copy"]
    assert data["config"]["steps"] == 2 and data["config"]["seeds"] == [0]
    zero = data["methods"][0]
    assert zero["function_preserving"] and zero["initial_equals_base"]
    runs = data["runs"]
    assert [r["eval_steps"] for r in runs] == [[0, 1, 2]] * 2 and all(
        r["num_hidden_layers"] == 6 for r in runs
    )
    assert runs[0]["eval_loss"][0] == data["base_loss"]  # zero-init starts exactly at the base's loss
    assert json.loads((out / "study.json").read_text()) == data


def test_diagnose_through_the_cli(tmp_path):
    common = ["diagnose", "bundled:stories260k", "--max-tokens", "256", "--seq-len", "64"]
    quiet = invoke(*common, "--pair", "3,4", "--json", "--quiet")
    assert quiet.stderr == ""  # --quiet: no progress lines
    data = json.loads(quiet.stdout)
    (pair,) = data["pairs"]
    assert [pair["a"], pair["b"]] == [3, 4] and data["tokens"] == 256
    assert len(data["weight_norms"]) == 5
    for value in pair["mlp"].values():
        assert -1.0 <= value <= 1.0
    assert data["warnings"] == []
    # every adjacent pair, as tables; the five-story sample has fewer tokens than asked: a warning
    sample = ["--text", "bundled:tinystories-sample"]
    shown = invoke("diagnose", "bundled:stories260k", *sample, "--max-tokens", "100000", "--seq-len", "64")
    text = shown.stdout
    assert "warning:" in shown.stderr and "fewer than the 100,000 asked" in shown.stderr
    # a line per pair (an OT solve each: minutes on a large model), in a log as on a terminal
    steps = re.findall(r"^otdus diagnose: pair \((\d), (\d)\), (\d) of 4, \d+ s so far$", shown.stderr, re.M)
    assert steps == [(str(i), str(i + 1), str(i + 1)) for i in range(4)], shown.stderr
    for title in ("MLP neuron correlation", "attention heads", "transport plan entropy", "weight norm"):
        assert title in text, title
    assert all(f"{i}-{i + 1}" in text for i in range(4))
    bad = runner.invoke(app, [*common, "--pair", "1,3"])
    assert bad.exit_code == 2 and "two adjacent layer indices" in bad.stderr


def test_diagnose_defaults_give_the_tokens_they_ask_for():
    """README's `otdus diagnose bundled:stories260k` always warned: its default text (five stories) was
    shorter than its default --max-tokens."""
    shown = invoke("diagnose", "bundled:stories260k", "--pair", "3,4", "--json")
    data = json.loads(shown.stdout)
    assert data["warnings"] == [] and "warning" not in shown.stderr
    assert data["tokens"] == 4096 and data["text"] == "bundled:tinystories-train-2mib"


def test_expand_json_names_new_parameters_as_the_manifest_does(tmp_path):
    """--json's new_parameters was a count where otdus.json's is a list of names."""
    out = tmp_path / "out"
    data = json.loads(
        invoke("expand", "bundled:stories260k", "--out", out, "--method", "copy", "--json").stdout
    )
    manifest = json.loads((out / "otdus.json").read_text())
    assert data["new_parameters"] == manifest["new_parameters"] and data["new_parameters"]
    assert data["new_parameter_count"] == len(manifest["new_parameters"])


def test_study_flags_override_a_recipe(tmp_path):
    """`--help` says flags override the recipe: --steps, --seeds, --layers and --reference must win
    over the recipe's settings (they were silently ignored before); BASE/--methods clash with it."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "base: bundled:stories260k\nreference: average+zero\n"
        "settings: {seeds: [0, 1], steps: 3, batch: 2, seq_len: 64, eval_every: 3, eval_windows: 2}\n"
        "expand: {layers: 2}\n"
        "runs: [{name: average+zero, expand: {method: average, zero_init: true}},\n"
        "       {name: copy, expand: {method: copy}}]\n"
        "studies: [{name: s, train_text: bundled:tinystories-sample, settings: {eval_fraction: 0.4}}]\n"
    )
    args = [
        "study",
        "--recipe",
        recipe,
        "--steps",
        "1",
        "--seeds",
        "5",
        "--layers",
        "1",
        "--reference",
        "copy",
    ]
    data = json.loads(invoke(*args, "--json").stdout)["s"]
    assert data["config"]["steps"] == 1 and data["config"]["seeds"] == [5]
    assert data["config"]["eval_windows"] == 2 and data["config"]["batch"] == 2  # the recipe's, not the CLI's
    assert {r["num_hidden_layers"] for r in data["runs"]} == {6} and data["reference"] == "copy"
    assert [r["eval_steps"] for r in data["runs"]] == [[0, 1]] * 2
    bad = runner.invoke(app, ["study", "--recipe", str(recipe), "--methods", "ot"])
    assert bad.exit_code == 2 and "--methods with --recipe" in bad.stderr
