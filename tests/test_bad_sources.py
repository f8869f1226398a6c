"""Sources that are wrong: one `error:` line, exit 2, no output, before anything proportional to them.

Crafted safetensors headers are also fed to the safetensors library itself: otdus refuses exactly
what the library refuses, so a file otdus copies through is one every loader accepts.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from otdus_cli.cli import app
from tests.support.cli_checks import no_output_left, one_error_line

runner = CliRunner()
OTDUS = str(Path(sys.executable).parent / "otdus")


def run_cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def refused(result, message: str, parent: Path) -> str:
    line = one_error_line(result, 2, message)
    no_output_left(parent)
    return line


def split_file(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_file(path: Path, header: dict | str, data: bytes) -> None:
    blob = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def library_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                f.get_tensor(k)
    except Exception:
        return True
    return False


# -- non-finite weights ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, method",
    [
        (math.nan, ["--method", "ot"]),
        (math.inf, ["--method", "ot", "--ot-variant", "structured"]),
        (-math.inf, ["--method", "average"]),
    ],
)
def test_non_finite_parent_weights_are_refused_naming_the_tensor(stories, tmp_path, value, method):
    f = stories / "model.safetensors"
    tensors = load_file(str(f))
    name = "model.layers.3.mlp.up_proj.weight"  # layer 3 is a parent of the default top placement
    tensors[name][2, 5] = value
    save_file(tensors, str(f), metadata={"format": "pt"})
    line = refused(run_cli("expand", stories, "--out", tmp_path / "out", *method), name, tmp_path)
    assert "NaN/Inf" in line


def test_copy_methods_still_copy_a_model_whose_unread_layers_hold_nan(stories, tmp_path):
    # bytes are moved, not read: a copy-type expansion reproduces the source as it is
    f = stories / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = math.nan
    save_file(tensors, str(f), metadata={"format": "pt"})
    assert run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy").exit_code == 0


# -- layers that differ from their siblings ----------------------------------------------------------
def test_a_layer_lacking_a_tensor_is_refused(stories, tmp_path):
    f = stories / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    refused(
        run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy"),
        "layer 2 lacks self_attn.k_proj.weight",
        tmp_path,
    )


def test_a_layer_with_a_different_shape_is_refused(stories, tmp_path):
    f = stories / "model.safetensors"
    tensors = load_file(str(f))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
    refused(
        run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy"),
        "layer 1 mlp.down_proj.weight",
        tmp_path,
    )


def test_moe_dense_layers_are_a_declared_difference(tmp_path):
    from otdus_cli.source import open_source
    from tests.support.tiny_models import build_tiny

    folder = tmp_path / "qwen2_moe"
    build_tiny("qwen2_moe", folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert not cfg.get("mlp_only_layers")
    # a Qwen-MoE model whose layer 0 is dense (mlp_only_layers), as transformers builds it
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg["mlp_only_layers"] = [0]
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "transformers_version"})
    dense_first = tmp_path / "dense_first"
    AutoModelForCausalLM.from_config(config).save_pretrained(dense_first)
    source = open_source(str(dense_first))
    assert "mlp.gate_proj.weight" in source.layers[0].suffixes()
    assert "mlp.gate_proj.weight" not in source.layers[1].suffixes()


# -- headers the safetensors library refuses -----------------------------------------------------------
def _craft(header: dict, data: bytes, how: str) -> tuple[dict | str, bytes]:
    names = [k for k in header if k != "__metadata__"]
    by_offset = sorted(names, key=lambda k: header[k]["data_offsets"][0])
    a, b = by_offset[0], by_offset[1]
    if how == "negative shape":
        header[a]["shape"] = [-1, *header[a]["shape"][1:]]
    elif how == "float shape":
        header[a]["shape"] = [float(s) for s in header[a]["shape"]]
    elif how == "string shape":
        header[a]["shape"] = [str(s) for s in header[a]["shape"]]
    elif how == "overlap":  # b claims a's bytes; the sizes still match the shapes
        size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
        header[b]["data_offsets"] = [0, size]
    elif how == "gap":
        data = data + bytes(8)
        for k in names:
            if k != a:
                header[k]["data_offsets"] = [x + 8 for x in header[k]["data_offsets"]]
    elif how == "trailing bytes":
        data = data + bytes(16)
    elif how == "metadata not a map":
        header["__metadata__"] = ["format", "pt"]
    elif how == "metadata value not a string":
        header["__metadata__"] = {"format": 1}
    elif how == "duplicate key":
        text = json.dumps(header)
        entry = json.dumps({a: header[a]})[1:-1]
        return "{" + entry + "," + text[1:], data
    elif how == "leading whitespace":
        return "  " + json.dumps(header), data
    elif how == "deeply nested":
        return '{"__metadata__": {"x": "y"}, "deep": ' + "[" * 100000 + "]" * 100000 + "}", data
    return header, data


CRAFTED = [
    "negative shape",
    "float shape",
    "string shape",
    "overlap",
    "gap",
    "trailing bytes",
    "metadata not a map",
    "metadata value not a string",
    "deeply nested",
]


@pytest.mark.parametrize("how", CRAFTED)
def test_crafted_headers_are_refused_like_the_safetensors_library_does(stories, tmp_path, how):
    f = stories / "model.safetensors"
    header, data = split_file(f)
    write_file(f, *_craft(header, data, how))
    assert library_refuses(f), f"the safetensors library accepts a header with {how}"
    refused(
        run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy"),
        "model.safetensors",
        tmp_path,
    )


def test_a_name_given_twice_is_refused(stories, tmp_path):
    # the library keeps one of the two entries; otdus refuses the ambiguity
    f = stories / "model.safetensors"
    header, data = split_file(f)
    write_file(f, *_craft(header, data, "duplicate key"))
    refused(
        run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy"), "not valid JSON", tmp_path
    )


# a name safetensors allows that would write keys of its own into the YAML `trainable` prints
INJECTED = "model.norm\nfinetuning_type: full\nx: norm.weight"
READING_COMMANDS = [
    ["plan", "{m}"],
    ["inspect", "{m}"],
    ["expand", "{m}", "--out", "{out}", "--method", "copy"],
    ["shrink", "{m}", "--out", "{out}", "--method", "drop", "--remove", "1"],
    ["widen", "{m}", "--out", "{out}"],
    ["verify", "{m}", "--base", "bundled:stories260k", "--max-tokens", "64"],
    ["ppl", "{m}", "--max-tokens", "64"],
    ["diagnose", "{m}"],
]


@pytest.mark.parametrize("command", READING_COMMANDS, ids=[c[0] for c in READING_COMMANDS])
def test_a_tensor_name_that_is_not_identifiers_is_refused_by_every_command(stories, tmp_path, command):
    f = stories / "model.safetensors"
    header, data = split_file(f)
    header[INJECTED] = header.pop("model.norm.weight")
    write_file(f, header, data)
    args = [a.format(m=stories, out=tmp_path / "out") for a in command]
    line = refused(run_cli(*args), f"model.safetensors: tensor name {INJECTED!r} is not", tmp_path)
    assert "finetuning_type: full\\nx" in line


@pytest.mark.parametrize("how", ["as saved", "leading whitespace"])
def test_valid_headers_are_accepted_by_both(stories, tmp_path, how):
    f = stories / "model.safetensors"
    header, data = split_file(f)
    write_file(f, *_craft(header, data, how))
    assert not library_refuses(f)
    assert run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy").exit_code == 0


# -- counts and config fields --------------------------------------------------------------------------
def _edit_config(folder: Path, **fields) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_an_absurd_layer_count_is_refused_at_once_in_bounded_memory(stories, tmp_path):
    _edit_config(stories, num_hidden_layers=10**30)
    start = time.monotonic()
    # a real process under a 4 GB address-space limit: allocating anything proportional would fail
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"{limit}; from otdus_cli.cli import main; main()",
            "expand",
            str(stories),
            "--out",
            str(tmp_path / "out"),
            "--method",
            "copy",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "config.json says 1000000000000000000000000000000 layers" in proc.stderr
    assert time.monotonic() - start < 60


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"num_hidden_layers": "5"}, "num_hidden_layers"),
        ({"model_type": ["llama"]}, "model_type must be a string"),
        ({"quantization_config": "gptq"}, "quantized"),
        # sizes and epsilons that describe no model (arch/config_values.py)
        ({"num_attention_heads": -8}, "config.json: num_attention_heads must be a positive integer, got -8"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
        ({"hidden_size": 64.0}, "hidden_size must be a positive integer, got 64.0"),
        ({"intermediate_size": [256, -1]}, "intermediate_size must be a positive integer, got [256, -1]"),
        ({"head_dim": -1}, "head_dim must be a non-negative integer"),
        ({"rms_norm_eps": math.inf}, "rms_norm_eps must be a positive finite number, got Infinity"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be a positive finite number"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a positive finite number"),
        ({"text_config": {"vocab_size": 0}}, "config.json text_config: vocab_size must be a positive"),
    ],
)
def test_malformed_config_fields(stories, tmp_path, fields, message):
    _edit_config(stories, **fields)
    refused(run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy"), message, tmp_path)


@pytest.mark.parametrize("command", READING_COMMANDS, ids=[c[0] for c in READING_COMMANDS])
def test_a_negative_head_count_is_refused_by_every_command(stories, tmp_path, command):
    _edit_config(stories, num_attention_heads=-8)
    args = [a.format(m=stories, out=tmp_path / "out") for a in command]
    refused(run_cli(*args), "config.json: num_attention_heads must be a positive integer, got -8", tmp_path)


def test_deeply_nested_config_json(stories, tmp_path):
    (stories / "config.json").write_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}")
    refused(run_cli("expand", stories, "--out", tmp_path / "out"), "not valid JSON", tmp_path)


def test_an_absurd_new_layer_count_is_refused(stories, tmp_path):
    refused(
        run_cli("expand", stories, "--out", tmp_path / "out", "--method", "stack", "--layers", "1000000000"),
        "at most",
        tmp_path,
    )
