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

import pytest

from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from otdus_cli.verify.compare import verify_expansion
from tests.support.eval_sets import random_eval_set
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
