"""`otdus trainable` and otdus_cli.trainable.apply: the parameters to train first, in each trainer's
format, checked by training.

The training check: expand the real stories260K with OT-DUS, load it with transformers, freeze all
but the exported set, train a few steps with transformers.Trainer on the bundled TinyStories text;
then every base tensor is bitwise unchanged, every new tensor changed and the loss moved. The same
with the axolotl regexes and the LLaMA-Factory settings, each applied by the selection rule of that
trainer's own source (re-implemented here from their documentation, independently of otdus's code).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from otdus_cli.bundled import TINYSTORIES_SAMPLE
from otdus_cli.cli import app
from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from otdus_cli.trainable import FORMATS, apply
from otdus_cli.widen import WidenOptions, widen
from tests.support.cli_checks import one_error_line
from tests.support.tiny_models import build_tiny

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.compat,
]  # tiny models: threads only add contention
runner = CliRunner()


# -- the trainers' documented selection rules ------------------------------------------------------
def axolotl_unfrozen(patterns: list[str], names: list[str]) -> set[str]:
    """axolotl's freeze_layers_except: a period not followed by '+' is literal; re.match (anchored at
    the start) selects."""
    compiled = [re.compile(re.sub(r"\.(?!\+)", r"\\.", p)) for p in patterns]
    return {n for n in names if any(c.match(n) for c in compiled)}


def llama_factory_unfrozen(settings: dict, names: list[str], num_layers: int) -> set[str]:
    """LLaMA-Factory's freeze tuning: last/first k layers, or use_llama_pro's stride; then modules
    ('all' or names) after '.{id}.', and freeze_extra_modules, by substring."""
    k = settings["freeze_trainable_layers"]
    if settings.get("use_llama_pro"):
        assert num_layers % k == 0
        stride = num_layers // k
        ids = range(stride - 1, num_layers + stride - 1, stride)
    else:
        ids = range(num_layers - k, num_layers) if k > 0 else range(-k)
    marks = [
        f".{i}.{'' if m == 'all' else m}"
        for m in str(settings["freeze_trainable_modules"]).split(",")
        for i in ids
    ]
    marks += [m for m in str(settings.get("freeze_extra_modules", "")).split(",") if m]
    return {n for n in names if any(mark in n for mark in marks)}


def parse_yaml_lines(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


def trainable(*args) -> str:
    done = runner.invoke(app, ["trainable", *map(str, args)])
    assert done.exit_code == 0, done.output
    return done.stdout


# -- outputs ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ot_out(tmp_path_factory) -> Path:
    """OT-DUS on stories260K: new layers 3 and 5 of 7 (interleaved), zero-initialised."""
    out = tmp_path_factory.mktemp("ot") / "out"
    expand("bundled:stories260k", out, ExpandOptions(method="ot", layers=2))
    return out


@pytest.fixture(scope="module")
def pro_out(tmp_path_factory) -> Path:
    """LLaMA PRO's layout: a new layer after every base layer (5 -> 10, new 1, 3, 5, 7, 9)."""
    out = tmp_path_factory.mktemp("pro") / "out"
    expand("bundled:stories260k", out, ExpandOptions(method="llama-pro", layers=5, position="uniform"))
    return out


def names_of(folder: Path) -> list[str]:
    from otdus_cli.io.reader import CheckpointReader

    return CheckpointReader(folder).names


def layer_names(folder: Path, layers: list[int]) -> set[str]:
    return {n for n in names_of(folder) if any(n.startswith(f"model.layers.{i}.") for i in layers)}


def test_every_format_selects_the_new_layers(ot_out, pro_out):
    for out, new in ((ot_out, [3, 5]), (pro_out, [1, 3, 5, 7, 9])):
        expected = layer_names(out, new)
        names = trainable(out, "--format", "names").split()
        assert set(names) == expected and len(names) == len(expected)
        assert set(json.loads(trainable(out, "--format", "json"))) == expected
        patterns = parse_yaml_lines(trainable(out))["unfrozen_parameters"]
        assert axolotl_unfrozen(patterns, names_of(out)) == expected
        assert patterns == [f"^model.layers.{i}." for i in new]  # periods left to axolotl to escape
    # LLaMA PRO's layout is use_llama_pro's stride rule (10 layers, 5 trainable: ids 1, 3, ..., 9)
    settings = parse_yaml_lines(trainable(pro_out, "--format", "llama-factory"))
    assert settings == {
        "finetuning_type": "freeze",
        "freeze_trainable_layers": 5,
        "use_llama_pro": True,
        "freeze_trainable_modules": "all",
    }
    assert llama_factory_unfrozen(settings, names_of(pro_out), 10) == layer_names(pro_out, [1, 3, 5, 7, 9])


