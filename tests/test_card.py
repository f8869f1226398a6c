"""The model card of every otdus output: huggingface_hub's ModelCard.load reads its metadata back
(base_model, library_name, tags, licence), for a hub, a local and a bundled source; a source's own
README.md is never copied; `verify --card` adds the verdict atomically, only to an otdus output."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from typer.testing import CliRunner

from otdus_cli.bundled import STORIES260K
from otdus_cli.card import CARD, write_card
from otdus_cli.cli import app
from otdus_cli.expand import expand
from otdus_cli.grow import expand_and_widen
from otdus_cli.io.output_dir import earlier_output_files
from otdus_cli.options import ExpandOptions
from otdus_cli.widen import WidenOptions, widen
from tests.support.cli_checks import one_error_line
from tests.support.hub_cache import make_hub_cache, otdus
from tests.support.tiny_models import build_tiny

runner = CliRunner()
SOURCE_BODY = "This card describes the SOURCE model, not any expansion of it."


def with_card(folder: Path, metadata: str) -> Path:
    (folder / CARD).write_text(f"---\n{metadata}---\n\n# The source\n\n{SOURCE_BODY}\n")
    return folder


def load(folder: Path):
    return ModelCard.load(folder / CARD)


def test_bundled_source_card(tmp_path):
    out = tmp_path / "out"
    result = expand(
        "bundled:stories260k", out, ExpandOptions(method="llama-pro", layers=5, position="uniform")
    )
    card = load(out)
    assert card.data.base_model is None  # a bundled model is on no hub
    assert card.data.library_name == "transformers"
    assert card.data.tags == ["otdus", "depth-up-scaling", "llama-pro"]
    assert card.data.license == "mit"  # the bundled model's licence (its README has no metadata)
    assert "Copyright (c) 2023 Andrej Karpathy" in (out / "LICENSE").read_text()  # its notice travels
    bundled_readme = (STORIES260K / CARD).read_text()
    assert card.content != bundled_readme and "stories260K as a Hugging Face" not in card.content
    assert "| 1 | from 0 | yes | copy | yes |" in card.text  # the layer map
    assert "5 -> 10 layers" in card.text
    assert "function-preserving: yes by construction, in float32 (base layers copied" in card.text
    assert "not measured on this card until `otdus verify . --card`" in card.text
    assert "  - ^model.layers.9." in card.text  # how to train the new layers
    assert "mlp.down_proj.weight, self_attn.o_proj.weight of layers 1, 3, 5, 7, 9" in card.text
    # the card is part of the output: --force may replace it like every other file otdus wrote
    assert CARD in earlier_output_files(out)
    assert result.manifest["copied_files"] == sorted(result.manifest["copied_files"])
    assert CARD not in result.manifest["copied_files"]


def test_local_source_card_carries_the_licence_not_the_text(stories, tmp_path):
    with_card(stories, "license: other\nlicense_name: tiny-licence\nbase_model: someone/grandparent\n")
    out = tmp_path / "out"
    expand(str(stories), out, ExpandOptions(method="ot", layers=2))
    card = load(out)
    assert card.data.license == "other" and card.data.license_name == "tiny-licence"
    # the source's base_model is the source's parent, not this model's: a local folder names none
    assert card.data.base_model is None
    assert card.data.tags == ["otdus", "depth-up-scaling", "ot"]
    assert SOURCE_BODY not in (out / CARD).read_text()
    assert "by `ot (paper)`" in card.text and "zero-initialised" in card.text
    assert "otdus_cli.expand" in card.text  # made through the library: the card says so, and how


def test_hub_source_card_names_its_base_and_the_command(tmp_path):
    model = with_card(Path(shutil.copytree(STORIES260K, tmp_path / "model")), "license: apache-2.0\n")
    cache = tmp_path / "hub"
    make_hub_cache(cache, "tiny-org/stories", model)
    out = tmp_path / "out"
    done = otdus(
        "expand", "tiny-org/stories", "--out", out, "--method", "interpose", "--layers", "2", cache=cache
    )
    assert done.returncode == 0, done.stderr
    card = load(out)
    assert card.data.base_model == "tiny-org/stories"
    assert card.data.license == "apache-2.0" and card.data.library_name == "transformers"
    assert card.data.tags == ["otdus", "depth-up-scaling", "interpose"]
    assert SOURCE_BODY not in card.content
    command = "otdus expand tiny-org/stories --out out --method interpose --layers 2"
    assert f"{command}  # local paths shown by their last part" in card.text  # no path of this machine


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    folder = build_tiny("mixtral", tmp_path_factory.mktemp("mixtral") / "mixtral")
    return with_card(folder, "license: apache-2.0\n")


def test_widen_and_experts_outputs_carry_cards(mixtral, tmp_path):
    wide = tmp_path / "wide"
    widen(str(mixtral), wide, WidenOptions(noise=0))
    card = load(wide)
    assert card.data.tags == ["otdus", "expert-growth", "widen"] and card.data.license == "apache-2.0"
    assert card.data.base_model is None and SOURCE_BODY not in card.content
    assert "router weights" in card.text and "block_sparse_moe.experts.7.w1.weight$" in card.text
    assert "by `widen`: 4 -> 4 layers, 4 -> 8 experts per MoE layer, top-2 -> top-4 routing." in card.text
    both = tmp_path / "both"
    expand_and_widen(str(mixtral), both, ExpandOptions(method="interpose", layers=2), WidenOptions(noise=0))
    card = load(both)
    assert card.data.tags == ["otdus", "depth-up-scaling", "expert-growth", "interpose", "widen"]
    assert card.data.license == "apache-2.0"  # through the deeper model's card
    assert "4 -> 6 layers, 4 -> 8 experts per MoE layer" in card.text
    assert "| 2 | from 1 | yes | copy |  |" in card.text  # expand --experts: its map is over the source's
    assert "step 1: expand by `interpose`" in card.text and "step 2: widen by `widen`" in card.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["both", "wide"]


def test_hub_moe_card_keeps_its_base_through_expand_experts_then_widen(mixtral, tmp_path):
    """A chain of steps names the first step's hub source: `expand --experts` (one command) and a
    later `widen` of that output (a local, otdus-made source)."""
    cache = tmp_path / "hub"
    make_hub_cache(cache, "tiny-org/mix", mixtral)
    both, wider = tmp_path / "both", tmp_path / "wider"
    args = [
        "expand",
        "tiny-org/mix",
        "--out",
        both,
        "--method",
        "interpose",
        "--layers",
        "2",
        "--experts",
        "2",
    ]
    done = otdus(*args, cache=cache)
    assert done.returncode == 0, done.stderr
    assert load(both).data.base_model == "tiny-org/mix"
    done = otdus("widen", both, "--out", wider, "--noise", "0", cache=cache)
    assert done.returncode == 0, done.stderr
    card = load(wider)
    assert card.data.base_model == "tiny-org/mix" and card.data.license == "apache-2.0"
    assert card.data.tags == ["otdus", "depth-up-scaling", "expert-growth", "interpose", "widen"]


def test_verify_card_adds_the_verdict_once_and_only_to_an_otdus_output(stories, tmp_path):
    out = tmp_path / "out"
    expand(str(stories), out, ExpandOptions(method="ot", layers=2))
    before = load(out)
    shown = runner.invoke(app, ["inspect", str(out)]).stdout
    assert "base_model none; license none; tags otdus, depth-up-scaling, ot; no verification on it" in shown
    args = ["verify", str(out), "--text", "bundled:tinystories-sample", "--max-tokens", "200"]
    for _ in range(2):  # a second run replaces the first section
        done = runner.invoke(app, [*args, "--card"])
        assert done.exit_code == 0, done.output
    after = load(out)
    measured = {"model-index"}  # what verify --card adds to the metadata; the rest is kept
    assert {k: v for k, v in after.data.to_dict().items() if k not in measured} == before.data.to_dict()
    results = {r.metric_name: r for r in after.data.eval_results}  # model-index, as huggingface_hub reads it
    assert set(results) == {"token perplexity", "word perplexity"}
    assert results["token perplexity"].metric_type == "perplexity"
    assert results["token perplexity"].dataset_name == "bundled:tinystories-sample"
    assert "float32" in results["token perplexity"].metric_config
    assert after.text.count("## Verification by otdus verify") == 1
    assert (
        "**PARITY: function preserved" in after.text
        and "logits bitwise equal to the base's: yes" in after.text
    )
    assert "base model: stories260k (a local folder)" in after.text  # not this machine's path
    assert str(tmp_path) not in after.content
    assert after.text.startswith(before.text.rstrip("\n"))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temporary file left
    inspected = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert inspected["card"]["verified"].startswith("PARITY")
    assert inspected["card"]["metadata"]["tags"] == ["otdus", "depth-up-scaling", "ot"]
    # refused before any work: a folder that is not an otdus output, --static, a bundled model
    one_error_line(runner.invoke(app, ["verify", str(stories), "--card"]), message="is not an otdus output")
    assert not (stories / CARD).exists() or SOURCE_BODY not in (stories / CARD).read_text()
    one_error_line(runner.invoke(app, ["verify", str(out), "--card", "--static"]), message="--static")
    one_error_line(
        runner.invoke(app, ["verify", "bundled:stories260k", "--card"]), message="not a local folder"
    )
    # the manifest records the card verify wrote: --force replaces the output as otdus's own
    assert CARD in earlier_output_files(out)
    again = ["expand", str(stories), "--out", str(out), "--method", "copy", "--layers", "1"]
    assert runner.invoke(app, [*again, "--force"]).exit_code == 0
    # a card edited since otdus wrote it is the user's: neither verify --card nor --force touch it
    (out / CARD).write_text((out / CARD).read_text() + "\nMy own notes.\n")
    edited = (out / CARD).read_bytes()
    one_error_line(runner.invoke(app, [*args, "--card"]), message="is not the card otdus wrote")
    one_error_line(runner.invoke(app, [*again, "--force"]), message="README.md (size")
    assert (out / CARD).read_bytes() == edited


def test_verify_card_leaves_an_edited_manifest_unsealed(stories, tmp_path):
    """Writing the card's record into an edited otdus.json would cover the edit with a new hash."""
    out = tmp_path / "out"
    expand(str(stories), out, ExpandOptions(method="copy", layers=1))
    manifest = json.loads((out / "otdus.json").read_text())
    (out / "otdus.json").write_text(json.dumps({**manifest, "function_preserving": True}))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    line = one_error_line(runner.invoke(app, ["verify", str(out), "--max-tokens", "200", "--card"]))
    assert "otdus.json was edited since otdus wrote it" in line and "left alone" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_write_card_is_atomic_and_returns_its_bytes(tmp_path):
    (tmp_path / CARD).write_text("old")
    data = write_card(tmp_path, "---\nlicense: mit\n---\n\nnew\n")
    assert (tmp_path / CARD).read_bytes() == data and data.startswith(b"---\nlicense: mit")
    assert [p.name for p in tmp_path.iterdir()] == [CARD]


