"""verify's streamed evaluator on checkpoints and forwards unlike LLaMA's: PARITY for a zero-init expansion.

Each tiny model (tests/support/tiny_models.py: VERIFY_BREADTH), built by the installed transformers,
departs from the ``.model.layers`` causal LM in one way the evaluator must follow exactly (the
self-check inside verify compares its logits with transformers' own forward, bit for bit):

* tensors transformers converts when loading: OLMo hybrid's ``conv1d`` concatenated from
  ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``; Sarvam's ``q_proj`` / ``k_proj`` / ``v_proj`` split from
  ``query_key_value`` by the module's shapes (transformers 5 only);
* decoder layers elsewhere than ``.model.layers`` (RoBERTa-PreLayerNorm's, in its base model's
  ``encoder.layer``);
* a forward that scales its input embeddings in place (CTRL), or whose layers carry more than the input
  width (Hunyuan V4's hyper-connection streams);
* layers handing part of their output to the next layer (GLM-MoE-DSA's top-k indices);
* a forward that takes token ids only (CPM-Ant prepends its prompt to them);
* a class no auto class builds from its saved config (Mllama's text model), with a layer its forward
  skips on text;
* a MoE config saved with ``output_router_logits`` (its forward would collect the stand-ins' outputs as
  router logits and compute a load-balancing loss from them).
"""

from __future__ import annotations

import json
import shutil

import pytest

from otdus_cli.bundled import STORIES260K
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from otdus_cli.verify.compare import verify_expansion
from tests.support.cli_checks import one_error_line
from tests.support.eval_sets import random_eval_set
from tests.support.file_checks import run_cli
from tests.support.tiny_models import COMMON, TINY_CONFIGS, VERIFY_BREADTH, save_perturbed

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]


@pytest.mark.parametrize("model_type", list(VERIFY_BREADTH))
def test_a_zero_init_expansion_holds_parity(tmp_path, model_type):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no {model_type} here")
    save_perturbed(model_type, VERIFY_BREADTH[model_type], tmp_path / "base", use_cache=False)
    saved_type = json.loads((tmp_path / "base" / "config.json").read_text())["model_type"]
    if saved_type not in CONFIG_MAPPING:  # 4.57 saves Mllama's text model as a type it cannot read back
        pytest.skip(f"transformers here cannot read the {saved_type} config it saves")
    # new DSA layers in the middle would hand a later layer another token selection (refused): at the end
    place = {"after": [3, 3]} if "index_topk" in VERIFY_BREADTH[model_type] else {"layers": 2}
    expand(str(tmp_path / "base"), tmp_path / "out", ExpandOptions(method="llama-pro", **place))
    report = verify_expansion(tmp_path / "base", tmp_path / "out", random_eval_set())
    assert report.exit_code == 0 and report.verdict.startswith("PARITY"), report.verdict
    assert report.logits_equal and report.first_divergence is None


def test_a_config_asking_for_router_logits_holds_parity(tmp_path):
    fields = {**COMMON, **TINY_CONFIGS["qwen2_moe"], "output_router_logits": True}
    save_perturbed("qwen2_moe", fields, tmp_path / "base")
    expand(str(tmp_path / "base"), tmp_path / "out", ExpandOptions(method="llama-pro", layers=2))
    report = verify_expansion(tmp_path / "base", tmp_path / "out", random_eval_set())
    assert report.verdict.startswith("PARITY") and report.logits_equal, report.verdict


# Reformer's causal LM takes a decoder config only; its axial position shape multiplies to the length.
# Both with the bundled model's vocabulary, so that verify reads text with its tokenizer.
REFORMER = {**COMMON, "vocab_size": 512, "head_dim": 8, "pad_token_id": 0, "eos_token_id": 2} | dict(
    is_decoder=True, axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16], num_buckets=2,
    attn_layers=["local"] * 4, local_attn_chunk_length=4,
)  # fmt: skip
RWKV = dict(
    vocab_size=512, hidden_size=32, num_hidden_layers=4, attention_hidden_size=32, intermediate_size=48
)


@pytest.mark.parametrize(
    ("model_type", "fields", "after", "why"),
    [
        # its layers take a second stream first (prev_attn_output) and the forward passes both by name
        (
            "reformer",
            REFORMER,
            [3, 3],
            "decoder layer 0 (ReformerLayer) takes prev_attn_output before its hidden states, and the "
            "model's forward passes both: two streams of states go through its layers",
        ),
        # in eval mode its forward divides some of its blocks' weights before running them
        (
            "rwkv",
            {**RWKV, "rescale_every": 2},
            [3],
            "the model's forward reads attention of decoder layer 0 (RwkvBlock) itself, not only calling "
            "the layer",
        ),
    ],
)
def test_a_forward_the_layer_by_layer_evaluator_cannot_follow_is_refused_in_one_line(
    tmp_path, model_type, fields, after, why
):
    """`otdus verify` refuses a model whose forward does more with its decoder layers than call them with
    the hidden states, in one `error:` line (exit 2) saying what it does: it failed with Reformer's
    TypeError (the stand-ins called the real layer with the hidden states in its first parameter's
    place) and RWKV's AttributeError (the stand-ins hold no block weights to rescale)."""
    save_perturbed(model_type, fields, tmp_path / "base", use_cache=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES260K / name, tmp_path / "base" / name)
    expand(
        str(tmp_path / "base"), tmp_path / "out", ExpandOptions(method="copy", after=after, zero_init=True)
    )
    args = ["--base", tmp_path / "base", "--max-tokens", "200", "--device", "cpu"]
    one_error_line(run_cli("verify", tmp_path / "out", *args), message=why)


def test_rwkv_without_rescaling_holds_parity(tmp_path):
    """RWKV with rescale_every 0: its forward only calls its blocks, and verify follows it."""
    save_perturbed("rwkv", {**RWKV, "rescale_every": 0}, tmp_path / "base", use_cache=False)
    expand(str(tmp_path / "base"), tmp_path / "out", ExpandOptions(method="copy", layers=2, zero_init=True))
    report = verify_expansion(tmp_path / "base", tmp_path / "out", random_eval_set())
    assert report.verdict.startswith("PARITY") and report.logits_equal, report.verdict
