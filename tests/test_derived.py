"""Templates derived from transformers for model_types without an exact one (arch/derived.py).

Copy-type methods work, reloading in transformers with every copied byte in place; zero-init zeroes the
tensors proved on a tiny instance (arch/identity.py; tests/test_hybrid.py); methods that need roles
are refused with one line where no layer kind's roles were proved (tests/test_derived_roles.py).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from otdus_cli.expand import expand
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import one_error_line
from tests.support.tiny_models import COMMON


def build(model_type: str, folder: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **COMMON))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("derived")
    return {mt: build(mt, root / mt) for mt in ("gemma", "opt", "gpt2", "exaone")}


# gemma: model.layers like the exact families; opt: its layers at model.decoder.layers; exaone (EXAONE 3):
# transformers 5 builds it as LlamaForCausalLM (model.layers) but saves and reads transformer.h.N
@pytest.mark.parametrize(
    ("model_type", "prefix"),
    [("gemma", "model.layers."), ("opt", "model.decoder.layers."), ("exaone", "transformer.h.")],
)
def test_copy_methods_on_a_derived_template(models, tmp_path, model_type, prefix):
    from tests.support.tiny_models import load_causal_lm

    result = expand(str(models[model_type]), tmp_path / "out", ExpandOptions(method="interpose", layers=2))
    assert result.manifest["source"]["family"] == f"derived:{model_type}"
    sources = [lay["source"] for lay in result.manifest["layers"]]
    a, b = CheckpointReader(models[model_type]), CheckpointReader(tmp_path / "out")
    for name in a.names:
        if name.startswith(prefix):
            index, rest = name[len(prefix) :].split(".", 1)
            copies = [j for j, i in enumerate(sources) if i == int(index)]
            assert copies
            for j in copies:
                assert torch.equal(
                    a.get(name).view(torch.uint8), b.get(f"{prefix}{j}.{rest}").view(torch.uint8)
                )
        else:
            assert torch.equal(a.get(name).view(torch.uint8), b.get(name).view(torch.uint8)), name
    assert len(b.names) == len(a.names) + 2 * len([n for n in a.names if n.startswith(prefix + "0.")])
    assert load_causal_lm(tmp_path / "out").config.num_hidden_layers == len(sources)


@pytest.mark.parametrize(
    ("model_type", "args", "message"),
    [
        ("gemma", ["--method", "average"], "needs an exact template; derived:gemma was read off"),
        ("opt", ["--method", "ot"], "no kind of its layers has an exact template's roles"),
    ],
)
def test_derived_template_refusals(models, tmp_path, model_type, args, message):
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["expand", str(models[model_type]), "--out", str(out), *args])
    one_error_line(result, message=message)
    assert not out.exists()


def test_no_remote_code_model_type_is_derived(models, tmp_path):
    """A model_type transformers does not ship is never derived (that would need remote code)."""
    from otdus_cli.arch.family_lookup import family_for
    from otdus_cli.errors import OtdusError

    config = json.loads((models["gemma"] / "config.json").read_text())
    config["model_type"] = "gemma_custom"
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    with pytest.raises(OtdusError, match="unknown architecture"):
        family_for(config)


def test_layers_stored_under_no_single_name_are_refused_saying_so(models, tmp_path):
    """A derived template looks for the layers where transformers' class keeps them, then for the one
    name numbered 0 .. depth-1; with neither, one line says so (not "holds tensors for 0 layers")."""
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from otdus_cli.cli import app

    src = tmp_path / "src"
    src.mkdir()
    for path in models["gemma"].iterdir():
        (src / path.name).write_bytes(path.read_bytes())
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers.") :].split(".", 1)
            name = f"{'upper' if int(index) >= 2 else 'lower'}.{index}.{rest}"
        tensors[name] = t
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["expand", str(src), "--out", str(out), "--method", "copy"])
    line = one_error_line(result, message="no tensors under model.layers.N")
    assert "names numbered 0-3 elsewhere: none" in line and "cannot tell which tensors" in line
    assert not out.exists()
