"""Layer tensors a checkpoint stores outside the layer's prefix, under a name numbered by the layer.

Inkling 2 (and Inkling 2 Loop) save each layer's attention-residual queries outside the layer:
``layers.{i}.attention_input.query`` as ``model.llm.attn_res.attn_queries.{i-1}`` and
``layers.{i}.mlp_input.query`` as ``model.llm.attn_res.mlp_queries.{i}``. Tiny models built and saved by
the installed transformers: every output layer holds its source layer's queries under the names of its
own index, so the output reloads with no tensor missing or initialised at random, a zero-init expansion
gives the base's logits bit for bit, and verify's static check and its layer loader read them back by
layer. A checkpoint whose numbered tensors do not match its layers is refused in one line.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from otdus_cli.arch.layer_storage import NumberedName, numbered_name
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import no_output_left, one_error_line
from tests.support.tiny_models import COMMON, HYBRID_BASE, logits, save_perturbed

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]

# the sizes `make coverage` builds these classes with: 4 layers, one attention-residual block (6 layers a
# block), so two new layers keep every block boundary where it was
FIELDS = {
    **COMMON,
    **HYBRID_BASE,
    **dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "unpadded_vocab_size": 96,
}
ATTN = "model.llm.attn_res.attn_queries."
MLP = "model.llm.attn_res.mlp_queries."


def _needs(model_type: str) -> None:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no {model_type} here")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out |= load_file(shard)
    return out


def _reload(folder: Path):
    """The model transformers loads from ``folder``, asserting that it found every tensor it expects and
    no other (none initialised at random)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, output_loading_info=True
        )
    assert not any(info.values()), info
    return model.eval()


def _queries_follow_sources(out: Path, src: Path, sources: list[int]) -> None:
    """Output layer j holds base layer sources[j]'s queries, under the names of index j (layer 0 has no
    attention_input), and the output holds no other numbered query."""
    grown, base = _tensors(out), _tensors(src)
    for j, i in enumerate(sources):
        assert torch.equal(grown[f"{MLP}{j}"], base[f"{MLP}{i}"]), j
        if j:
            assert torch.equal(grown[f"{ATTN}{j - 1}"], base[f"{ATTN}{i - 1}"]), j
    expected = {f"{MLP}{j}" for j in range(len(sources))} | {f"{ATTN}{j}" for j in range(len(sources) - 1)}
    assert {n for n in grown if n.startswith((ATTN, MLP))} == expected


def _cli(*args: str):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def inkling2_zero_init(tmp_path_factory):
    """An Inkling 2 base and its zero-init expansion by 2 copied layers, sharded (an index file)."""
    _needs("inkling2_text")
    root = tmp_path_factory.mktemp("inkling2")
    base = save_perturbed("inkling2_text", FIELDS, root / "src", use_cache=False)
    options = ExpandOptions(method="copy", layers=2, zero_init=True, max_shard_size="200KB")
    result = expand(str(root / "src"), root / "out", options)
    return root, base, result