def test_also_and_zero_init_only(pro_out):
    all_names = names_of(pro_out)
    norms = {n for n in all_names if "norm" in n}
    patterns = parse_yaml_lines(trainable(pro_out, "--also", "norms"))["unfrozen_parameters"]
    assert axolotl_unfrozen(patterns, all_names) == layer_names(pro_out, [1, 3, 5, 7, 9]) | norms
    settings = parse_yaml_lines(trainable(pro_out, "--format", "llama-factory", "--also", "norms"))
    assert settings["freeze_extra_modules"] == "norm"  # LLaMA-Factory's substring: every layer's norms too
    assert llama_factory_unfrozen(settings, all_names, 10) == layer_names(pro_out, [1, 3, 5, 7, 9]) | norms
    with_embeddings = trainable(pro_out, "--format", "names", "--also", "embeddings").split()
    assert "model.embed_tokens.weight" in with_embeddings
    zeros = trainable(pro_out, "--format", "names", "--zero-init-only").split()
    assert zeros == [
        f"model.layers.{i}.{s}"
        for i in (1, 3, 5, 7, 9)
        for s in ("mlp.down_proj.weight", "self_attn.o_proj.weight")
    ]
    patterns = parse_yaml_lines(trainable(pro_out, "--zero-init-only"))["unfrozen_parameters"]
    assert axolotl_unfrozen(patterns, all_names) == set(zeros)


