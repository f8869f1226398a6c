"""The activation-matched OT variant (``--ot-variant activation``, issue 16): running statistics
equal the kept-activation ones, a planted permutation is recovered from activations, identity is
kept, the output is function-preserving bit for bit, the manifest records the calibration, and bad
calibration input is one `error:` line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from otdus_cli.bundled import STORIES260K
from otdus_cli.cli import app
from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.methods.ot import OTOptions
from otdus_cli.methods.ot.calibration import (
    MIN_CALIB_TOKENS,
    PairMoments,
    correlation_from,
    head_correlation,
)
from otdus_cli.options import ExpandOptions
from otdus_cli.study.diagnose import _head_contributions, correlation_matrix
from tests.support.cli_checks import one_error_line
from tests.support.tiny_models import DENSE_TYPES, build_tiny, load_causal_lm, logits


def test_running_moments_equal_the_kept_activation_correlations():
    """Batch-by-batch statistics (A centred, B shifted) give diagnose's correlations of kept data,
    also when every feature has a large mean (the case the shift is for)."""
    gen = torch.Generator().manual_seed(0)
    n, p, q = 700, 12, 9
    xa = torch.randn(n, p, generator=gen) * 0.1 + 5.0
    xb = xa[:, :q] * 0.7 + 0.3 * torch.randn(n, q, generator=gen) - 3.0
    moments = PairMoments()
    moments.set_a(xa.clone())
    for s in range(0, n, 128):
        moments.add_b(xb[s : s + 128], s)
    got = moments.finish()
    direct = correlation_matrix(xa.double(), xb.double())
    running = correlation_from(got["cross"], got["var_a"], got["var_b"]).double()
    assert torch.allclose(running, direct, atol=1e-4)


def test_head_correlation_from_statistics_equals_diagnose_contributions():
    gen = torch.Generator().manual_seed(1)
    n, n_q, hd, hidden = 400, 4, 3, 10
    oa = torch.randn(n, n_q * hd, generator=gen) + 1.0
    ob = oa[:, torch.randperm(n_q * hd, generator=gen)] + 0.5 * torch.randn(n, n_q * hd, generator=gen)
    wa, wb = torch.randn(hidden, n_q * hd, generator=gen), torch.randn(hidden, n_q * hd, generator=gen)
    moments = PairMoments(blocks=n_q)
    moments.set_a(oa.clone())
    for s in range(0, n, 64):
        moments.add_b(ob[s : s + 64], s)
    st = moments.finish()
    got = head_correlation(st["cross"], st["auto_a"], st["auto_b"], wa, wb)
    ha = _head_contributions(oa.double(), wa, n_q)
    hb = _head_contributions(ob.double(), wb, n_q)
    assert torch.allclose(got.double(), correlation_matrix(ha.T, hb.T), atol=1e-4)


# ------------------------------------------------------------------ planted permutation

A_LAYER, B_LAYER = 3, 4  # the pair of one new top layer on the 5-layer stories260K


def _plant(folder: Path, permute: bool, seed: int = 0) -> dict:
    """Layer 3 made nearly transparent (down zero, o scaled by 1e-4: layer 4 reads what layer 3
    reads, up to 1e-4), layer 4 = layer 3 with its MLP neurons, KV groups (with their query heads,
    permuted inside the group) and V dims inside heads permuted. Returns the planted orders."""
    cfg = json.loads((folder / "config.json").read_text())
    n_q, n_kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = n_q // n_kv
    weights = load_file(str(folder / "model.safetensors"))
    a = f"model.layers.{A_LAYER}."
    b = f"model.layers.{B_LAYER}."
    weights[a + "mlp.down_proj.weight"] = torch.zeros_like(weights[a + "mlp.down_proj.weight"])
    weights[a + "self_attn.o_proj.weight"] = weights[a + "self_attn.o_proj.weight"] * 1e-4
    gen = torch.Generator().manual_seed(seed)
    n_mlp = cfg["intermediate_size"]
    if permute:
        mlp = torch.randperm(n_mlp, generator=gen)
        kv_order = torch.randperm(n_kv, generator=gen).tolist()  # B's group j is A's group kv_order[j]
        q_order = [kv_order[j] * g + int(i) for j in range(n_kv) for i in torch.randperm(g, generator=gen)]
        v_dims = [torch.randperm(hd, generator=gen) for _ in range(n_kv)]
    else:
        mlp, kv_order, q_order = torch.arange(n_mlp), list(range(n_kv)), list(range(n_q))
        v_dims = [torch.arange(hd) for _ in range(n_kv)]
    q_rows = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in q_order])
    k_rows = torch.cat([torch.arange(i * hd, (i + 1) * hd) for i in kv_order])
    v_rows = torch.cat([i * hd + v_dims[j] for j, i in enumerate(kv_order)])
    o_cols = torch.cat([q_order[h] * hd + v_dims[h // g] for h in range(n_q)])
    for name in list(weights):
        if name.startswith(a):
            weights[b + name[len(a) :]] = weights[name].clone()
    weights[b + "mlp.gate_proj.weight"] = weights[a + "mlp.gate_proj.weight"][mlp]
    weights[b + "mlp.up_proj.weight"] = weights[a + "mlp.up_proj.weight"][mlp]
    weights[b + "mlp.down_proj.weight"] = weights[a + "mlp.down_proj.weight"][:, mlp]
    for role, rows in (("q", q_rows), ("k", k_rows), ("v", v_rows)):
        weights[b + f"self_attn.{role}_proj.weight"] = weights[a + f"self_attn.{role}_proj.weight"][rows]
    weights[b + "self_attn.o_proj.weight"] = weights[a + "self_attn.o_proj.weight"][:, o_cols]
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    # A's head i -> B's head: q_perm[q_order[h]] = h; A's group kv_order[j] -> j
    q_perm = [0] * n_q
    for h, src in enumerate(q_order):
        q_perm[src] = h
    kv_perm = [0] * n_kv
    for j, src in enumerate(kv_order):
        kv_perm[src] = j
    return {"q_perm": q_perm, "kv_perm": kv_perm}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    cache: dict = {}

    def get(permute: bool, solver: str):
        if (permute, solver) not in cache:
            root = tmp_path_factory.mktemp("planted")
            src = Path(shutil.copytree(STORIES260K, root / "src"))
            orders = _plant(src, permute)
            out = root / "out"
            opts = ExpandOptions(method="ot", layers=1, ot=OTOptions(variant="activation", solver=solver))
            result = expand(str(src), out, opts)
            cache[permute, solver] = (src, out, result.manifest, orders)
        return cache[permute, solver]

    return get


def _tensor(folder: Path, layer: int, name: str) -> torch.Tensor:
    return CheckpointReader(folder).get(f"model.layers.{layer}.{name}").float()


ALIGNED = [f"mlp.{m}_proj.weight" for m in ("gate", "up")] + [f"self_attn.{m}_proj.weight" for m in "qkv"]


@pytest.mark.parametrize("solver", ["emd", "sinkhorn"])
@pytest.mark.parametrize("permute", [True, False], ids=["planted", "identity"])
def test_planted_permutation_is_recovered_from_activations(planted, permute, solver):
    """B = A with MLP neurons, head groups and V dims permuted: the activation plans undo it, so A
    aligned onto B is B and the new layer is B's weights (exactly for the exact solver); with no
    permutation the plans are the identity."""
    src, out, manifest, orders = planted(permute, solver)
    new = next(lay for lay in manifest["layers"] if lay["new"])
    assert new["parents"] == [A_LAYER, B_LAYER]
    modules = manifest["transport"][str(new["index"])]["modules"]
    assert modules["heads"]["kv_perm"] == orders["kv_perm"]
    assert modules["heads"]["q_perm"] == orders["q_perm"]
    assert modules["heads"]["identity"] is (not permute)
    assert modules["heads"]["correlation_matched"] > 0.99
    assert modules["gate_up"]["permutation_closeness"] > (0.999 if solver == "emd" else 0.9)
    for name in ALIGNED:
        built, b = _tensor(out, new["index"], name), _tensor(src, B_LAYER, name)
        if solver == "emd":
            assert torch.equal(built, b), name
        else:
            # the entropic plan leaks a little mass (reg 0.06): ~0.2% here
            assert (built - b).norm() < 1e-2 * b.norm(), name


def test_output_is_function_preserving_bit_for_bit(tmp_path):
    out = tmp_path / "act"
    expand(str(STORIES260K), out, ExpandOptions(method="ot", layers=2, ot=OTOptions(variant="activation")))
    base, grown = load_causal_lm(STORIES260K), load_causal_lm(out)
    assert grown.config.num_hidden_layers == base.config.num_hidden_layers + 2
    assert torch.equal(logits(base), logits(grown))


def test_manifest_records_variant_and_calibration(planted):
    _, _, manifest, _ = planted(False, "emd")
    assert manifest["options"]["ot"]["variant"] == "activation"
    calib = manifest["ot_choices"]["calibration"]
    assert calib == {
        "value": "bundled:tinystories-sample, at most 4096 tokens (whole windows of 256), streamed through "
        "the source layer by layer",
        "source": "otdus",
    }
    report = manifest["ot"]["calibration"]
    assert report["text"] == "bundled:tinystories-sample" and report["pairs"] == [[A_LAYER, B_LAYER]]
    assert MIN_CALIB_TOKENS <= report["tokens"] <= report["tokens_asked"] == 4096
    assert report["tokens"] == report["windows"] * report["seq_len"]


def test_weight_variants_record_no_calibration(tmp_path):
    result = expand(str(STORIES260K), tmp_path / "s", ExpandOptions(method="ot", layers=1))
    assert "ot" not in result.manifest
    assert result.manifest["ot_choices"]["calibration"]["value"] == "none (plans from weights only)"
    assert "ot.calib" in result.manifest["ignored_options"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--calib", "{missing}"], "text file not found"),
        (["--calib", "{short}"], "fewer than the 512"),
        (["--calib-tokens", "100"], "--calib-tokens 100"),
    ],
)
def test_bad_calibration_is_one_error_line(tmp_path, extra, message):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time there was a cat.\n")
    args = [a.format(missing=tmp_path / "nope.txt", short=short) for a in extra]
    out = tmp_path / "out"
    cmd = ["expand", str(STORIES260K), "-o", str(out), "--ot-variant", "activation", "--layers", "1"]
    result = CliRunner().invoke(app, [*cmd, *args])
    one_error_line(result, message=message)
    assert not out.exists()


def test_moe_models_are_refused_in_one_line(tmp_path):
    from otdus_cli.errors import OtdusError
    from tests.support.tiny_models import MOE_TYPES

    src = build_tiny(MOE_TYPES[0], tmp_path / "moe")
    with pytest.raises(OtdusError, match="mixture of experts"):
        expand(
            str(src),
            tmp_path / "out",
            ExpandOptions(method="ot", layers=1, ot=OTOptions(variant="activation")),
        )
    assert not (tmp_path / "out").exists()


def _word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the bundled sample's most frequent words (ids < vocab_size), so
    a tiny random model of any family can read calibration text."""
    import collections
    import re

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from otdus_cli.bundled import TINYSTORIES_SAMPLE

    words = re.findall(r"\w+|[^\w\s]", TINYSTORIES_SAMPLE.read_text(encoding="utf-8"))
    common = [w for w, _ in collections.Counter(words).most_common(vocab_size - 2)]
    vocab = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(common)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>").save_pretrained(folder)


