"""Perplexity of the real stories260K model, and base-vs-expanded lockstep parity."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from otdus_cli.bundled import STORIES260K, TINYSTORIES_SAMPLE
from otdus_cli.errors import OtdusError
from otdus_cli.verify.compare import verify_expansion
from otdus_cli.verify.eval_set import make_eval_set
from otdus_cli.verify.layer_map import correspondence, layer_entries, manifest_base_path
from otdus_cli.verify.perplexity import perplexity
from otdus_cli.verify.text import Corpus, text_corpus, wikitext_corpus

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]

# The real model and its in-domain text are shipped inside the package (see otdus_cli/bundled.py).
STORIES = Path(STORIES260K)
SAMPLE = Path(TINYSTORIES_SAMPLE)
# small_plan's token perplexity of stories260K with RoPE base 500,000 and Llama 3 scaling
PPL_ROPE_PARAMETERS = 50.0247


@pytest.fixture(scope="module")
def story_plan():
    """The 5 TinyStories, one BOS per story, windows of the model's 512 positions."""
    corpus = text_corpus(SAMPLE)
    return make_eval_set(STORIES, corpus=corpus, protocol="token", seq_len=512, token_mode="documents")


@pytest.fixture(scope="module")
def small_plan():
    corpus = text_corpus(SAMPLE, max_docs=2)
    return make_eval_set(
        STORIES, corpus=corpus, protocol="token", seq_len=512, token_mode="documents", max_tokens=200
    )


@pytest.fixture(scope="module")
def story_report(story_plan):
    return perplexity(STORIES, story_plan)


def test_stories260k_token_perplexity(story_report):
    m = story_report.metrics
    assert m.n_tokens == 1804 and m.n_docs == 5
    assert m.token_perplexity == pytest.approx(3.548, abs=2e-3)  # the fixture README's figure


def test_stories260k_wikitext_protocol_smoke():
    page = wikitext_corpus(max_docs=1).documents[0][:1500]  # the start of the first article
    plan = make_eval_set(
        STORIES, corpus=Corpus("wiki", [page], "wikitext"), protocol="wikitext", max_length=128
    )
    m = perplexity(STORIES, plan).metrics
    assert m.protocol == "wikitext" and m.n_docs == 1 and m.context == 128 and m.n_windows > 1
    assert m.n_words > 200 and m.n_bytes == 1500
    assert all(math.isfinite(v) for v in m.values().values())
    assert m.bits_per_byte == pytest.approx(math.log2(m.byte_perplexity))
    assert m.word_perplexity > m.byte_perplexity  # out of domain for a TinyStories model, but sane


