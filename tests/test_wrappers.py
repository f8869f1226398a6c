"""Multimodal wrappers (issue 17): only the text stack grows; every other tensor keeps its bytes.

Tiny wrappers are built by transformers itself and saved with save_pretrained (which writes Gemma 3,
LLaVA and Mistral 3 as language_model.model.layers.N and Qwen2.5-VL as model.layers.N with its
text settings in text_config); the transformers 5 naming (model.language_model.layers.N) is made
from the Gemma 3 save by renaming its tensors as transformers 5 does when loading it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import warnings
from pathlib import Path

import pytest
import torch

from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import one_error_line
from tests.support.tiny_models import WRAPPERS

pytestmark = [pytest.mark.compat]


def build_wrapper(model_type: str, folder: Path, fields: dict | None = None) -> Path:
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_config(
            AutoConfig.for_model(model_type, **(fields or WRAPPERS[model_type]))
        )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


def load_wrapper(folder: Path):
    from transformers import AutoModelForImageTextToText

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()


def text_logits(model) -> torch.Tensor:
    ids = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(0))  # no image tokens
    # Llama4ForConditionalGeneration.forward fails in transformers 5.24 (it reads image_outputs off its
    # language model's output, which has none): its text-only path is that language model
    if type(model).__name__ == "Llama4ForConditionalGeneration":
        model = model.language_model
    with torch.no_grad():
        return model(input_ids=ids).logits


def digests(folder: Path, skip: str) -> dict[str, str]:
    """sha256 of every tensor's bytes whose name does not contain ``skip``."""
    r = CheckpointReader(folder)
    return {
        n: hashlib.sha256(r.get(n).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for n in r.names
        if skip not in n
    }


@pytest.fixture(scope="module")
def wrappers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wrappers")
    return {mt: build_wrapper(mt, root / mt) for mt in WRAPPERS}


def to_transformers5_names(src: Path, out: Path) -> Path:
    """The Gemma 3 save with transformers 5's own names (what it writes for newer wrappers)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for path in src.iterdir():
        if path.name != "model.safetensors":
            (out / path.name).write_bytes(path.read_bytes())
    renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."))
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        new = next((name.replace(a, b, 1) for a, b in renames if name.startswith(a)), None)
        tensors[new or "model." + name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("model_type", list(WRAPPERS) + ["gemma3-v5-names"])
def test_wrapper_text_stack_grows_and_the_rest_keeps_its_bytes(wrappers, tmp_path, model_type, single_thread):
    if model_type == "gemma3-v5-names":
        src = to_transformers5_names(wrappers["gemma3"], tmp_path / "src")
    else:
        src = wrappers[model_type]
    names = CheckpointReader(src).names
    prefix = next(
        p
        for p in ("model.language_model.", "language_model.model.", "model.")
        if p + "layers.0." in "".join(names)
    )
    base_config = json.loads((src / "config.json").read_text())
    depth = base_config["text_config"]["num_hidden_layers"] + 2
    result = expand(str(src), tmp_path / "out", ExpandOptions(method="copy", layers=2, zero_init=True))
    assert result.plan.function_preserving and result.manifest["num_hidden_layers"] == depth

    # every tensor outside the text stack: the same bytes under the same name
    stack = prefix + "layers."
    assert digests(tmp_path / "out", stack) == digests(src, stack)
    assert any("visual" in n or "vision" in n for n in digests(src, stack))
    out_layers = {
        n.split(".")[len(stack.split(".")) - 1]
        for n in CheckpointReader(tmp_path / "out").names
        if n.startswith(stack)
    }
    assert out_layers == {str(i) for i in range(depth)}

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == depth
    assert config["vision_config"] == base_config["vision_config"]
    sources = [lay["source"] for lay in result.manifest["layers"]]
    if "layer_types" in base_config["text_config"]:
        assert config["text_config"]["layer_types"] == [
            base_config["text_config"]["layer_types"][i] for i in sources
        ]

    base, grown = load_wrapper(src), load_wrapper(tmp_path / "out")
    assert grown.config.get_text_config().num_hidden_layers == depth
    assert torch.equal(text_logits(base), text_logits(grown))


def test_wrapper_with_layers_under_two_prefixes_is_refused(wrappers, tmp_path):
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    src = tmp_path / "src"
    src.mkdir()
    for path in wrappers["llava"].iterdir():
        (src / path.name).write_bytes(path.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 48)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["expand", str(src), "--out", str(out), "--method", "copy"])
    one_error_line(result, message="both model. and language_model.model.")
    assert not out.exists()


@pytest.mark.parametrize("model_type", list(WRAPPERS) + ["gemma3-v5-names"])
def test_verify_scores_the_text_model_of_a_wrapper(wrappers, tmp_path, model_type, single_thread):
    """verify streams a wrapper's text model (the vision tower left aside by the text-only forward): a
    zero-init expansion holds bitwise PARITY and the static proof shows it, from the library."""
    from otdus_cli.verify.compare import verify_expansion
    from tests.support.eval_sets import random_eval_set

    if model_type == "gemma3-v5-names":
        src = to_transformers5_names(wrappers["gemma3"], tmp_path / "src")
    else:
        src = wrappers[model_type]
    out = tmp_path / "out"
    expand(str(src), out, ExpandOptions(method="copy", layers=2, zero_init=True))
    report = verify_expansion(src, out, random_eval_set())
    assert report.expect_parity and report.proof.preserving, report.proof.reason
    assert report.verdict.startswith("PARITY") and "bitwise" in report.verdict
    assert report.logits_equal and report.first_divergence is None and report.exit_code == 0
    # the embeddings and every expanded text layer, compared with the base's in lockstep
    depth = json.loads((src / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert [c.expanded_layer for c in report.checks] == list(range(-1, depth + 2))


def test_verify_cli_on_a_wrapper_with_a_tokenizer(tmp_path, single_thread):
    """`otdus verify OUT` as users run it on an expanded Gemma 3 wrapper (the stories260K tokenizer, a
    512-token text vocabulary, image tokens above it): PARITY, exit 0; --static proves it too."""
    from typer.testing import CliRunner

    from otdus_cli.bundled import STORIES260K
    from otdus_cli.cli import app

    fields = dict(WRAPPERS["gemma3"], image_token_index=515, boi_token_index=516, eoi_token_index=517)
    fields["text_config"] = {**fields["text_config"], "vocab_size": 520}
    src = tmp_path / "gemma3"
    build_wrapper("gemma3", src, fields)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        (src / name).write_bytes((STORIES260K / name).read_bytes())
    out = tmp_path / "out"
    expand(str(src), out, ExpandOptions(method="copy", layers=2, zero_init=True))
    runner = CliRunner()
    result = runner.invoke(app, ["verify", str(out), "--max-tokens", "512", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["parity"] and report["logits_equal"] and report["verdict"].startswith("PARITY")
    assert Path(report["base_model"]).resolve() == src.resolve()  # the source the manifest recorded
    static = runner.invoke(app, ["verify", str(out), "--static", "--json"])
    assert static.exit_code == 0, static.output
    proof = json.loads(static.stdout)
    assert proof["preserving"] and proof["outside_equal"]
    assert [f["base"] for f in proof["layers"]].count(False) == 2


def image_logits(model) -> torch.Tensor:
    """Qwen3-VL logits on a prompt with one 16x16 image (4 image tokens after merging): the path on
    which the deepstack features join text layers 0 and 1."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([[5, 6, 92, 90, 90, 90, 90, 93, 7, 8, 9]])
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=gen)  # 4x4 patches of 3x2x4x4 values
    image = dict(pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]]))
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # transformers 5: 1 = image
        image["mm_token_type_ids"] = (ids == 90).int()
    with torch.no_grad():
        return model(input_ids=ids, **image).logits