# a folder name that closes a three-backtick fence, and adds HTML and a heading if written raw
HOSTILE = "x\n```\n<img src=x onerror=alert(1)>\n# owned"


def rendered(card_path: Path) -> str:
    """The card's body as a CommonMark renderer (with GFM tables, as the Hub's) turns it into HTML."""
    from markdown_it import MarkdownIt

    return (
        MarkdownIt("commonmark").enable("table").render(ModelCard.load(card_path).content.split("---", 2)[2])
    )


def test_names_a_user_controls_are_text_in_the_card_never_markup(stories, tmp_path):
    source = Path(shutil.move(stories, tmp_path / f"src{HOSTILE}"))
    out = tmp_path / f"out{HOSTILE}"
    done = otdus("expand", source, "--out", out, "--method", "ot", "--layers", "2", cache=tmp_path / "hub")
    assert done.returncode == 0, done.stderr
    verified = runner.invoke(
        app, ["verify", str(out), "--text", "bundled:tinystories-sample", "--max-tokens", "200", "--card"]
    )
    assert verified.exit_code == 0, verified.output
    html = rendered(out / CARD)
    assert "<img" not in html
    headings = re.findall(r"<h(\d)>(.*?)</h\1>", html)
    assert [level for level, _ in headings] == ["1", "2", "2", "2", "2", "2"]  # the title and otdus's own
    assert headings[0][1] == r"outx\n```\n&lt;img src=x onerror=alert(1)&gt;\n# owned"  # the name, as text
    # the command, as typed, stays whole inside its fence: the hostile line does not close it
    command = re.search(r"<pre><code class=\"language-bash\">(.*?)</code></pre>", html, re.S).group(1)
    assert "--method ot --layers 2" in command and "&lt;img src=x" in command


