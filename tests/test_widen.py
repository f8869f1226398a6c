"""`otdus widen`: experts E -> 2E and top-k k -> 2k on every MoE family's tiny transformers model.

With --noise 0 the widened model computes the base's function: its logits equal the base's to within
rounding. Not bit for bit: the router's softmax now sums 2E terms and the expert outputs are added
in another order, so a few ulps move (measured: max |diff| 9e-8 on logits of magnitude ~0.5 for all
four families); ATOL allows 20 times that and is still 10 times below what the default noise does
(the smallest: 5.5e-5 on the tiny Qwen2-MoE that transformers 4.57 draws, 27 ATOL; 5e-4 to 5e-3 on
the others and under transformers 5).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from otdus_cli.bundled import STORIES260K
from otdus_cli.cli import app
from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.options import ExpandOptions
from otdus_cli.source import open_source
from otdus_cli.verify.compare import verify_expansion
from otdus_cli.verify.proof import static_check
from otdus_cli.widen import WidenOptions, make_widen_plan, widen
from tests.support.cli_checks import no_output_left, one_error_line
from tests.support.eval_sets import random_eval_set
from tests.support.tiny_models import MOE_TYPES, build_tiny, load_causal_lm, logits

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]

ATOL = 2e-6
runner = CliRunner()

COUNT_FIELD = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "olmoe": "num_experts"}


def _tensors(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_noise_zero_keeps_the_function_and_noise_moves_it(tiny_models, tmp_path, model_type):
    base_dir = tiny_models[model_type]
    exact = widen(str(base_dir), tmp_path / "w0", WidenOptions(noise=0))
    noisy = widen(str(base_dir), tmp_path / "w1")  # default alpha = 0.01
    base = logits(load_causal_lm(base_dir))
    grown = load_causal_lm(tmp_path / "w0")
    assert grown.config.num_experts_per_tok == 4
    config = json.loads((tmp_path / "w0" / "config.json").read_text())
    count = (
        config.get(COUNT_FIELD.get(model_type))
        or config.get("num_experts")
        or config.get("num_local_experts")
    )
    assert count == 8 and config["num_experts_per_tok"] == 4
    assert (logits(grown) - base).abs().max() <= ATOL
    assert (logits(load_causal_lm(tmp_path / "w1")) - base).abs().max() > 10 * ATOL
    assert exact.plan.moe_layers == [0, 1, 2, 3]
    # expert e + 4 is expert e; originals keep their bytes; router rows copied
    b, w0, w1 = _tensors(base_dir), _tensors(tmp_path / "w0"), _tensors(tmp_path / "w1")
    block = exact.plan.layout.block
    down = exact.plan.layout.down
    name = f"model.layers.1.{block}experts.%d.{down}.weight"
    assert torch.equal(w0[name % 6], b[name % 2]) and torch.equal(w1[name % 2], b[name % 2])
    router = f"model.layers.1.{block}gate.weight"
    assert torch.equal(w0[router], torch.cat([b[router], b[router]]))
    # noisy copies: relative change about alpha (std of N(0, (0.01 std)^2) over the weight's spread)
    rel = float((w1[name % 6] - b[name % 2]).std() / b[name % 2].std())
    assert 0.005 < rel < 0.02, rel
    assert not torch.equal(w1[router][4:], b[router]) and torch.equal(w1[router][:4], b[router])
    manifest = noisy.manifest
    assert manifest["method"] == "widen" and manifest["widen"]["experts"] == [4, 8]
    assert manifest["widen"]["top_k"] == [2, 4] and manifest["function_preserving"] is False
    assert exact.manifest["function_preserving"] is True
    assert name % 6 in manifest["new_parameters"] and name % 2 not in manifest["new_parameters"]


def test_qwen2_moe_shared_expert_is_left_dense(tiny_models, tmp_path):
    widen(str(tiny_models["qwen2_moe"]), tmp_path / "w")
    b, w = _tensors(tiny_models["qwen2_moe"]), _tensors(tmp_path / "w")
    for name in b:
        if "shared_expert" in name:
            assert torch.equal(w[name], b[name]), name
    assert not any("shared_expert" in n and n not in b for n in w)


def test_noise_is_seeded_and_reproducible(tiny_models, tmp_path):
    src = str(tiny_models["mixtral"])
    widen(src, tmp_path / "a", WidenOptions(seed=3))
    widen(src, tmp_path / "b", WidenOptions(seed=3, max_shard_size="20KB"))  # other shards, same tensors
    widen(src, tmp_path / "c", WidenOptions(seed=4))
    a, c = _tensors(tmp_path / "a"), _tensors(tmp_path / "c")
    b = CheckpointReader(tmp_path / "b")
    assert all(torch.equal(b.get(n), t) for n, t in a.items())
    copy = "model.layers.0.block_sparse_moe.experts.5.w1.weight"
    assert not torch.equal(a[copy], c[copy])


def test_each_expert_tensor_is_read_once_for_all_its_copies(tiny_models, tmp_path, monkeypatch):
    """factor 3, noise on: an expert matrix feeds three outputs (itself, two noisy copies) from one
    read; the original's bytes are unchanged. (The old writer read it once per noisy copy.)"""
    src = tiny_models["mixtral"]
    reads: dict[str, int] = {}
    get = CheckpointReader.get

    def counting_get(self, name):
        reads[name] = reads.get(name, 0) + 1
        return get(self, name)

    monkeypatch.setattr(CheckpointReader, "get", counting_get)
    widen(str(src), tmp_path / "w", WidenOptions(factor=3))
    expert = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    assert reads[expert] == 1 and reads["model.layers.0.block_sparse_moe.gate.weight"] == 1
    assert all(count == 1 for count in reads.values()), reads
    monkeypatch.undo()
    out, base = CheckpointReader(tmp_path / "w"), CheckpointReader(src)
    assert torch.equal(out.get(expert), base.get(expert))
    copies = [out.get(expert.replace("experts.1.", f"experts.{e}.")) for e in (5, 9)]
    assert not torch.equal(copies[0], copies[1]) and all(not torch.equal(c, base.get(expert)) for c in copies)


