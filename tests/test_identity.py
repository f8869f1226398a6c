"""Zero-init of derived templates across the causes that used to stop it (arch/identity.py).

Tensors transformers saves under other names than its class holds them (it converts them when loading:
GraniteMoE's fused experts, EXAONE 3's transformer.h.N), a bias added to the residual stream outside a
linear map (GPT-NeoX-Japanese's last layer), one layer kind no zeroing makes an identity beside kinds it
does (RWKV's first layer), a residual scale that follows the depth (MiniCPM3), a residual path scaled
by the layer's own parameters (Doge, Zaya: set to 1 in a new layer), a state handed from layer to layer
besides the hidden states (Zaya's router states), a residual stream of several streams of the hidden
width (Qwen4-Exp's hyper-connections): zero-init keeps the logits bit for bit where it can,
and verify says PARITY; where it cannot (a post-norm layer, layers that share one block's weights) one
line says why and what works instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from otdus_cli.arch.derived import layer_kinds
from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.io.safetensors_format import DATA_ALIGNMENT
from otdus_cli.options import ExpandOptions
from otdus_cli.trainable import output_set
from otdus_cli.verify.compare import verify_expansion
from tests.support.eval_sets import random_eval_set
from tests.support.tiny_models import HYBRID_BASE, HYBRID_LAYER_TYPES, load_causal_lm, logits, save_perturbed

pytestmark = pytest.mark.usefixtures("single_thread")

FIELDS = {k: v for k, v in HYBRID_BASE.items() if "token_id" not in k}
CONFIGS = {
    "granitemoe": {**FIELDS, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2},
    "exaone": {**FIELDS, "num_hidden_layers": 4},
    "gpt_neox_japanese": {**FIELDS, "num_hidden_layers": 4},
    "rwkv": {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 4, "attention_hidden_size": 32,
             "intermediate_size": 48, "context_length": 64, "rescale_every": 0},
    "minicpm3": {**FIELDS, "num_hidden_layers": 4, "num_key_value_heads": 4, "q_lora_rank": 16,
                 "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
                 "scale_depth": 1.4},
    "doge": {**FIELDS, "num_hidden_layers": 4},
    "zaya": {**FIELDS, "num_hidden_layers": 4, "num_experts": 4, "moe_intermediate_size": 16,
             "router_hidden_size": 16, "bos_token_id": 1, "eos_token_id": 2},
    "dbrx": {"vocab_size": 96, "d_model": 32, "n_heads": 4, "n_layers": 4, "max_seq_len": 64,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2}},
    # 2 residual streams of the hidden width; per-layer n-gram embeddings (PLE) on layer 2 (ids count from 1)
    "qwen4_exp_text": {**FIELDS, "num_hidden_layers": 4, "layer_types": HYBRID_LAYER_TYPES,
                       "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                       "linear_value_head_dim": 8, "linear_conv_kernel_dim": 2,
                       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                       "shared_expert_intermediate_size": 16, "hc_count": 2, "hc_lowrank": 8,
                       "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8,
                       "indexer_budget": 8, "indexer_compress_ratio": 4, "ple_layer_ids": [3],
                       "heads_per_ngram": 2, "ngram_vocab_size_base": 97,
                       "make_ngram_vocab_size_divisible_by": 8, "bos_token_id": 1, "eos_token_id": 2},
    # 4 experts with weights and 2 zero-computation experts, which add their input back where chosen
    "longcat_flash": {**FIELDS, "num_layers": 2, "num_key_value_heads": 4, "ffn_hidden_size": 48,
                      "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                      "v_head_dim": 8, "n_routed_experts": 4, "zero_expert_num": 2, "moe_topk": 2,
                      "expert_ffn_hidden_size": 16},
}  # fmt: skip


def _save(model_type: str, folder: Path, **fields) -> torch.Tensor:
    return save_perturbed(model_type, {**CONFIGS.get(model_type, {}), **fields}, folder, use_cache=False)


def _reloaded_logits(folder: Path) -> torch.Tensor:
    return logits(load_causal_lm(folder), use_cache=False)


def _grows_exactly(src: Path, out: Path, base: torch.Tensor, verify: bool = True, **options) -> dict:
    """llama-pro (zero-init) keeps the base's logits bit for bit and (``verify``) verify says PARITY;
    the manifest."""
    expand(str(src), out, ExpandOptions(method="llama-pro", **options))
    assert torch.equal(_reloaded_logits(out), base)
    if verify:
        report = verify_expansion(src, out, random_eval_set(vocab=90, seed=1, lengths=(20, 20, 13), low=3))
        assert report.verdict.startswith("PARITY") and report.logits_equal, report.verdict
    return json.loads((out / "otdus.json").read_text())


@pytest.mark.parametrize(
    ("model_type", "saved", "verify"),
    [
        # experts.down_proj when loaded (verify's streamed evaluator does not reproduce GraniteMoE's
        # experts bit for bit, and says so)
        ("granitemoe", r"block_sparse_moe\.output_linear\.weight", False),
        ("exaone", r"attn\.attention\.out_proj\.weight", True),  # self_attn.o_proj, under transformer.h.N
    ],
)
def test_tensors_transformers_saves_under_other_names_are_zeroed(tmp_path, model_type, saved, verify):
    """The zero-init targets are looked up under the names transformers' own saving gives them (it used
    to refuse: "stores ... under another name"), and verify finds the tensors under those names too."""
    base = _save(model_type, tmp_path / "src")
    manifest = _grows_exactly(tmp_path / "src", tmp_path / "out", base, verify=verify, layers=2)
    kinds = manifest["source"]["zero_init_proof"]["kinds"].values()
    assert any(saved in patterns for kind in kinds for patterns in kind["stored"].values())


@pytest.mark.compat
def test_flat_expert_tensors_are_zeroed_and_the_written_checkpoint_computes_as_proved(tmp_path):
    """DBRX holds its experts flat ([experts * ffn, hidden] w1, v1, w2, no Linear maps): they were no
    candidates, and with them zero-init was refused. Its experts' products also round differently on
    weights 8 bytes off a 64-byte boundary, and transformers loads tensors as views of the file: with
    the data buffer where the header's length put it, the checkpoint written did not compute what the
    proof computed in memory (logits 1e-8 off). Only w2, which writes into the stream, is zeroed."""
    base = _save("dbrx", tmp_path / "src")
    manifest = _grows_exactly(tmp_path / "src", tmp_path / "out", base, layers=2)
    (kind,) = manifest["source"]["zero_init_proof"]["kinds"].values()
    assert sorted(kind["zeroed"]) == ["ffn.experts.mlp.w2", "norm_attn_norm.attn.out_proj.weight"]
    grown, in_memory = load_causal_lm(tmp_path / "out"), load_causal_lm(tmp_path / "src")
    assert all(p.data_ptr() % DATA_ALIGNMENT == 0 for p in grown.parameters())
    for p in in_memory.parameters():  # the base as a model built in memory holds it, off the file
        p.data = p.data.clone()
    for seed in range(3):  # few tokens per expert: the products that showed the misalignment
        ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert torch.equal(grown(input_ids=ids).logits, in_memory(input_ids=ids).logits), seed


def _longcat_with_choice_biases(folder: Path) -> torch.Tensor:
    """A tiny LongCat-Flash saved with its expert-choice biases away from 0 (trained ones are), so a new
    layer's cannot pass as a copy; its logits."""
    from safetensors.torch import load_file, save_file

    _save("longcat_flash", folder)
    tensors = load_file(folder / "model.safetensors")
    for name, value in tensors.items():
        if name.endswith("e_score_correction_bias"):
            value.copy_(torch.linspace(-0.3, 0.3, len(value)))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return _reloaded_logits(folder)