def test_qwen3_vl_deepstack_layers_stay_in_place(wrappers, tmp_path, single_thread):
    """New layers after the deepstack layers: the image path too is bit-identical (a zero-init layer
    adds nothing, and the visual features still join base layers 0 and 1)."""
    src = wrappers["qwen3_vl"]
    out = tmp_path / "out"
    result = expand(str(src), out, ExpandOptions(method="copy", after=[1, 3], zero_init=True))
    assert [lay.source for lay in result.plan.layer_map[:2]] == [0, 1]
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 2]  # vision blocks: unchanged
    base, grown = load_wrapper(src), load_wrapper(out)
    assert type(grown).__name__ == "Qwen3VLForConditionalGeneration"
    assert torch.equal(image_logits(base), image_logits(grown))
    # the deepstack features do reach the text layers on this input (without them the logits change)
    with torch.no_grad():
        for p in base.model.visual.deepstack_merger_list.parameters():
            p.zero_()
    assert not torch.equal(image_logits(base), image_logits(grown))


@pytest.mark.parametrize("position", ["bottom", "top-bottom"])
def test_qwen3_vl_layer_map_that_moves_deepstack_layers_is_refused(wrappers, tmp_path, position):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    out = tmp_path / "out"
    args = ["expand", str(wrappers["qwen3_vl"]), "--out", str(out), "--method", "copy", "--layers", "2"]
    result = CliRunner().invoke(app, [*args, "--position", position, "--zero-init"])
    one_error_line(result, message="vision_config.deepstack_visual_indexes has 2 entries")
    assert not out.exists()


