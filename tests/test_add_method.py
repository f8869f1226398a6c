"""README's worked example of adding a method ("Adding a method"), run as written: its module,
registered with one line, gives `otdus expand` the method, its flag and its recipe keys."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from otdus_cli.bundled import STORIES260K
from otdus_cli.io.reader import CheckpointReader

ROOT = Path(__file__).resolve().parent.parent
# the registry line README asks for, done before the CLI is imported (as registry.py would)
RUN = (
    "import sys\n"
    "from otdus_cli.methods.registry import register\n"
    "import scale\n"
    "register(scale.SCALE)\n"
    "from otdus_cli.cli import main\n"
    "main(sys.argv[1:])\n"
)


@pytest.fixture
def otdus_with_scale(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Adding a method") :]
    start = r"```python\n(# scale.py, a new module of the package otdus_cli.methods\n"
    code = re.search(start + r".*?)```", section, re.S)
    assert code, "README's example module"
    (tmp_path / "scale.py").write_text(code.group(1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", RUN, *args], capture_output=True, text=True, env=env, timeout=300
        )

    return run


def test_the_readme_method_expands_with_its_flag_and_recipe_key(otdus_with_scale, tmp_path):
    done = otdus_with_scale(
        "expand", "bundled:stories260k", "--method", "scale", "--scale-factor", "0.25", "--layers", "1",
        "--out", str(tmp_path / "out"), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["method"] == "scale" and report["options"]["scale"] == {"factor": 0.25}
    new = [lay for lay in report["layers"] if lay["new"]]
    assert len(new) == 1 and new[0]["builder"] == "scale"
    src, out = CheckpointReader(STORIES260K), CheckpointReader(tmp_path / "out")
    prefix = f"model.layers.{new[0]['index']}."
    parent = f"model.layers.{new[0]['source']}."
    names = [n for n in out.names if n.startswith(prefix)]
    assert names
    for name in names:
        want = src.get(parent + name.removeprefix(prefix))
        assert torch.equal(out.get(name), (want.float() * 0.25).to(want.dtype)), name
    manifest = json.loads((tmp_path / "out" / "otdus.json").read_text())
    assert manifest["options"]["scale"] == {"factor": 0.25} and manifest["method"] == "scale"

    recipe = tmp_path / "scale.yaml"
    recipe.write_text(
        "model: bundled:stories260k\nexpand:\n  method: scale\n  layers: 1\n  scale:\n    factor: 0.125\n"
    )
    done = otdus_with_scale("expand", "--recipe", str(recipe), "--out", str(tmp_path / "r"), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["options"]["scale"] == {"factor": 0.125}

    bad = otdus_with_scale(
        "expand", "bundled:stories260k", "--method", "scale", "--scale-factor", "0", "--out", "x"
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --scale-factor 0.0: Input should be greater than 0"
    ]
