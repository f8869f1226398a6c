"""CONTRIBUTING.md's worked examples of adding a method ("Adding a method"), run as written: each
module, registered with one line, gives `otdus expand` (`otdus shrink`) the method, its flag, its place
in --help, `otdus plan` and the recipe keys, and a row in the methods tables."""

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
# the registry lines CONTRIBUTING.md asks for, done before the CLI is imported (as registry.py would)
REGISTER = "from otdus_cli.methods.registry import register\nimport halfway, scale\n"
REGISTER += "register(scale.SCALE)\nregister(halfway.HALFWAY)\n"
RUN = "import sys\n" + REGISTER + "from otdus_cli.cli import main\nmain(sys.argv[1:])\n"
TABLES = REGISTER + "from scripts.methods_table import expand_table, shrink_table\n"
TABLES += "print(expand_table())\nprint(shrink_table())\n"


def _example(guide: str, module: str) -> str:
    section = guide[guide.index("## Adding a method") :]
    start = rf"```python\n(# {module}\.py, a new module of the package otdus_cli.methods\n"
    code = re.search(start + r".*?)```", section, re.S)
    assert code, f"CONTRIBUTING.md's example module {module}.py"
    return code.group(1)


@pytest.fixture
def otdus_with_examples(tmp_path):
    guide = (ROOT / "CONTRIBUTING.md").read_text()
    for module in ("scale", "halfway"):
        (tmp_path / f"{module}.py").write_text(_example(guide, module))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}

    def run(*args: str, code: str = RUN) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300
        )

    return run


def test_the_guide_method_expands_with_its_flag_and_recipe_key(otdus_with_examples, tmp_path):
    done = otdus_with_examples(
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

    _recipe_and_bad_flag(
        otdus_with_examples,
        tmp_path,
        "expand",
        "method: scale\n  layers: 1\n  scale:\n    factor: 0.125\n",
        ("scale", {"factor": 0.125}),
        ("--scale-factor", "0", "error: --scale-factor 0.0: Input should be greater than 0"),
    )


def test_the_guide_methods_are_offered_in_help_plan_and_the_tables(otdus_with_examples):
    expand_help = otdus_with_examples("expand", "--help")
    assert expand_help.returncode == 0, expand_help.stderr
    assert "scale" in re.search(r"--method <([^>]*)>", expand_help.stdout).group(1).split("|")
    assert "--scale-factor" in expand_help.stdout and "--halfway-weight" not in expand_help.stdout
    shrink_help = otdus_with_examples("shrink", "--help")
    assert shrink_help.returncode == 0, shrink_help.stderr
    assert re.search(r"--method <([^>]*)>", shrink_help.stdout).group(1).split("|")[-1] == "halfway"
    flat = " ".join(shrink_help.stdout.split())
    assert "halfway: the kept layer moved --halfway-weight of the way to its merge group's mean" in flat
    assert "--halfway-weight" in flat and "--scale-factor" not in flat

    plan = otdus_with_examples("plan", "bundled:stories260k", "--method", "scale", "--layers", "1", "--json")
    assert plan.returncode == 0, plan.stderr
    assert [lay["builder"] for lay in json.loads(plan.stdout)["layers"] if lay["new"]] == ["scale"]
    plan = otdus_with_examples(
        "plan",
        "bundled:stories260k",
        "--shrink",
        "halfway",
        "--select",
        "explicit",
        "--remove",
        "3",
        "--json",
    )
    assert plan.returncode == 0, plan.stderr
    assert [lay["builder"] for lay in json.loads(plan.stdout)["layers"] if lay["new"]] == ["halfway"]

    tables = otdus_with_examples(code=TABLES)
    assert tables.returncode == 0, tables.stderr
    rows = tables.stdout.splitlines()
    assert "| `scale` | a copy of f_i with every tensor scaled | off | only with `--zero-init` |" in rows
    assert (
        "| `halfway` | the kept layer moved --halfway-weight of the way to its merge group's mean |" in rows
    )


def test_the_guide_shrink_method_merges_with_its_flag_and_recipe_key(otdus_with_examples, tmp_path):
    done = otdus_with_examples(
        "shrink", "bundled:stories260k", "--method", "halfway", "--halfway-weight", "0.25",
        "--select", "explicit", "--remove", "3", "--out", str(tmp_path / "out"), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["method"] == "halfway" and report["options"]["halfway"] == {"weight": 0.25}
    merged = [lay for lay in report["layers"] if lay["new"]]
    assert [(lay["index"], lay["parents"], lay["builder"]) for lay in merged] == [(2, [2, 3], "halfway")]
    src, out = CheckpointReader(STORIES260K), CheckpointReader(tmp_path / "out")
    names = [n for n in out.names if n.startswith("model.layers.2.")]
    assert names
    for name in names:
        kept, removed = (src.get(name.replace(".2.", f".{i}.", 1)) for i in (2, 3))
        k, mean = kept.float(), (0 + kept.float() + removed.float()) / 2
        assert torch.equal(out.get(name), (k + 0.25 * (mean - k)).to(kept.dtype)), name
    for i, j in ((0, 0), (1, 1), (3, 4)):  # the kept layers, byte for byte
        for name in (n for n in out.names if n.startswith(f"model.layers.{i}.")):
            assert torch.equal(out.get(name), src.get(name.replace(f".{i}.", f".{j}.", 1))), name

    _recipe_and_bad_flag(
        otdus_with_examples,
        tmp_path,
        "shrink",
        "method: halfway\n  select: explicit\n  remove: [3]\n  halfway:\n    weight: 0.125\n",
        ("halfway", {"weight": 0.125}),
        ("--halfway-weight", "2", "error: --halfway-weight 2.0: Input should be less than or equal to 1"),
    )


def _recipe_and_bad_flag(otdus, tmp_path, command: str, section: str, option, bad) -> None:
    """A guide method is a recipe key of ``command`` (its ``section`` under it; the run records the
    ``option`` group's values) and a flag whose bad value is one error line."""
    recipe = tmp_path / f"{command}.yaml"
    recipe.write_text(f"model: bundled:stories260k\n{command}:\n  {section}")
    done = otdus(command, "--recipe", str(recipe), "--out", str(tmp_path / "r"), "--json")
    assert done.returncode == 0, done.stderr
    group, values = option
    assert json.loads(done.stdout)["options"][group] == values
    flag, value, message = bad
    wrong = otdus(command, "bundled:stories260k", "--method", group, flag, value, "--out", "x")
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines() == [message]
