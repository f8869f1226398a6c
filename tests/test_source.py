"""Hub ids resolve through huggingface_hub's real cache.

Offline, a cached model works and a missing one is one error line.
"""

from __future__ import annotations

import json

import pytest

from otdus_cli.source import looks_local
from tests.support.cli_checks import one_error_line
from tests.support.file_checks import run_cli
from tests.support.hub_cache import COMMIT, make_hub_cache, otdus


def test_cached_hub_model_expands_offline_and_missing_one_is_one_error(sharded_llama, tmp_path):
    cache = tmp_path / "hub"
    make_hub_cache(cache, "tiny-org/tiny-llama", sharded_llama)
    done = otdus(
        "expand",
        "tiny-org/tiny-llama",
        "--out",
        tmp_path / "out",
        "--method",
        "llama-pro",
        "--layers",
        "2",
        "--json",
        cache=cache,
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "out" / "otdus.json").read_text())
    assert manifest["source"]["id"] == "tiny-org/tiny-llama"
    assert manifest["source"]["revision"] == COMMIT
    missing = otdus("plan", "tiny-org/not-cached", cache=cache)
    assert missing.returncode == 2
    assert (
        missing.stderr.strip().startswith("error:")
        and "not in the local Hugging Face cache" in missing.stderr
    )
    assert len(missing.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "given",
    [
        "out/nothere",
        "./out/nothere",
        "out/nothere/",
        "a/b/c",
        "~/nothere-otdus",
        "/nothere-otdus",
        r"C:\models\x",
    ],
)
def test_a_path_that_looks_local_is_never_a_hub_id(tmp_path, monkeypatch, given):
    """A mistyped path is "model folder not found", not a hub or offline problem; a hub id
    ("owner/name") whose owner is not a folder here is still a hub id."""
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    one_error_line(run_cli("plan", given), message=f"model folder not found: {given}")
    assert not looks_local("tiny-org/tiny-llama") and not looks_local("gpt2")


@pytest.mark.parametrize("model", ["local", "bundled:stories260k"])
def test_revision_on_a_local_or_bundled_model_is_refused(stories, tmp_path, model):
    """--revision picks a hub commit; on a folder (or a bundled model) it would be ignored."""
    source = str(stories) if model == "local" else model
    result = run_cli("expand", source, "--out", tmp_path / "out", "--revision", "main")
    one_error_line(result, message="--revision main names a hub revision")
    assert not (tmp_path / "out").exists()