@pytest.mark.parametrize("model_type", DENSE_TYPES)
def test_every_dense_family_builds_function_preserving(tmp_path, model_type):
    """The hooks find o_proj / down_proj in every dense family's transformers classes (sliding
    windows, Gemma's sandwich norms, Phi-3's fused tensors), and the output keeps the function."""
    src = build_tiny(model_type, tmp_path / "src")
    base = load_causal_lm(src)
    _word_tokenizer(src, base.config.vocab_size)
    out = tmp_path / "out"
    result = expand(str(src), out, ExpandOptions(method="ot", layers=1, ot=OTOptions(variant="activation")))
    assert result.manifest["ot"]["calibration"]["tokens"] >= MIN_CALIB_TOKENS
    assert torch.equal(logits(base), logits(load_causal_lm(out)))


def test_calibration_memory_is_bounded_whatever_the_number_of_pairs():
    """Kept activations + running sums peak at two layers' inputs + one pair's cross-products,
    the same for a chain of 2 pairs as of 4 (every adjacent pair of the model): statistics of a
    finished pair leave memory at once, and no layer's inputs outlive its pair."""
    from otdus_cli.arch.family_lookup import family_for
    from otdus_cli.methods.ot.calibration import (
        DEFAULT_CALIB,
        calibration_windows,
        capture_pair_activations,
    )

    config = json.loads((STORIES260K / "config.json").read_text())
    family = family_for(config)
    windows = calibration_windows(STORIES260K, DEFAULT_CALIB, 4096, config["max_position_embeddings"])
    n_q, hd, inter = config["num_attention_heads"], config["head_dim"], config["intermediate_size"]
    tokens, dq = windows.numel(), n_q * hd
    got: list = []

    def peak(pairs):
        return capture_pair_activations(STORIES260K, pairs, windows, family.roles, n_q, got.append)

    chain4 = peak([(0, 1), (1, 2), (2, 3), (3, 4)])
    chain2 = peak([(2, 3), (3, 4)])
    assert [(p.a, p.b) for p in got] == [(0, 1), (1, 2), (2, 3), (3, 4), (2, 3), (3, 4)]
    layer_inputs = tokens * (inter + dq) * 4
    one_pair = (inter**2 + dq**2 + 2 * n_q * hd * hd) * 4 + 4 * (inter + dq) * 8
    assert chain4 == chain2
    assert 2 * layer_inputs < chain4 <= 2 * layer_inputs + one_pair