def test_a_router_choosing_experts_without_weights_is_kept_from_them_by_its_choice_bias(tmp_path):
    """LongCat-Flash's zero-computation experts add their input back wherever the router picks them: with
    every tensor zeroed a layer was no identity (zero-init refused). A new layer's expert-choice bias now
    holds 0 for the experts with weights and -2 for the others, counted in the checkpoint's own expert
    tensors, so its top-k over scores in [0, 1] never picks those: logits bit for bit, verify PARITY."""
    base = _longcat_with_choice_biases(tmp_path / "src")
    manifest = _grows_exactly(tmp_path / "src", tmp_path / "out", base, layers=2)
    (kind,) = manifest["source"]["zero_init_proof"]["kinds"].values()
    bias = kind["set_to"]["mlp.router.e_score_correction_bias"]
    assert bias == {
        "experts with weights": 0.0,
        "experts without weights": -2.0,
        "counted by": bias["counted by"],
    }
    assert "mlp.experts.down_proj" in kind["zeroed"] and "mlp.experts.gate_up_proj" not in kind["zeroed"]
    new = {lay["index"] for lay in manifest["layers"] if lay["new"]}
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as out:
        for layer in range(4):
            value = out.get_tensor(f"model.layers.{layer}.mlp.router.e_score_correction_bias")
            expected = torch.tensor([0.0] * 4 + [-2.0] * 2) if layer in new else torch.linspace(-0.3, 0.3, 6)
            assert torch.equal(value, expected), layer