def test_factor_three(tiny_models, tmp_path):
    result = widen(str(tiny_models["olmoe"]), tmp_path / "w", WidenOptions(factor=3, noise=0))
    grown = load_causal_lm(tmp_path / "w")
    assert grown.config.num_experts == 12 and grown.config.num_experts_per_tok == 6
    assert (logits(grown) - logits(load_causal_lm(tiny_models["olmoe"]))).abs().max() <= ATOL
    assert result.manifest["widen"]["experts"] == [4, 12]


def test_verify_expects_parity_only_without_noise(tiny_models, tmp_path):
    src = tiny_models["qwen3_moe"]
    widen(str(src), tmp_path / "w0", WidenOptions(noise=0))
    widen(str(src), tmp_path / "w1")
    plan = random_eval_set()
    exact = verify_expansion(src, tmp_path / "w0", plan)
    assert exact.expect_parity and exact.exit_code == 0 and exact.verdict.startswith("PARITY"), exact.verdict
    assert "widened experts" in exact.tolerance and exact.proof.preserving
    noisy = verify_expansion(src, tmp_path / "w1", plan)
    assert not noisy.expect_parity and noisy.exit_code == 0
    assert noisy.verdict.startswith("no parity expected") and not noisy.proof.preserving
    assert "unchanged" not in noisy.verdict and " -> " in noisy.verdict  # the change, however small
    assert "differ" in noisy.proof.layers[0].note
    assert static_check(src, tmp_path / "w0").claims_preserving is True
    assert static_check(src, tmp_path / "w1").claims_preserving is False


def test_expand_then_widen_records_both(tiny_models, tmp_path):
    deeper = tmp_path / "deeper"
    expand(str(tiny_models["mixtral"]), deeper, ExpandOptions(method="interpose", layers=2, zero_init=True))
    result = widen(str(deeper), tmp_path / "wide", WidenOptions(noise=0))
    assert result.manifest["num_hidden_layers"] == 6 and result.plan.moe_layers == list(range(6))
    assert [m["method"] for m in result.manifest["history"]] == ["interpose"]
    base = logits(load_causal_lm(tiny_models["mixtral"]))
    assert (logits(load_causal_lm(tmp_path / "wide")) - base).abs().max() <= ATOL