def test_zero_init_copies_hold_their_sources_queries_under_their_own_numbers(inkling2_zero_init):
    root, base, result = inkling2_zero_init
    sources = [lay.source for lay in result.plan.layer_map]
    assert sources == [0, 1, 1, 2, 2, 3]
    grown = _reload(root / "out")
    assert torch.equal(logits(grown, use_cache=False), base)
    _queries_follow_sources(root / "out", root / "src", sources)
    index = json.loads((root / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(_tensors(root / "out"))
    new = {n for n in result.manifest["new_parameters"] if n.startswith((ATTN, MLP))}
    assert new == {f"{ATTN}1", f"{MLP}2", f"{ATTN}3", f"{MLP}4"}
    # the card counts them in their layers (not as widened experts) and unfreezes each by its name
    card = (root / "out" / "README.md").read_text()
    assert "every tensor of the new layers 2, 4" in card and "widened" not in card
    assert f"  - ^{ATTN}1$\n  - ^{MLP}2$\n  - ^model.llm.layers.4.\n" in card


def test_verify_reads_the_numbered_queries_back_by_layer(inkling2_zero_init):
    """The static check matches each layer by its fingerprint (the queries outside it included) and the
    streamed loader puts each layer's queries into it."""
    from otdus_cli.verify.streaming import StreamedModel

    root, _, result = inkling2_zero_init
    checked = _cli("verify", str(root / "out"), "--static")
    assert checked.exit_code == 0, checked.output
    assert "static check: function-preserving" in checked.output
    assert "outside the stack: the base's" in checked.output
    base = _tensors(root / "src")
    streamed = StreamedModel(root / "out")
    for j, lay in enumerate(result.plan.layer_map):
        layer = streamed.weights.load_layer(j)
        try:
            assert torch.equal(layer.mlp_input.query, base[f"{MLP}{lay.source}"])
            if j:
                assert torch.equal(layer.attention_input.query, base[f"{ATTN}{lay.source - 1}"])
        finally:
            streamed.weights.free_layer(j)


def test_a_shrunk_model_renumbers_the_queries_of_the_layers_after_the_removed_one(inkling2_zero_init):
    root, _, _ = inkling2_zero_init
    out = root / "shrunk"
    result = _cli("shrink", str(root / "src"), "--out", str(out), "--select", "explicit", "--remove", "2")
    assert result.exit_code == 0, result.output
    _reload(out)
    _queries_follow_sources(out, root / "src", [0, 1, 3])


def test_verify_of_the_streamed_forward_refuses_in_one_line(inkling2_zero_init):
    """Inkling 2's forward hands each layer block states made of earlier layers' outputs, which the
    streamed evaluator's recorded layer arguments do not follow: its self-check refuses with one error
    (its stand-ins used to lack the layers' class attribute attention_type: an unexpected AttributeError)."""
    from otdus_cli.errors import OtdusError
    from otdus_cli.verify.compare import verify_expansion
    from otdus_cli.verify.metrics import EvalSet, Window

    root, _, _ = inkling2_zero_init
    ids = torch.randint(3, 90, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    windows = EvalSet("token", "random ids", [Window(ids, ids[1:], 0, 0)], [0], [0], 20)
    with pytest.raises(OtdusError, match="self-check failed"):
        verify_expansion(root / "src", root / "out", windows)


def test_the_loop_models_copies_reload_whole_and_zero_init_is_refused(tmp_path):
    """Inkling 2 Loop stores its queries alike. Its loop starts at a multiple of the attention-residual
    block, so new layers come six at a time, and a sixth layer starts a block: zero-init is no identity
    there, which the plan's proof says in one line."""
    _needs("inkling2_loop_text")
    src = tmp_path / "src"
    save_perturbed("inkling2_loop_text", FIELDS, src, use_cache=False)
    after = ["--after", "3,3,3,3,3,3"]
    result = _cli("expand", str(src), "--out", str(tmp_path / "copy"), "--method", "copy", *after)
    assert result.exit_code == 0, result.output
    _reload(tmp_path / "copy")
    _queries_follow_sources(tmp_path / "copy", src, [0, 1, 2, 3, 3, 3, 3, 3, 3, 3])
    refused = _cli(
        "expand", str(src), "--out", str(tmp_path / "out"), "--method", "copy", *after, "--zero-init"
    )
    one_error_line(refused, message="its layers compute differently at their new positions")
    no_output_left(tmp_path)


def _rewrite(src: Path, drop: str | None = None, add: tuple[str, str] | None = None) -> None:
    """``src``'s checkpoint without tensor ``drop``, or with a copy of tensor add[1] named add[0]."""
    path = src / "model.safetensors"
    tensors = load_file(path)
    if drop is not None:
        del tensors[drop]
    if add is not None:
        tensors[add[0]] = tensors[add[1]].clone()
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"drop": f"{MLP}2"}, "layer 2 lacks mlp_input.query, unlike layer 1"),
        (
            {"add": (f"{MLP}7", f"{MLP}3")},
            f"holds {MLP}7, where transformers saves a layer's mlp_input.query, but for none of the 4 layers",
        ),
        ({"drop": f"{ATTN}1"}, "layer 2 lacks attention_input.query, unlike layer 1"),
    ],
)
def test_numbered_tensors_that_do_not_match_the_layers_are_refused(tmp_path, change, message):
    _needs("inkling2_text")
    save_perturbed("inkling2_text", FIELDS, tmp_path / "src", use_cache=False)
    _rewrite(tmp_path / "src", **change)
    result = _cli("expand", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--method", "copy")
    one_error_line(result, message=message)
    no_output_left(tmp_path, "out")


def test_a_query_stored_under_no_name_transformers_loads_is_still_refused(tmp_path):
    """Without any attn_queries tensor no layer holds its attention_input.query, and transformers would
    initialise every one at random: refused, naming where it looked."""
    _needs("inkling2_text")
    src = tmp_path / "src"
    save_perturbed("inkling2_text", FIELDS, src, use_cache=False)
    tensors = {n: t for n, t in load_file(src / "model.safetensors").items() if not n.startswith(ATTN)}
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    result = _cli("expand", str(src), "--out", str(tmp_path / "out"), "--method", "copy")
    line = one_error_line(result, message=f"under none of the names transformers loads it from ({ATTN}0)")
    assert "layer 1's attention_input.query" in line
    no_output_left(tmp_path, "out")


def test_a_numbered_name_is_the_one_number_that_follows_the_layer_index():
    rule = numbered_name(f"{ATTN}2", 3, f"{ATTN}9", 10)
    assert rule == NumberedName(ATTN, -1, "")
    assert (
        rule.name(0) == f"{ATTN}-1" and rule.index_of(f"{ATTN}41") == 42 and rule.index_of(f"{MLP}4") is None
    )
    assert numbered_name("a.3.b.3.c", 3, "a.9.b.9.c", 9) is None  # two numbers follow the index
    assert numbered_name("a.out", 3, "a.out", 9) is None  # one name for every layer
    assert numbered_name("a.6.b", 3, "a.18.b", 9) is None  # twice the index: no constant offset
    assert numbered_name("model.layers.3.x.weight", 3, "model.layers.9.x.weight", 9) == NumberedName(
        "model.layers.", 0, ".x.weight"
    )