def test_a_choice_bias_added_to_unbounded_router_logits_is_refused(tmp_path, monkeypatch):
    """-2 keeps experts out of a top-k only over scores in [0, 1]: a router adding the bias to its raw
    logits (here small at its weights' scale) passes the proof as it is but not with its weights scaled
    until softmax or sigmoid scores would saturate, and zero-init is refused saying so."""
    from transformers.models.longcat_flash import modeling_longcat_flash as longcat

    def raw_logits(router, hidden_states):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        scores = 0.05 * torch.nn.functional.linear(hidden_states.float(), router.classifier.weight.float())
        chosen = router.get_topk_indices(scores)
        return scores, scores.gather(1, chosen), chosen

    # another config than the other tests': the proof of one is cached for the process
    _save("longcat_flash", tmp_path / "src", routed_scaling_factor=2.0)
    monkeypatch.setattr(longcat.LongcatFlashTopkRouter, "forward", raw_logits)
    with pytest.raises(OtdusError, match=r"is an identity only while its router's scores stay small"):
        expand(str(tmp_path / "src"), tmp_path / "out", ExpandOptions(method="llama-pro", layers=2))
    assert not (tmp_path / "out").exists()


def test_a_plan_is_proved_on_an_instance_as_large_as_the_base_one(tmp_path, monkeypatch):
    """The grown tiny model is shrunk exactly when the base's is: a base just under the proof's size
    limit used to be proved against a grown model over it, built shrunk, which its tensors did not fit
    (LFM2-MoE refused zero-init: "the expanded tiny model did not run")."""
    from otdus_cli.arch import tiny

    base = _save("exaone", tmp_path / "src")
    size = sum(p.numel() for p in load_causal_lm(tmp_path / "src").parameters())
    monkeypatch.setattr(tiny, "MAX_PROOF_PARAMETERS", size)  # the base fits, the grown model not
    _grows_exactly(tmp_path / "src", tmp_path / "out", base, verify=False, layers=2)


def test_a_new_layer_handing_on_another_token_selection_is_refused_in_the_middle(tmp_path):
    """Hunyuan V4's "shared" DSA layers reuse the top-k tokens the last "full" layer chose: a new full
    layer (an identity on the hidden states) hands them its own choice, so the model changes once a
    window holds more tokens than index_topk. The plan proof used to pass (8 tokens, top-k of 2048, and
    transformers' small initial weights choosing alike); new layers at the end keep the function."""
    from transformers import CONFIG_MAPPING

    from tests.support.tiny_models import VERIFY_BREADTH

    if "hy_v4" not in CONFIG_MAPPING:
        pytest.skip("transformers has no hy_v4 here")
    fields = VERIFY_BREADTH["hy_v4"]
    save_perturbed("hy_v4", fields, tmp_path / "src", use_cache=False)
    with pytest.raises(OtdusError, match="reuses what the layer before it hands on"):
        expand(str(tmp_path / "src"), tmp_path / "mid", ExpandOptions(method="llama-pro", layers=2))
    assert not (tmp_path / "mid").exists()
    expand(str(tmp_path / "src"), tmp_path / "end", ExpandOptions(method="llama-pro", after=[3, 3]))
    ids = torch.randint(3, 90, (1, 4 * fields["index_topk"]), generator=torch.Generator().manual_seed(0))
    base, grown = load_causal_lm(tmp_path / "src"), load_causal_lm(tmp_path / "end")
    with torch.no_grad():
        assert torch.equal(base(input_ids=ids).logits, grown(input_ids=ids).logits)


