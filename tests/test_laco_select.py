"""`otdus shrink --select laco` (otdus_cli/laco_select.py): LaCo's top-down loop of tentative merges,
kept while the last hidden states stay similar to the source's, on a planted case and on the loop's
own rules (the step after a kept merge, the cap), and its refusals."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.laco_select import laco_select
from otdus_cli.options import ExpandOptions
from otdus_cli.shrink import ShrinkOptions, shrink
from otdus_cli.source import open_source
from tests.support.cli_checks import no_output_left, one_error_line

pytestmark = [pytest.mark.usefixtures("single_thread")]

runner = CliRunner()


@pytest.fixture(scope="module")
def near_twins(tmp_path_factory):
    """stories260K with layer 2 duplicated (6 layers: 0 1 2 2' 3 4), the copy's weights perturbed by
    0.1% noise: layers 2 and 3 near-identical, every other adjacent pair dissimilar."""
    folder = tmp_path_factory.mktemp("laco") / "twins"
    expand("bundled:stories260k", folder, ExpandOptions(method="interpose", after=[2]))
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.startswith("model.layers.3."):
            tensors[name] = t + 1e-3 * t.abs().mean() * torch.randn(t.shape, generator=gen)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _options(**fields) -> ShrinkOptions:
    return ShrinkOptions(
        **({"method": "average", "select": "laco", "laco_merge": 2, "calib_tokens": 512} | fields)
    )


def test_the_near_identical_pair_is_merged_and_the_dissimilar_pair_is_not(near_twins, tmp_path):
    source = open_source(str(near_twins))
    every = laco_select(source, _options(laco_threshold=1.0))  # nothing kept: every pair's similarity
    similarity = {tuple(t["layers"]): t["similarity"] for t in every.tried}
    assert list(similarity) == [(3, 4), (2, 3), (1, 2), (0, 1)]  # top down, one step at a time
    others = max(s for pair, s in similarity.items() if pair != (2, 3))
    assert similarity[2, 3] > others
    threshold = (similarity[2, 3] + others) / 2
    result = shrink(str(near_twins), tmp_path / "out", _options(laco_threshold=threshold))
    record = result.manifest["shrink"]
    assert record["select"] == "laco" and record["removed"] == [3] and record["merged"] == [[2, 3]]
    tried = record["laco"]["tried"]
    assert [(t["layers"], t["accepted"]) for t in tried[:2]] == [([3, 4], False), ([2, 3], True)]
    assert not any(t["accepted"] for t in tried[2:])
    assert CheckpointReader(tmp_path / "out").config["num_hidden_layers"] == 5


def test_after_a_kept_merge_the_loop_steps_down_by_the_interval_and_stops_at_the_cap(near_twins):
    source = open_source(str(near_twins))
    trace = laco_select(source, _options(laco_threshold=-1.0))  # every merge kept
    assert [t["layers"] for t in trace.tried] == [[3, 4], [2, 3, 4], [1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert trace.removed == [1, 2, 3, 4]
    two = laco_select(source, _options(laco_threshold=-1.0, laco_interval=2))
    assert [t["layers"] for t in two.tried] == [[3, 4], [1, 2]] and two.removed == [2, 4]
    capped = laco_select(source, _options(laco_threshold=-1.0, layers=2))
    assert capped.removed == [3, 4] and len(capped.tried) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "ot"], "--select laco tries each merge on the calibration text"),
        (["--laco-merge", "7"], "--laco-merge 7: LaCo's first merge takes the 7 layers below --laco-top 4"),
        (["--laco-merge", "2", "--laco-threshold", "1"], "--select laco kept no merge"),
    ],
)
def test_laco_selections_that_cannot_run_are_one_line_and_exit_two(tmp_path, args, message):
    argv = ["shrink", "bundled:stories260k", "--out", str(tmp_path / "out"), "--select", "laco"]
    result = runner.invoke(app, [*argv, "--method", "laco", "--calib-tokens", "512", *args])
    one_error_line(result, 2, message)
    no_output_left(tmp_path)