def test_moe_outputs_train_new_experts_and_router_rows(tmp_path):
    src = build_tiny("mixtral", tmp_path / "mixtral")
    wide = tmp_path / "wide"
    widen(str(src), wide, WidenOptions(noise=0))
    all_names = names_of(wide)
    expected = {
        n
        for n in all_names
        if re.search(r"experts\.[4-7]\.", n) or n.endswith("block_sparse_moe.gate.weight")
    }
    assert len(expected) == 4 * (4 * 3 + 1)
    done = runner.invoke(app, ["trainable", str(wide)])
    assert done.exit_code == 0
    assert "router weight(s)" in done.stderr and "base rows too" in done.stderr  # the honest caveat
    patterns = parse_yaml_lines(done.stdout)["unfrozen_parameters"]
    assert axolotl_unfrozen(patterns, all_names) == expected
    assert set(trainable(wide, "--format", "names").split()) == expected
    # the router rows of the new experts are in tensors of the base layers: no layer setting covers them
    one_error_line(
        runner.invoke(app, ["trainable", str(wide), "--format", "llama-factory"]),
        message="use --format axolotl, json or names",
    )
    one_error_line(
        runner.invoke(app, ["trainable", str(wide), "--zero-init-only"]), message="no zero-initialised"
    )
    assert "transformers 5 loads these experts fused" in done.stderr  # what no name rule can select
    # apply() on the loaded model: transformers 5 fuses Mixtral's experts into one tensor per layer
    # (experts on its first axis) and renames the router: those tensors train behind a gradient mask
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(wide)
    if int(transformers.__version__.split(".")[0]) < 5:
        assert set(apply(model, wide)) == expected
        assert {n for n, p in model.named_parameters() if p.requires_grad} == expected
        return
    trained = apply(model, wide)
    assert sorted(trained) == sorted(
        f"model.layers.{i}.mlp.{t}"
        for i in range(4)
        for t in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    for name, param in model.named_parameters():
        moved = (
            (param != before[name]).flatten(1).any(1) if param.dim() == 3 else (param != before[name]).any()
        )
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            assert moved.tolist() == [False] * 4 + [True] * 4, name  # the base experts' rows kept, bitwise
        elif name not in trained:
            assert not moved, name


def test_interleaved_layers_are_refused_by_llama_factory_with_the_formats_that_can(ot_out, tmp_path):
    done = runner.invoke(app, ["trainable", str(ot_out), "--format", "llama-factory"])
    line = one_error_line(done, message="cannot express trainable layers 3,5 of 7")
    assert "--format axolotl, json or names" in line
    # irregular LLaMA PRO positions (--after 0,1): 5 -> 7 layers, new 1 and 3: no stride matches
    irregular = tmp_path / "irregular"
    expand("bundled:stories260k", irregular, ExpandOptions(method="llama-pro", after=[0, 1]))
    one_error_line(
        runner.invoke(app, ["trainable", str(irregular), "-f", "llama-factory"]), message="1,3 of 7"
    )
    # the last layers (top, copy-type): LLaMA-Factory's plain "last k"
    top = tmp_path / "top"
    expand("bundled:stories260k", top, ExpandOptions(method="copy", after=[4, 4]))
    settings = parse_yaml_lines(trainable(top, "--format", "llama-factory"))
    assert settings == {
        "finetuning_type": "freeze",
        "freeze_trainable_layers": 2,
        "freeze_trainable_modules": "all",
    }
    assert llama_factory_unfrozen(settings, names_of(top), 7) == layer_names(top, [5, 6])


def test_bad_use_is_one_line_and_exit_2(ot_out, stories, tmp_path):
    one_error_line(runner.invoke(app, ["trainable", str(stories)]), message="is not an otdus output")
    one_error_line(runner.invoke(app, ["trainable", str(tmp_path / "nowhere")]), message="is not a folder")
    one_error_line(
        runner.invoke(app, ["trainable", str(ot_out), "--format", "deepspeed"]), message="is not one of"
    )
    one_error_line(runner.invoke(app, ["trainable", str(ot_out), "--also", "everything"]), message="--also")
    one_error_line(
        runner.invoke(app, ["trainable", str(ot_out), "--also", "head"]), message="tie_word_embeddings"
    )


def test_yaml_and_json_come_from_serializers_whatever_the_names(pro_out):
    """A tensor name holding a line break and a YAML key (refused when read; here it slipped through)
    stays one quoted value: it never adds a setting, nor splits into several names."""
    from otdus_cli.io.reader import CheckpointReader
    from otdus_cli.manifest import read_manifest
    from otdus_cli.trainable import render, select

    hostile = "model.norm\nfinetuning_type: full\nx: norm.weight"
    names = [*names_of(pro_out), hostile]
    chosen = select(read_manifest(pro_out), names, CheckpointReader(pro_out).config, also=["norms"])
    assert hostile in chosen.trainable
    settings = parse_yaml_lines(render(chosen, "llama-factory"))
    assert settings["finetuning_type"] == "freeze" and "x" not in settings
    assert llama_factory_unfrozen(settings, names, 10) == set(chosen.trainable)
    assert json.loads(render(chosen, "json")) == chosen.trainable
    with pytest.raises(OtdusError, match="not one plain line; use --format json"):
        render(chosen, "names")
    with pytest.raises(OtdusError, match="not a plain tensor name"):
        render(chosen, "axolotl")


def test_an_output_with_nothing_new_is_refused_in_every_format(tmp_path):
    """A shrink adds no parameter: an empty list would make axolotl train everything."""
    from otdus_cli.shrink import ShrinkOptions, shrink

    out = tmp_path / "shrunk"
    shrink("bundled:stories260k", out, ShrinkOptions(method="drop", layers=1))
    for fmt in FORMATS:
        one_error_line(
            runner.invoke(app, ["trainable", str(out), "--format", fmt]), message="no new parameters"
        )
    norms = {n for n in names_of(out) if "norm" in n}
    assert set(trainable(out, "--format", "names", "--also", "norms").split()) == norms  # what was asked
    assert (
        axolotl_unfrozen(
            parse_yaml_lines(trainable(out, "--also", "norms"))["unfrozen_parameters"], names_of(out)
        )
        == norms
    )
    from transformers import AutoModelForCausalLM

    with pytest.raises(OtdusError, match="no new parameters"):
        apply(AutoModelForCausalLM.from_pretrained(out), out)


def test_apply_reads_a_peft_wrapped_model_by_the_checkpoint_names(ot_out):
    """peft's wrapper puts every name under ``base_model.model.`` and a wrapped linear layer's weight
    under ``base_layer``; its adapters sit beside it (the layout of peft 0.21, built here by hand:
    peft is no dependency). The new layers train, adapters included; the rest stays frozen."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ot_out)
    for layer in (0, 3):  # a base layer and a new one, each with a LoRA-style adapter on q_proj
        attn = model.model.layers[layer].self_attn
        wrapped = torch.nn.Module()
        wrapped.base_layer, wrapped.lora_A = attn.q_proj, torch.nn.Linear(attn.q_proj.in_features, 2)
        attn.q_proj = wrapped
    peft_like = torch.nn.Module()
    peft_like.base_model = torch.nn.Module()
    peft_like.base_model.model = model
    peft_like.config = model.config
    trained = apply(peft_like, ot_out)
    prefix = "base_model.model.model.layers."
    assert f"{prefix}3.self_attn.q_proj.base_layer.weight" in trained
    assert f"{prefix}3.self_attn.q_proj.lora_A.weight" in trained
    expected = {n for n, _ in peft_like.named_parameters() if n.startswith((f"{prefix}3.", f"{prefix}5."))}
    assert {n for n, p in peft_like.named_parameters() if p.requires_grad} == expected == set(trained)


# -- the training check ------------------------------------------------------------------------------
def train_a_few_steps(folder: Path, freeze, tmp_path: Path) -> tuple[dict, dict, float, float]:
    """Load ``folder`` with transformers, let ``freeze(model)`` set requires_grad, train 4 steps on
    the bundled TinyStories text; the parameters before and after, and a fixed batch's loss before
    and after."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    freeze(model)
    ids = tokenizer(TINYSTORIES_SAMPLE.read_text())["input_ids"]
    chunks = [ids[i : i + 64] for i in range(0, len(ids) - 64, 64)][:16]
    data = [{"input_ids": torch.tensor(c), "labels": torch.tensor(c)} for c in chunks]
    batch = torch.stack([d["input_ids"] for d in data[:4]])

    def loss() -> float:
        with torch.no_grad():
            return float(model(input_ids=batch, labels=batch).loss)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss_before = loss()
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        weight_decay=0.1,  # decay would move a frozen tensor if the optimizer held it
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
    )
    Trainer(model=model, args=args, train_dataset=data).train()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return before, after, loss_before, loss()