def test_a_bias_added_to_the_residual_stream_is_zeroed_too(tmp_path):
    """GPT-NeoX-Japanese's last layer adds dense_bias after its attention output: with only the linear
    maps zeroed that layer kind was no identity, which refused zero-init for the whole model."""
    base = _save("gpt_neox_japanese", tmp_path / "src")
    # new layers copy layer 1: transformers gives dense_bias to whichever layer is last, so a copy of
    # the last layer elsewhere is refused at plan time (its kind would change)
    manifest = _grows_exactly(tmp_path / "src", tmp_path / "out", base, after=[1, 1])
    kinds = manifest["source"]["zero_init_proof"]["kinds"]
    assert any("attention.dense_bias" in kind["zeroed"] for kind in kinds.values())


def test_a_kind_no_zeroing_makes_an_identity_leaves_the_other_kinds_zero_init(tmp_path):
    """RWKV's first layer norms its input (pre_ln) before the residual stream starts: no zeroing makes it
    an identity (that refused zero-init for the whole model), but the other layers' kind keeps it
    (verify's streamed evaluator does not run RWKV's recurrent blocks)."""
    base = _save("rwkv", tmp_path / "src")
    manifest = _grows_exactly(tmp_path / "src", tmp_path / "out", base, verify=False, after=[2, 2])
    proof = manifest["source"]["zero_init_proof"]
    (first,) = proof["unproved"]
    assert first.startswith("LayerNorm+LayerNorm+LayerNorm+") and first not in proof["kinds"]
    assert [entry["layer"] for entry in proof["kinds"].values()] == [1]


def test_a_refusal_suggests_new_layers_after_the_last_only_where_that_works(tmp_path):
    """RWKV halves its hidden state after every second layer (rescale_every=2): a new layer after base
    layer 2 moves layer 3 to another group, and 2 copies of layer 3 after it would halve the stream once
    more, so the refusal does not send the user to --after 3 (DiffLLaMA's does: tests/test_hybrid.py) but
    says which placements keep the logits (tests/test_zero_init_limits.py)."""
    _save("rwkv", tmp_path / "src", rescale_every=2)
    with pytest.raises(OtdusError, match=r"as does at most 1 new layer after base layer 3; without") as error:
        expand(str(tmp_path / "src"), tmp_path / "out", ExpandOptions(method="llama-pro", after=[2]))
    assert "leave every base layer's index" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_a_residual_scale_that_follows_the_depth_is_rewritten(tmp_path):
    """MiniCPM3 scales each residual branch by scale_depth / sqrt(num_hidden_layers): the rewritten
    config keeps that quotient exactly, so every layer computes as before (zero-init was refused)."""
    base = _save("minicpm3", tmp_path / "src")
    _grows_exactly(tmp_path / "src", tmp_path / "out", base, layers=2)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["scale_depth"] / 6**0.5 == 1.4 / 4**0.5


