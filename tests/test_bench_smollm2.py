"""docs/benchmarks.md's SmolLM2 block is what scripts/bench_smollm2.py renders from its stored results
(docs/bench_smollm2.json): a hand-typed figure, or results stored without rendering, fails here."""

from __future__ import annotations

import json

from scripts.bench_smollm2 import DATA, documented_block, render


def test_the_block_is_what_its_stored_results_render():
    assert documented_block() == f"\n\n{render(json.loads(DATA.read_text()))}\n", (
        "run: python -m scripts.bench_smollm2 --render"
    )


def test_the_stored_results_hold_every_command_and_both_sides_of_verify():
    from scripts.bench_smollm2 import COMMANDS

    data = json.loads(DATA.read_text())
    assert {r["label"] for r in data["surgery"]} == set(COMMANDS)
    for r in data["verify"]["rounds"]:
        assert r["plain"]["runs"] and r["verify"]["exit_code"] == 0