def test_expand_then_widen_verifies_against_the_original_base(tiny_models, tmp_path):
    """OT depth growth, then widen: verify against the ORIGINAL base composes the two recorded layer
    maps (the old code refused that base: 'not the model this expansion was made from')."""
    src = tiny_models["mixtral"]
    deeper = tmp_path / "deeper"
    expand(str(src), deeper, ExpandOptions(method="ot", layers=2))
    plan = random_eval_set()
    for noise in (0.0, 0.01):
        out = tmp_path / f"wide-{noise}"
        widen(str(deeper), out, WidenOptions(noise=noise))
        proof = static_check(src, out)
        assert "layer map composed through the recorded steps (ot then widen)" in proof.base_checks
        new = [e["new"] for e in proof.claimed]
        assert len(new) == 6 and sum(new) == 2
        assert [f.identity for f in proof.layers] == new  # OT's zero-init layers, widened: still zero
        assert proof.claims_preserving is (noise == 0) and proof.preserving is (noise == 0)
        report = verify_expansion(src, out, plan)
        assert report.expect_parity is (noise == 0) and report.exit_code == 0
        assert report.verdict.startswith("PARITY" if noise == 0 else "no parity expected"), report.verdict
        assert static_check(deeper, out).preserving is (noise == 0)  # the last step's source still works
    other = build_tiny("mixtral", tmp_path / "other", seed=1)
    with pytest.raises(OtdusError, match="neither the model the last step was made from nor the first"):
        static_check(other, tmp_path / "wide-0.0")


def test_expand_experts_grows_depth_and_width_in_one_command(tiny_models, tmp_path):
    """`expand --experts 2`: one output, its manifest seen from the original model (verify's default
    base), the expansion's record in history, no scratch folder left; OT zero-init + noise 0 keeps the
    function. Dense models are refused before any expansion; --expert-noise alone is refused."""
    src = tiny_models["qwen3_moe"]
    out = tmp_path / "both"
    args = ["expand", str(src), "--out", str(out), "--method", "ot", "--layers", "2", "--experts", "2"]
    result = runner.invoke(app, [*args, "--expert-noise", "0", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (
        summary["num_hidden_layers"] == 6 and summary["experts"] == [4, 8] and summary["function_preserving"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["both"]  # the deeper model's scratch is gone
    manifest = json.loads((out / "otdus.json").read_text())
    assert manifest["source"]["path"] == str(src) and manifest["method"] == "widen"
    assert [m["method"] for m in manifest["history"]] == ["ot"]
    assert [e["new"] for e in manifest["layers"]].count(True) == 2
    assert all(e.get("widened") for e in manifest["layers"] if not e["new"])
    assert (logits(load_causal_lm(out)) - logits(load_causal_lm(src))).abs().max() <= ATOL
    report = verify_expansion(src, out, random_eval_set())
    assert report.verdict.startswith("PARITY") and report.proof.preserving, report.verdict
    assert "layer map composed" not in " ".join(report.proof.base_checks)  # recorded against src itself
    noisy = runner.invoke(app, [*args[:3], str(tmp_path / "noisy"), *args[4:], "--json"])
    assert noisy.exit_code == 0 and not json.loads(noisy.stdout)["function_preserving"]
    shutil.rmtree(tmp_path / "noisy")
    shutil.rmtree(out)
    dense = runner.invoke(app, ["expand", str(tiny_models["llama"]), "--out", str(out), "--experts", "2"])
    one_error_line(dense, message="llama is a dense model")
    no_output_left(tmp_path, "both")
    alone = runner.invoke(app, [*args[:-2], "--expert-noise", "0"])
    one_error_line(alone, message="give --experts too")


def test_dense_models_are_refused_with_one_line_and_nothing_written(tiny_models, tmp_path):
    result = runner.invoke(app, ["widen", str(tiny_models["llama"]), "--out", str(tmp_path / "out")])
    one_error_line(result, message="llama is a dense model")
    no_output_left(tmp_path)
    result = runner.invoke(
        app, ["widen", str(tiny_models["olmoe"]), "--out", str(tmp_path / "out"), "--factor", "1"]
    )
    assert result.exit_code == 2
    no_output_left(tmp_path)


def test_group_limited_routing_is_refused(tiny_models, tmp_path):
    folder = tmp_path / "grouped"
    shutil.copytree(tiny_models["olmoe"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_group": 2, "topk_group": 1}))
    result = runner.invoke(app, ["widen", str(folder), "--out", str(tmp_path / "out")])
    one_error_line(result, message="group-limited routing")
    no_output_left(tmp_path)


def test_cli_json_summary(tiny_models, tmp_path):
    result = runner.invoke(
        app, ["widen", str(tiny_models["mixtral"]), "--out", str(tmp_path / "w"), "--noise", "0", "--json"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["experts"] == [4, 8] and summary["top_k"] == [2, 4] and summary["function_preserving"]


def test_library_refuses_negative_noise():
    with pytest.raises(ValueError):
        WidenOptions(noise=-0.1)
    with pytest.raises(OtdusError, match="dense"):
        make_widen_plan(open_source(str(STORIES260K)), WidenOptions())