def test_base_model_for_a_cache_snapshot_a_hub_id_and_a_local_folder(stories, tmp_path):
    """The model tree link: a hub id, its cache snapshot given as a folder, or --base-model for any
    local folder; a hub source is recorded by id and revision (no path of this machine), and verify
    finds it again through the cache."""
    cache = tmp_path / "hub"
    snapshot = make_hub_cache(cache, "tiny-org/stories", stories)
    by_path = tmp_path / "by-path"
    done = otdus("expand", snapshot, "--out", by_path, "--method", "copy", "--layers", "1", cache=cache)
    assert done.returncode == 0, done.stderr
    assert load(by_path).data.base_model == "tiny-org/stories"
    by_id = tmp_path / "by-id"
    done = otdus("expand", "tiny-org/stories", "--out", by_id, "--method", "ot", "--layers", "2", cache=cache)
    assert done.returncode == 0, done.stderr
    source = json.loads((by_id / "otdus.json").read_text())["source"]
    assert source["kind"] == "hub" and source["revision"] and "path" not in source
    assert str(tmp_path) not in (by_id / "otdus.json").read_text().split('"files"')[0]
    done = otdus(
        "verify", by_id, "--text", "bundled:tinystories-sample", "--max-tokens", "200", "--card", cache=cache
    )
    assert done.returncode == 0, done.stderr
    card = load(by_id)
    assert "**PARITY" in card.text and "base model: tiny-org/stories" in card.text
    assert str(tmp_path) not in card.content
    local = tmp_path / "local"
    named = ["expand", str(stories), "--out", str(local), "--method", "copy", "--layers", "1"]
    assert runner.invoke(app, [*named, "--base-model", "tiny-org/stories"]).exit_code == 0
    assert load(local).data.base_model == "tiny-org/stories"
    one_error_line(
        runner.invoke(app, [*named, "--base-model", "not an id"]), message="is not a Hugging Face hub id"
    )