def test_post_norm_layers_refuse_zero_init_saying_why(tmp_path):
    """OPT with its norms after the residual add (output = norm(x + f(x))): no zeroing makes a layer an
    identity; the refusal says so, and copies without zero-init still work."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "opt", vocab_size=96, hidden_size=32, ffn_dim=48, num_hidden_layers=4, num_attention_heads=4,
        word_embed_proj_dim=32, max_position_embeddings=64, do_layer_norm_before=False,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "opt")
    post_norm = r"zero-init for derived:opt: .*\(post-norm: output = norm\(x \+ f\(x\)\);"
    with pytest.raises(OtdusError, match=post_norm):
        expand(str(tmp_path / "opt"), tmp_path / "out", ExpandOptions(method="llama-pro", layers=2))
    assert not (tmp_path / "out").exists()
    expand(str(tmp_path / "opt"), tmp_path / "copy", ExpandOptions(method="copy", layers=2))


def test_layers_sharing_one_block_are_refused_naming_it(tmp_path):
    """Zamba's hybrid layers all run one shared attention block, stored once: the refusal says so (it
    said the checkpoint was incomplete)."""
    _save(
        "zamba", tmp_path / "src", **FIELDS, num_hidden_layers=6, attn_layer_period=2, attn_layer_offset=1,
        mamba_d_state=8, mamba_expand=2, n_mamba_heads=2,
    )  # fmt: skip
    with pytest.raises(OtdusError, match=r"share one module's weights .* so a layer cannot be copied"):
        expand(str(tmp_path / "src"), tmp_path / "out", ExpandOptions(method="copy", layers=2))
    assert not (tmp_path / "out").exists()


def test_saved_names_become_patterns_within_a_layer():
    from otdus_cli.arch.saved_names import layer_suffix_patterns

    experts = [f"model.layers.3.block_sparse_moe.experts.{e}.w2.weight" for e in range(4)]
    assert layer_suffix_patterns(experts, 3) == [r"block_sparse_moe\.experts\.\d+\.w2\.weight"]
    assert layer_suffix_patterns(["transformer.h.1.attn.attention.out_proj.weight"], 1) == [
        r"attn\.attention\.out_proj\.weight"
    ]
    assert layer_suffix_patterns(["model.layers.2.mlp.down_proj.weight"], 1) is None


def _shipped(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


@pytest.mark.parametrize(
    ("model_type", "set_to_one", "verify"),
    [
        # hidden = input_residual * x + attention(x), then post_attention_residual likewise
        ("doge", {"input_residual", "post_attention_residual"}, True),
        # (x + residual_bias) * residual_scale after each branch; the router states each layer hands the
        # next come out as they went in with router_states_scale at 1 (verify's streamed evaluator runs
        # a layer for its hidden states alone, which Zaya's model cannot take)
        pytest.param(
            "zaya",
            {
                "post_attention_residual_scale.residual_scale",
                "post_mlp_residual_scale.residual_scale",
                "mlp.gate.router_states_scale",
            },
            False,
            marks=pytest.mark.skipif(not _shipped("zaya"), reason="this transformers has no Zaya"),
        ),
    ],
)
def test_residual_scales_of_a_new_layer_are_set_to_one(tmp_path, model_type, set_to_one, verify):
    """A residual path scaled by the layer's own parameters is no identity with any tensor zeroed (zero-init
    was refused); with those scales at 1 it is: the base's scales are perturbed away from 1, the new
    layers hold exactly 1 there, the logits stay bit for bit and the manifest records the values."""
    base = _save(model_type, tmp_path / "src")
    manifest = _grows_exactly(tmp_path / "src", tmp_path / "out", base, verify=verify, after=[1, 2])
    kinds = manifest["source"]["zero_init_proof"]["kinds"]
    recorded = {name: value for kind in kinds.values() for name, value in kind.get("set_to", {}).items()}
    assert recorded == dict.fromkeys(set_to_one, 1.0)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as out:
        for layer, new in ((1, False), (2, True), (4, True)):  # 2: a copy of layer 1, 4: of layer 2
            for name in sorted(set_to_one):
                value = out.get_tensor(f"model.layers.{layer}.{name}")
                assert bool((value == 1).all()) == new, (layer, name)
    # `otdus trainable --zero-init-only` names what expand initialised: the zeroed tensors and these scales
    chosen = output_set(tmp_path / "out", zero_init_only=True).trainable
    zeroed = {name for kind in kinds.values() for name in kind["zeroed"]}
    assert {n.split(".", 3)[3] for n in chosen} == zeroed | set_to_one
    assert {int(n.split(".")[2]) for n in chosen} == {2, 4}


@pytest.mark.parametrize("through", ["llama-pro", "copy --zero-init"])
def test_post_norm_refusal_names_what_works_without_zero_init(tmp_path, through):
    """BERT (post-norm): `otdus expand` says in one line, transformers' own advice on building the class
    not on stderr (it was, three times), why zero-init cannot work and which methods do without it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "bert", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "bert")
    method, *flags = through.split()
    command = [sys.executable, "-m", "otdus_cli.cli", "expand", str(tmp_path / "bert"), "--out"]
    done = subprocess.run(
        [*command, str(tmp_path / "out"), "--method", method, *flags], capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: zero-init for derived:bert: ") and "(post-norm: " in line, line
    assert line.endswith(
        "; without zero-init a new layer changes the model's function until trained: use --method copy, "
        "interpose, solar or stack, or add --no-zero-init"
    ), line
    assert not (tmp_path / "out").exists()


def test_verify_proves_no_identity_where_a_residual_scale_is_not_one(tmp_path):
    """verify's static proof counts a new Doge layer as an identity only with its residual scales at 1,
    not merely its zero-init targets zeroed (it used to: a scale of 0.5 halved the stream unnoticed)."""
    from safetensors.torch import load_file, save_file

    from otdus_cli.verify.proof import static_check

    base = _save("doge", tmp_path / "src")
    _grows_exactly(tmp_path / "src", tmp_path / "out", base, verify=False, after=[1])
    assert static_check(tmp_path / "src", tmp_path / "out").preserving
    weights = tmp_path / "out" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.2.input_residual"].fill_(0.5)
    save_file(tensors, weights, metadata={"format": "pt"})
    proof = static_check(tmp_path / "src", tmp_path / "out")
    assert not proof.preserving and "layer 2 is new and not an identity" in proof.reason, proof.reason


@pytest.mark.skipif(not _shipped("qwen4_exp_text"), reason="this transformers has no Qwen4-Exp")
def test_a_list_of_layers_counted_from_one_is_renumbered_as_such(tmp_path):
    """Qwen4-Exp's ple_layer_ids counts layers from 1 (the derivation learns it from the class: emptying the
    list changes the kind of layer 3 for ids [4]); read from 0, the last layer's number was "beyond its 4
    layers" and expanding was refused. verify's head pass ran the forward on placeholder embeddings, from
    which it recovers the n-gram ids through the embedding table, which is not loaded there: it failed."""
    base = _save(
        "qwen4_exp_text",
        tmp_path / "src",
        ple_layer_ids=[4],
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    )
    result = expand(str(tmp_path / "src"), tmp_path / "out", ExpandOptions(method="llama-pro", after=[1]))
    assert result.plan.source.family.numbered_from_one == ("ple_layer_ids",)
    grown = load_causal_lm(tmp_path / "out")
    assert grown.config.ple_layer_ids == [5] and grown.model.layers[4].ple is not None
    assert torch.equal(logits(grown, use_cache=False), base)
    # verify's head pass gives token ids: from embeddings alone the forward reads the embedding table
    report = verify_expansion(tmp_path / "src", tmp_path / "out", random_eval_set())
    assert report.verdict.startswith("PARITY") and report.logits_equal, report.verdict


@pytest.mark.skipif(not _shipped("qwen4_exp_text"), reason="this transformers has no Qwen4-Exp")
def test_a_stream_of_several_hidden_width_streams_is_written_through_the_hidden_width(tmp_path):
    """Qwen4-Exp's residual stream is hc_count streams of the hidden width side by side; its attention,
    MoE and n-gram embedding (PLE) write hidden-width outputs that the layer's hyper-connections mix into
    every stream. Only the maps into the stream's own width were candidates (the hyper-connections'
    input_mix_weight_up), which zeroed make no identity: zero-init was refused. The maps into the hidden
    width are zeroed now; the layer with PLE moves one place down with its index list rewritten."""
    base = _save("qwen4_exp_text", tmp_path / "src")
    result = expand(str(tmp_path / "src"), tmp_path / "out", ExpandOptions(method="llama-pro", after=[1]))
    grown = load_causal_lm(tmp_path / "out")
    assert torch.equal(logits(grown, use_cache=False), base)
    family, source = result.plan.source.family, result.plan.source
    kinds = [family.layer_kind(source.text_config, lay.source) for lay in result.plan.layer_map]
    assert layer_kinds(list(grown.model.layers)) == kinds
    assert "PLELayer" in kinds[3] and grown.config.ple_layer_ids == [4]
    proof = json.loads((tmp_path / "out" / "otdus.json").read_text())["source"]["zero_init_proof"]
    zeroed = {name for kind in proof["kinds"].values() for name in kind["zeroed"]}
    assert {"self_attn.o_proj.weight", "linear_attn.out_proj.weight", "ple.value_proj.weight"} <= zeroed
    assert {"mlp.experts.down_proj", "mlp.shared_expert.down_proj.weight"} <= zeroed
    assert not any("hyper_connection" in name for name in zeroed)
