"""Derived templates where a checkpoint addresses layers outside the layer list.

A parameter of a layer stored outside the layer's tensors (Inkling 2, built tiny as `make coverage`
builds it: scripts/coverage.py) is refused at plan time in one line: otdus would otherwise write a
checkpoint whose new layers load those tensors at random.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli_checks import no_output_left, one_error_line

pytestmark = pytest.mark.usefixtures("single_thread")


def _expand_cli(src: Path, out: Path, *args: str):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    return CliRunner().invoke(app, ["expand", str(src), "--out", str(out), *args])


def test_a_layer_parameter_stored_outside_the_layer_is_refused(tmp_path):
    """Inkling 2 saves each layer's attention-residual queries as model.llm.attn_res.*_queries.{i}: a
    copied layer would load them at random, so the plan is refused naming them."""
    from scripts.coverage import build

    build("inkling2_text", tmp_path / "src")
    result = _expand_cli(tmp_path / "src", tmp_path / "out", "--method", "copy")
    line = one_error_line(result, message="model.llm.attn_res.mlp_queries.0")
    assert "outside the layer's tensors (model.llm.layers.0.*)" in line
    assert "loads layer 0's mlp_input.query" in line and "at random" in line
    no_output_left(tmp_path)
