"""No remote code is ever executed: trust_remote_code is never set (docs/getting-started.md: Install)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from typer.testing import CliRunner

import otdus_cli
from otdus_cli.cli import app

PACKAGE = Path(otdus_cli.__file__).parent
# transformers entry points that can import a model repository's own Python code
LOADERS = {"from_pretrained", "from_config"}


def test_every_transformers_loader_call_passes_trust_remote_code_false():
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            for kw in node.keywords:  # nowhere anything but the literal False
                if kw.arg == "trust_remote_code":
                    assert isinstance(kw.value, ast.Constant) and kw.value.value is False, path
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in LOADERS:
                receiver = func.value.id if isinstance(func.value, ast.Name) else ""
                if receiver.startswith("Auto"):
                    calls.append((path.name, receiver, func.attr))
                    assert any(kw.arg == "trust_remote_code" for kw in node.keywords), (path, receiver)
    # the scan sees the real call sites (config check, tokenizer, streaming verify, study training)
    assert {c[0] for c in calls} >= {"config_rules.py", "metrics.py", "streaming.py", "train.py"}, calls


def test_a_model_with_its_own_code_is_never_run(stories, tmp_path):
    """A checkpoint whose config maps the Auto classes to a Python file of its own (auto_map): with
    trust_remote_code=True transformers would import that file, which writes a marker."""
    marker = tmp_path / "marker"
    (stories / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    pass\n"
        "class EvilModel(LlamaForCausalLM):\n    pass\n"
    )
    cfg = json.loads((stories / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (stories / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    runner = CliRunner()
    quick = ["--protocol", "token", "--seq-len", "64", "--max-tokens", "128", "--device", "cpu", "--json"]
    for args in (  # expand checks the config; verify loads config, tokenizer and model classes of both
        ["expand", str(stories), "--out", str(out), "--method", "llama-pro", "--layers", "5"],
        ["verify", str(out), "--base", str(stories), *quick],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args[0], result.output)
        assert not marker.exists(), args[0]