def mllama_image_logits(model) -> torch.Tensor:
    """Mllama logits on a prompt with one 28x28 image (one tile): the path through the cross-attention
    layers, which text-only inputs skip."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([[5, 90, 6, 7, 8, 9, 10]])
    image = dict(
        pixel_values=torch.randn(1, 1, 1, 3, 28, 28, generator=gen),
        aspect_ratio_ids=torch.tensor([[1]]),
        aspect_ratio_mask=torch.tensor([[[1]]]),
        cross_attention_mask=torch.ones(1, 7, 1, 1, dtype=torch.long),
    )
    with torch.no_grad():
        return model(input_ids=ids, **image).logits


def test_mllama_cross_attention_layers_follow_the_layer_map(wrappers, tmp_path, single_thread):
    """cross_attention_layers is renumbered through the layer map: copies of a cross-attention layer
    are cross-attention layers, the others move with their sources; with zero-init copies the image
    path is bit-identical too."""
    src = wrappers["mllama"]
    out = tmp_path / "out"
    result = expand(str(src), out, ExpandOptions(method="copy", after=[1, 2], zero_init=True))
    sources = [lay.source for lay in result.plan.layer_map]
    assert sources == [0, 1, 1, 2, 2, 3]
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["cross_attention_layers"] == [1, 2, 5]
    base, grown = load_wrapper(src), load_wrapper(out)
    assert torch.equal(mllama_image_logits(base), mllama_image_logits(grown))
    # the cross-attention layers do shape this input (without their attention the logits change)
    with torch.no_grad():
        for i in (1, 3):
            base.model.language_model.layers[i].cross_attn.o_proj.weight.zero_()
    assert not torch.equal(mllama_image_logits(base), mllama_image_logits(grown))


def test_llama4_lists_transformers_derives_are_written_explicitly(tmp_path, tiny_models, single_thread):
    """A Llama 4 config.json without moe_layers / no_rope_layers / layer_types (transformers derives
    them from interleave_moe_layer_step and no_rope_layer_interval, which at the new depth would put
    experts and NoPE on other layers): the output states them, each layer keeping its source's kind as
    the installed transformers reads the source."""
    from transformers import AutoConfig

    from tests.support.tiny_models import load_causal_lm, logits

    src = tmp_path / "src"
    src.mkdir()
    for path in tiny_models["llama4_text"].iterdir():
        (src / path.name).write_bytes(path.read_bytes())
    config = json.loads((src / "config.json").read_text())
    assert config["moe_layers"] == [1, 3]
    for name in ("moe_layers", "no_rope_layers", "layer_types"):
        config.pop(name, None)
    (src / "config.json").write_text(json.dumps(config))
    read = AutoConfig.from_pretrained(src)
    out = tmp_path / "out"
    result = expand(str(src), out, ExpandOptions(method="copy", layers=2, zero_init=True))
    sources = [lay.source for lay in result.plan.layer_map]
    assert sources == [0, 1, 1, 2, 2, 3]
    written = json.loads((out / "config.json").read_text())
    assert written["moe_layers"] == [j for j, i in enumerate(sources) if i in read.moe_layers] == [1, 2, 5]
    assert written["no_rope_layers"] == [read.no_rope_layers[i] for i in sources]
    if getattr(read, "layer_types", None):  # transformers 5 (4.57 has no layer_types for Llama 4)
        assert written["layer_types"] == [read.layer_types[i] for i in sources]
    assert torch.equal(logits(load_causal_lm(src)), logits(load_causal_lm(out)))


@pytest.mark.parametrize(
    ("model_type", "method", "message"),
    [
        ("mllama", "average", "new layer 2 would be built from layers 1, 2, of different kinds in mllama"),
        ("llama4", "average", "new layer 2 would be built from layers 1, 2, of different kinds in llama4"),
        ("mllama", "lesa", "LESA predicts self-attention layers' projections only"),
        ("mllama", "ot", "the OT-DUS flow knows no cross-attention roles"),
        ("llama4", "ot", "fused experts beside a shared expert"),
    ],
)
def test_methods_a_mixed_stack_cannot_take_are_refused(wrappers, tmp_path, model_type, method, message):
    """Cross-attention / self-attention (Mllama) and dense / MoE (Llama 4) layers interleave: a layer
    averaged from one of each has no tensor set, and OT / LESA know no roles for them."""
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    out = tmp_path / "out"
    args = ["expand", str(wrappers[model_type]), "--out", str(out), "--method", method, "--layers", "2"]
    one_error_line(CliRunner().invoke(app, args), message=message)
    assert not out.exists()