def check_only_new_changed(before: dict, after: dict, new: set[str], loss_before: float, loss_after: float):
    assert new and new <= set(before)
    for name in before:
        if name in new:
            assert not torch.equal(before[name], after[name]), f"{name} did not change"
        else:
            assert torch.equal(before[name], after[name]), f"base tensor {name} changed"
    assert loss_after != loss_before


def test_training_the_exported_set_changes_only_the_new_tensors(ot_out, pro_out, tmp_path):
    new = layer_names(ot_out, [3, 5])
    before, after, *losses = train_a_few_steps(ot_out, lambda m: apply(m, ot_out), tmp_path)
    check_only_new_changed(before, after, new, *losses)
    # the axolotl regexes, applied by axolotl's rule
    patterns = parse_yaml_lines(trainable(ot_out))["unfrozen_parameters"]

    def axolotl(model):
        chosen = axolotl_unfrozen(patterns, [n for n, _ in model.named_parameters()])
        for name, param in model.named_parameters():
            param.requires_grad_(name in chosen)

    before, after, *losses = train_a_few_steps(ot_out, axolotl, tmp_path)
    check_only_new_changed(before, after, new, *losses)
    # LLaMA-Factory's settings where they apply: LLaMA PRO's layout
    settings = parse_yaml_lines(trainable(pro_out, "--format", "llama-factory"))

    def llama_factory(model):
        chosen = llama_factory_unfrozen(settings, [n for n, _ in model.named_parameters()], 10)
        for name, param in model.named_parameters():
            param.requires_grad_(name in chosen)

    before, after, *losses = train_a_few_steps(pro_out, llama_factory, tmp_path)
    check_only_new_changed(before, after, layer_names(pro_out, [1, 3, 5, 7, 9]), *losses)


def test_the_docs_quote_what_trainable_prints(ot_out):
    """docs/handoff.md: the bundled example's output, line for line (`otdus expand
    bundled:stories260k --out out/demo` is ot_out's expansion)."""
    section = (Path(__file__).parent.parent / "docs" / "handoff.md").read_text()
    quoted = section.split("otdus trainable out/demo\n", 1)[1].split("otdus trainable out/demo --format", 1)[
        0
    ]
    assert [line.removeprefix("# ") for line in quoted.strip().splitlines()] == trainable(ot_out).splitlines()
    error = runner.invoke(app, ["trainable", str(ot_out), "--format", "llama-factory"]).stderr.strip()
    block = section.split("otdus trainable out/demo --format llama-factory\n", 1)[1].split("```", 1)[0]
    assert " ".join(line.removeprefix("# ") for line in block.strip().splitlines()) == error
    for command in ("trainable", "verify"):  # every option the section gives exists
        helptext = runner.invoke(app, [command, "--help"], env={"COLUMNS": "300"}).stdout
        options = re.findall(rf"otdus {command} \S+ ((?:--[a-z-]+ ?)+)", section)
        assert options, command
        for option in options:
            for flag in option.split():
                assert flag in helptext, (command, flag)
