"""Hub ids resolve through huggingface_hub's real cache.

Offline, a cached model works and a missing one is one error line.
"""

from __future__ import annotations

import json

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