def _expand(out: Path, after: int, o_proj_value: float = 0.0, function_preserving: bool = True) -> Path:
    """stories260K with one new layer after base layer `after`: a copy of it with o_proj/down_proj zeroed
    (or set to `o_proj_value`), written with plain safetensors plus a manifest."""
    out.mkdir()
    state = load_file(STORIES / "model.safetensors")
    config = json.loads((STORIES / "config.json").read_text())
    depth = config["num_hidden_layers"]
    sources = list(range(after + 1)) + [after] + list(range(after + 1, depth))
    new_state = {k: v for k, v in state.items() if not k.startswith("model.layers.")}
    for j, i in enumerate(sources):
        prefix = f"model.layers.{i}."
        for name, tensor in state.items():
            if name.startswith(prefix):
                t = tensor.clone()
                if j == after + 1 and ("o_proj" in name or "down_proj" in name):
                    t.fill_(o_proj_value)
                new_state[f"model.layers.{j}." + name[len(prefix) :]] = t
    save_file(new_state, out / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = depth + 1
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(STORIES / name, out / name)
    layers = [
        {
            "index": j,
            "source": i,
            "new": j == after + 1,
            "parents": [after, after + 1] if j == after + 1 else [i],
            "zero_init": j == after + 1,
        }
        for j, i in enumerate(sources)
    ]
    manifest = {
        "otdus_version": "test",
        "method": "copy",
        "num_hidden_layers": depth + 1,
        "function_preserving": function_preserving,
        "layers": layers,
        "source": {"id": str(STORIES), "path": str(STORIES)},
    }
    (out / "otdus.json").write_text(json.dumps(manifest))
    return out


def test_lockstep_parity_with_zero_init_layer(tmp_path, story_plan):
    expanded = _expand(tmp_path / "exp", after=2)
    report = verify_expansion(STORIES, expanded, story_plan)
    assert report.expect_parity and report.parity and report.exit_code == 0
    assert report.verdict.startswith("PARITY")
    assert report.logits_equal and report.logprob_max_abs_diff == 0.0
    assert report.first_divergence is None
    assert report.base.token_perplexity == report.expanded.token_perplexity
    assert report.base.token_perplexity == pytest.approx(3.548, abs=2e-3)
    assert all(v == 0.0 for v in report.deltas.values())
    # embeddings + one check per expanded layer; the new layer is compared with base layer 2's output
    assert [(c.expanded_layer, c.base_layer) for c in report.checks] == [
        (-1, -1),
        (0, 0),
        (1, 1),
        (2, 2),
        (3, 2),
        (4, 3),
        (5, 4),
    ]
    assert all(c.equal for c in report.checks)
    assert manifest_base_path(expanded) == str(STORIES)
    json.dumps(report.to_dict())  # serialisable for --json


def test_a_rope_stated_only_in_rope_parameters_is_read_alike_by_transformers_4_and_5(tmp_path, small_plan):
    """A source saved by transformers 5 states its RoPE (base, Llama 3 scaling) only in
    rope_parameters, which 4.57 ignores; the output also states rope_theta and rope_scaling. Read as
    config.json says, 4.57 would run the base with another RoPE than the output and call a
    function-preserving expansion BROKEN: both are read with the RoPE rope_parameters states, in
    either version, with the same figures."""
    from otdus_cli.expand import expand
    from otdus_cli.options import ExpandOptions

    source = tmp_path / "src"
    shutil.copytree(STORIES, source)
    config = json.loads((source / "config.json").read_text())
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    config["rope_parameters"] |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config["rope_parameters"] |= {"original_max_position_embeddings": 64}
    (source / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    expand(str(source), out, ExpandOptions(method="ot", layers=1))
    report = verify_expansion(source, out, small_plan)
    assert report.parity and report.verdict.startswith("PARITY")
    assert report.base.token_perplexity == pytest.approx(PPL_ROPE_PARAMETERS, rel=1e-5)


def test_lockstep_names_the_broken_layer(tmp_path, small_plan):
    expanded = _expand(tmp_path / "exp", after=1, o_proj_value=0.01)
    report = verify_expansion(STORIES, expanded, small_plan)
    assert report.expect_parity and not report.parity and report.exit_code == 1
    assert report.verdict.startswith("BROKEN")
    first = report.first_divergence
    assert first is not None and first.expanded_layer == 2 and first.base_layer == 1
    assert "new layer 2" in first.name and first.max_abs_diff > 0
    assert "new layer 2" in report.verdict
    assert [c.equal for c in report.checks[:3]] == [True, True, True]  # embeddings, layers 0 and 1
    assert report.deltas["token_perplexity"] != 0


def test_verdicts_hold_when_logits_come_in_small_chunks(tmp_path, small_plan, monkeypatch):
    # one model's head and one chunk of logits at a time: chunks are compared by digest
    from otdus_cli.verify import head_pass

    monkeypatch.setattr(head_pass, "DEFAULT_MAX_LOGITS_BYTES", 3 * 512 * 4)  # 3 positions (vocab 512)
    report = verify_expansion(STORIES, _expand(tmp_path / "ok", after=1), small_plan)
    assert report.parity and report.logits_equal and report.logprob_max_abs_diff == 0.0
    broken = verify_expansion(STORIES, _expand(tmp_path / "bad", after=1, o_proj_value=0.01), small_plan)
    assert broken.exit_code == 1 and not broken.logits_equal and broken.logprob_max_abs_diff > 0


def test_not_function_preserving_is_reported_not_failed(tmp_path, small_plan):
    # a new layer the map says is not zero-initialised, and whose o_proj/down_proj are not zero
    expanded = _expand(tmp_path / "exp", after=1, o_proj_value=0.01, function_preserving=False)
    manifest = json.loads((expanded / "otdus.json").read_text())
    manifest["layers"][2]["zero_init"] = False
    (expanded / "otdus.json").write_text(json.dumps(manifest))
    report = verify_expansion(STORIES, expanded, small_plan)
    assert not report.expect_parity and report.exit_code == 0
    assert report.verdict.startswith("no parity expected")
    assert not report.proof.preserving and "layer 2 is new and not an identity" in report.proof.reason


def test_a_hand_edited_boolean_does_not_turn_broken_into_a_pass(tmp_path, small_plan):
    # the map still says zero-init: the manifest's function_preserving flag is not trusted
    expanded = _expand(tmp_path / "exp", after=1, o_proj_value=0.01, function_preserving=False)
    report = verify_expansion(STORIES, expanded, small_plan)
    assert report.expect_parity and report.exit_code == 1
    assert "static check: layer 2 is new and not an identity" in report.verdict


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_tolerance_on_both_sides_of_the_threshold(tmp_path, small_plan, dtype):
    # a new layer with a small non-zero o_proj/down_proj really changes the function (float32 says
    # BROKEN); in bf16/fp16 a change well below the 1e-3 relative tolerance passes, one above fails
    def relative_change(report) -> float:
        b, e = report.base.values(), report.expanded.values()
        return max(abs(e[k] - b[k]) / abs(b[k]) for k in b if k != "loglikelihood")

    below = _expand(tmp_path / "below", after=3, o_proj_value=3e-4)
    assert verify_expansion(STORIES, below, small_plan).exit_code == 1  # float32: bitwise, so broken
    report = verify_expansion(STORIES, below, small_plan, dtype=dtype)
    assert report.dtype == dtype and "relative 0.001" in report.tolerance
    assert 0 < relative_change(report) < 0.5e-3
    assert report.parity and report.exit_code == 0 and report.verdict.startswith("PARITY")
    above = _expand(tmp_path / "above", after=3, o_proj_value=1e-2)
    report = verify_expansion(STORIES, above, small_plan, dtype=dtype)
    assert relative_change(report) > 2e-3
    assert not report.parity and report.exit_code == 1 and report.verdict.startswith("BROKEN")


def test_perplexity_is_the_same_bit_for_bit_every_run(small_plan):
    runs = [perplexity(STORIES, small_plan).metrics for _ in range(3)]
    assert runs[1].values() == runs[0].values() and runs[2].values() == runs[0].values()
    assert runs[1].to_dict() == runs[0].to_dict()


def test_batching_leaves_every_figure_unchanged(tmp_path):
    """Windows stacked through each layer (automatic batches: 32 windows of 512 tokens, then 4) score
    exactly what one window at a time scores, bit for bit; verify's parity holds in either case."""
    plan = make_eval_set(STORIES, max_tokens=8000)  # the default wikitext protocol: 36 windows of 512
    assert len(plan.windows) == 36
    one = perplexity(STORIES, plan, batch_size=1)
    auto = perplexity(STORIES, plan)
    five = perplexity(STORIES, plan, batch_size=5)
    assert (one.compute.batch_size, auto.compute.batch_size, five.compute.batch_size) == (1, 32, 5)
    assert (one.compute.batches, auto.compute.batches) == (36, 2)
    assert auto.metrics.to_dict() == one.metrics.to_dict() == five.metrics.to_dict()
    expanded = _expand(tmp_path / "exp", after=1)
    verified = [verify_expansion(STORIES, expanded, plan, batch_size=b) for b in (1, None)]
    assert [r.compute.batch_size for r in verified] == [1, 32]
    assert all(r.parity and r.logits_equal for r in verified)
    assert verified[1].base.to_dict() == verified[0].base.to_dict() == one.metrics.to_dict()


def test_mapping_function_instead_of_manifest(tmp_path, small_plan):
    expanded = _expand(tmp_path / "exp", after=0)
    (expanded / "otdus.json").unlink()
    mapping = [0, None, 1, 2, 3, 4]  # expanded layer -> base layer it copies; None = new layer
    report = verify_expansion(STORIES, expanded, small_plan, layer_map=lambda j: mapping[j])
    assert report.expect_parity and report.parity and report.exit_code == 0
    # no manifest, no map: the fingerprints give the same map, and the proof holds
    inferred = verify_expansion(STORIES, expanded, small_plan)
    assert inferred.expect_parity and inferred.parity and inferred.exit_code == 0
    assert [f.copy_of if f.base else None for f in inferred.proof.layers] == mapping
    assert inferred.proof.preserving and [f.identity for f in inferred.proof.layers] == [
        False,
        True,
        False,
        False,
        False,
        False,
    ]


def test_correspondence_rules():
    def entries(spec):
        return layer_entries(
            [{"index": j, "source": s, "new": n, "zero_init": n} for j, (s, n) in enumerate(spec)], len(spec)
        )

    # LLaMA-PRO style: new layers compare with the base state after the layer before them
    assert correspondence(entries([(0, False), (0, True), (1, False), (1, True)]), 2) == [0, 0, 1, 1]
    # a new layer before any base layer compares with the embeddings
    assert correspondence(entries([(0, True), (0, False)]), 1) == [-1, 0]
    # SOLAR style: once base layers repeat there is no corresponding base state
    assert correspondence(entries([(0, False), (1, False), (0, False), (1, False)]), 2) == [0, 1, None, None]
    with pytest.raises(OtdusError, match="lists 2 layers"):
        layer_entries([{"index": j, "new": False, "source": j} for j in range(2)], 3)


def test_streamed_and_plain_torch_agree_on_stories(story_plan, story_report):
    """Independent check of the scoring path: plain transformers forward, same windows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for w in story_plan.windows:
            logits = model(input_ids=torch.tensor([w.input_ids]), use_cache=False).logits[0]
            lp = torch.log_softmax(logits[w.offset : w.offset + len(w.targets)].float(), -1)
            total += float(lp.gather(-1, torch.tensor(w.targets)[:, None]).double().sum())
            count += len(w.targets)
    assert count == 1804
    assert math.exp(-total / count) == pytest.approx(story_report.metrics.token_perplexity, rel=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_lockstep_parity_on_cuda(tmp_path, small_plan):
    report = verify_expansion(STORIES, _expand(tmp_path / "exp", after=2), small_plan, device="cuda")
    assert report.device.startswith("cuda") and report.parity and report.exit_code == 0
    assert report.logits_equal


def test_library_takes_bundled_names_and_keeps_transformers_quiet(capfd):
    """make_eval_set refused `bundled:stories260k`, which expand accepts; transformers' warnings and loading
    bars came through the library calls."""

    corpus = Corpus("one", ["Once upon a time there was a little girl."], "text")
    plan = make_eval_set(
        "bundled:stories260k", corpus=corpus, protocol="token", seq_len=16, token_mode="documents"
    )
    report = perplexity("bundled:stories260k", plan, device="cpu")
    assert report.metrics.n_tokens > 0
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""
