"""Every text a documented command or recipe names ships in the package, under a bundled name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from otdus_cli.bundled import BUNDLED_TEXT_FILES, BUNDLED_TEXTS, read_bundled_text
from otdus_cli.study.data import load_documents

ROOT = Path(__file__).resolve().parent.parent
# whole documents each bundled text gives (TinyStories: the story cut short at 2 MiB is dropped)
DOCUMENTS = {
    "bundled:tinystories-sample": 5,
    "bundled:tinystories-train-2mib": 2316,
    "bundled:wikitext-test": 62,
    "bundled:wikitext-valid": 60,
}


@pytest.mark.parametrize("name", BUNDLED_TEXTS)
def test_bundled_texts_load_whole_with_their_licence_beside_them(name):
    assert read_bundled_text(name)  # sha256 checked
    assert len(load_documents(name).documents) == DOCUMENTS[name]
    notices = " ".join(p.read_text() for p in (ROOT / "otdus_cli" / "data").glob("*.md"))
    assert BUNDLED_TEXT_FILES[name].name in notices, name
    assert BUNDLED_TEXT_FILES[name].stat().st_size < 700_000  # gzip keeps the repository small


def test_study_recipes_name_only_bundled_or_shipped_files():
    """A clone has no ../shared: recipes/study-*.yaml stopped with 'text file not found'."""
    for recipe in sorted((ROOT / "recipes").glob("study-*.yaml")):
        data = yaml.safe_load(recipe.read_text())
        for study in data["studies"]:
            for key in ("train_text", "eval_text"):
                text = study.get(key)
                if text is None:
                    continue
                assert text in BUNDLED_TEXTS or (recipe.parent / text).resolve().is_relative_to(ROOT), (
                    recipe.name,
                    text,
                )
                load_documents(text if text in BUNDLED_TEXTS else recipe.parent / text)


def test_ppl_names_bundled_model_and_text_not_their_paths():
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    args = ["ppl", "bundled:stories260k", "--text", "bundled:tinystories-train-2mib", "--protocol", "token"]
    args += ["--seq-len", "64", "--max-tokens", "128", "--device", "cpu", "-q"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    title = result.stdout.splitlines()[0]
    assert title.startswith("bundled:stories260k: bundled:tinystories-train-2mib,"), title
    assert str(ROOT) not in result.stdout
