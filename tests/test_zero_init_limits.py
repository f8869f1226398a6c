"""Zero-init where a new identity layer keeps the logits only at some placements, or at none, and why.

Reformer's LSH layers draw random rotations from torch's global generator (config hash_seed unset);
RWKV rescales its stack in groups of rescale_every layers in eval mode; Beam scales its residual stream
by a constant of each layer's index; DeepSeek V4 mixes hyper-connection streams by a matrix that hc_eps
keeps off the identity. otdus allows the placements that keep the base's logits bit for bit and refuses
the others in one line naming the mechanism (arch/plan_differences.py, arch/identity.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import no_output_left, one_error_line
from tests.support.file_checks import run_cli
from tests.support.tiny_models import COMMON, load_causal_lm, save_perturbed

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = {**COMMON, "head_dim": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Reformer's causal LM takes a decoder config only; its axial position shape multiplies to the length
REFORMER = TINY | dict(
    is_decoder=True, axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16], num_buckets=2,
    attn_layers=["local", "lsh", "local", "lsh"], local_attn_chunk_length=4, lsh_attn_chunk_length=4,
)  # fmt: skip
MOE = TINY | dict(
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=8,
)  # fmt: skip
RWKV = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=4, attention_hidden_size=32, intermediate_size=48
)
WITHOUT = "; without zero-init a new layer changes the model's function until trained: use --method copy"


def _seeded_logits(folder: Path, seed: int = 0) -> torch.Tensor:
    """The reloaded model's logits with torch's global generator seeded ``seed`` (Reformer draws from it)."""
    model = load_causal_lm(folder)
    ids = torch.randint(3, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        return model(input_ids=ids, use_cache=False).logits


def test_reformer_keeps_its_logits_where_no_new_layer_shifts_the_random_draws(tmp_path):
    """Reformer (layers local, lsh, local, lsh; hash_seed unset): a copy of local layer 0 in the middle
    and one of LSH layer 3 after it keep the logits bit for bit with the generator in the same state. It
    was refused: the first layer's proof did not see its second stream (attention.output.dense was left
    in a new local layer), and the plan's proof ran base and expanded model on different draws."""
    save_perturbed("reformer", REFORMER, tmp_path / "src", use_cache=False)
    base = _seeded_logits(tmp_path / "src")
    assert not torch.equal(base, _seeded_logits(tmp_path / "src", seed=1))  # the base itself draws
    placed = ExpandOptions(method="copy", after=[0, 3], zero_init=True)
    expand(str(tmp_path / "src"), tmp_path / "out", placed)
    assert torch.equal(_seeded_logits(tmp_path / "out"), base)


def test_the_first_layer_is_proved_an_identity_on_every_stream_it_hands_on(tmp_path):
    """A Reformer of local layers only: each layer hands the next two streams (Y1 = X1 + attention(X2),
    Y2 = X2 + feed_forward(Y1)). The first layer's proof saw only the one its output leads with, so it
    left attention.output.dense in a new layer and the plan's proof refused zero-init; now the states a
    layer hands on are learned from the first layer and the next where no layer comes before."""
    fields = {**REFORMER, "attn_layers": ["local"] * 4}
    save_perturbed("reformer", fields, tmp_path / "src", use_cache=False)
    base = _seeded_logits(tmp_path / "src")
    expand(str(tmp_path / "src"), tmp_path / "out", ExpandOptions(method="copy", layers=2, zero_init=True))
    assert torch.equal(_seeded_logits(tmp_path / "out"), base)
    proof = json.loads((tmp_path / "out" / "otdus.json").read_text())["source"]["zero_init_proof"]
    (kind,) = proof["kinds"].values()
    assert kind["layer"] == 0 and "attention.output.dense.weight" in kind["zeroed"], kind


@pytest.mark.parametrize(
    ("every", "after", "written"),
    [
        (2, [3], 2),  # within the last group: every base layer keeps its group as it is
        (2, [1, 3], 3),  # one new layer in each group of 2: groups of 3
        (6, [1, 3], 7),  # 4 + 2 layers, never halved before: was refused (the sixth layer halved the stream)
    ],
)
def test_rwkv_keeps_its_logits_where_every_layer_keeps_its_rescaling_group(tmp_path, every, after, written):
    """RWKV (4 layers) rescales in groups of rescale_every layers in eval mode: where the new layers leave
    every base layer in its group and the stream halved as often before the final norm, with
    rescale_every rewritten to the group size that does so, the logits stay bit for bit."""
    base = save_perturbed("rwkv", {**RWKV, "rescale_every": every}, tmp_path / "src", use_cache=False)
    expand(str(tmp_path / "src"), tmp_path / "out", ExpandOptions(method="copy", after=after, zero_init=True))
    grown = load_causal_lm(tmp_path / "out")
    assert grown.config.rescale_every == written
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(grown(input_ids=ids, use_cache=False).logits, base)


@pytest.mark.parametrize(
    ("model_type", "fields", "flags", "why"),
    [
        (
            "reformer", REFORMER, ["--after", "1"],
            "base layers 1, 3 draw random numbers from torch's global "
            "random generator as they run (unseeded random projections: Reformer's LSH hashing without "
            "hash_seed in config.json), so even the base's logits change from run to run, and a copy of one "
            "placed before another shifts what that one draws: the expanded model's logits differ from the "
            "base's with the generator in the same state; copy only layers that draw none (base layers 0, "
            "2), or place copies of layers that draw after base layer 3 (the last that draws)" + WITHOUT,
        ),
        (
            "rwkv", {**RWKV, "rescale_every": 2}, ["--after", "2"],
            "in eval mode transformers rescales the stack in groups of rescale_every=2 layers (layer i's "
            "output weights divided by 2 ** (i // 2), the hidden states halved after each group), which "
            "keeps the function only up to LayerNorm's eps (a stream scaled by 1/2 ** g meets an eps 4 ** g "
            "times larger), so every base layer must stay in its group and the stream be halved 2 times "
            "before the final norm, which no rescale_every gives for this placement; the same number of new "
            "layers in every group keeps both (rescale_every rewritten; e.g. --after 1,3: one after each "
            "group's last layer), as does at most 1 new layer after base layer 3" + WITHOUT,
        ),
        (
            "beam", MOE, ["--layers", "2"],
            "its residual path multiplies the hidden state by a = 0.57735, the same for every token and "
            "feature: a constant of transformers' code for the layer at this index",
        ),
        (
            "deepseek_v4", MOE, ["--layers", "2"],
            "its residual path mixes the 4 parallel streams it carries (output = M x for each token, M "
            "computed from x: hyper-connections), and M is not the identity: the config's hc_eps=1e-06 is "
            "added to every weight of M, so it never is",
        ),
    ],
)  # fmt: skip
def test_a_refused_placement_names_the_mechanism(tmp_path, model_type, fields, flags, why):
    """One `error:` line, exit 2, nothing written; it names what makes the logits differ (the generator's
    draws, the rescaling groups, the constant residual factor, the stream mixing) and what works."""
    save_perturbed(model_type, fields, tmp_path / "src", use_cache=False)
    args = ["expand", tmp_path / "src", "--out", tmp_path / "out", "--method", "copy", "--zero-init", *flags]
    line = one_error_line(run_cli(*args))
    assert line.startswith(f"error: zero-init for derived:{model_type}: "), line
    assert why in line, line
    no_output_left(tmp_path)
