"""What a newcomer meets first (issue 13): bundled names everywhere, one-line parser errors, values
refused before the heavy imports, output a pipe can use, sizes in human units, hints that work.

Output is captured as a pipe captures it: through Typer's runner (never a terminal) or a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from otdus_cli.bundled import BUNDLED_MODELS, BUNDLED_TEXTS, STORIES260K
from otdus_cli.cli import app

README = Path(__file__).parent.parent / "README.md"
GETTING_STARTED = README.parent / "docs" / "getting-started.md"


def run_cli(*args, **kwargs):
    return CliRunner().invoke(app, [str(a) for a in args], **kwargs)


def otdus(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    """The CLI in a subprocess with its output piped (stdout and stderr are not terminals)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run(
        [sys.executable, "-m", "otdus_cli.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    return lines[0]


# -- models and texts by bundled name --------------------------------------------------------------
def test_inspect_and_plan_take_bundled_names():
    inspected = run_cli("inspect", "bundled:stories260k", "--json")
    assert inspected.exit_code == 0, inspected.output
    info = json.loads(inspected.stdout)
    assert info["num_hidden_layers"] == 5 and info["path"] == str(STORIES260K)
    planned = run_cli("plan", "bundled:stories260k", "--method", "copy", "--layers", "1", "--json")
    assert planned.exit_code == 0 and json.loads(planned.stdout)["num_hidden_layers"] == 6
    unknown = run_cli("inspect", "bundled:stories15m")
    assert unknown.exit_code == 2 and "bundled:stories260k" in one_error_line(unknown.stderr)


def test_readme_lists_every_bundled_name_and_how_to_run_otdus():
    readme = README.read_text()
    for name in [*BUNDLED_MODELS, *BUNDLED_TEXTS]:
        assert f"`{name}`" in readme, name
    assert ".venv/bin/otdus" in readme and "source .venv/bin/activate" in readme
    assert "otdus --install-completion" in readme


# -- --max-tokens: help and behaviour agree, the real count is reported -----------------------------
def test_max_tokens_help_says_at_least_and_the_scored_count_is_reported():
    helptext = run_cli("verify", "--help", env={"COLUMNS": "300"}).stdout
    assert "at least this many" in " ".join(helptext.split())
    human = run_cli("ppl", "bundled:stories260k", "--max-tokens", "100", "--device", "cpu")
    assert human.exit_code == 0, human.output
    scored = int(re.search(r"([\d,]+) tokens\n", human.stdout).group(1).replace(",", ""))
    assert scored > 100  # whole WikiText articles
    assert f"--max-tokens 100: scored {scored:,} tokens (the wikitext protocol scores whole documents" in (
        human.stdout
    )
    token = run_cli(
        "ppl", "bundled:stories260k", "--max-tokens", "100", "--protocol", "token", "--seq-len", "64",
        "--device", "cpu", "--json",
    )  # fmt: skip
    metrics = json.loads(token.stdout)["metrics"]
    assert metrics["settings"]["max_tokens"] == 100 and metrics["n_tokens"] == 63  # one 64-token window


# -- OT options: warn with what applies, record what was ignored ------------------------------------
def test_official_variant_warns_with_what_applies_and_marks_ignored_options(tmp_path):
    out = tmp_path / "official"
    result = run_cli(
        "expand", "bundled:stories260k", "--out", out, "--ot-variant", "official", "--max-iter", "5",
        "--layers", "1", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    warnings = json.loads(result.stdout)["transport_warnings"]
    assert warnings and not any("raise --max-iter" in w for w in warnings), warnings
    assert "--max-iter and --tol do not apply to it, --reg does" in warnings[0]
    assert "--max-iter was ignored: the official variant pins the released code's 10000 iterations" in (
        result.stderr
    )
    manifest = json.loads((out / "otdus.json").read_text())
    lesa = {"variant", "hidden", "epochs", "batch_size", "lr", "weight_decay", "norm_weight", "rank", "loo"}
    calib = {"ot.calib", "ot.calib_tokens"}  # only the activation variant reads calibration text
    assert set(manifest["ignored_options"]) == {"ot.tol", "ot.max_iter"} | calib | {
        f"lesa.{name}" for name in lesa
    }
    copied = run_cli("expand", "bundled:stories260k", "--out", tmp_path / "copy", "--method", "copy")
    assert copied.exit_code == 0, copied.output
    ignored = json.loads((tmp_path / "copy" / "otdus.json").read_text())["ignored_options"]
    assert set(ignored) == {"ot.variant", "ot.solver", "ot.reg", "ot.tol", "ot.max_iter"} | calib | {
        f"lesa.{name}" for name in lesa
    }


# -- parser errors: one line that names the real flag, a hint, exit 2 -------------------------------
@pytest.mark.parametrize(
    "args, expected",
    [
        (["expand", "bundled:stories260k", "--bogus"], ["No such option: --bogus", "otdus expand --help"]),
        (["expand", "bundled:stories260k", "--layers", "x"], ["'--layers'", "otdus expand --help"]),
        (
            ["expand", "bundled:stories260k", "--ot-variant", "papr"],
            ["'--ot-variant'", "'paper', 'official', 'structured'", "otdus expand --help"],
        ),
        (["verify"], ["Missing argument", "otdus verify --help"]),
        (["ppl", "bundled:stories260k", "--lm-eval", "0.3.0"], ["'--lm-eval'", "0.4.0 and later"]),
        (["exapnd"], ["No such command 'exapnd'", "otdus --help"]),
    ],
)
def test_parser_errors_are_one_line_with_a_hint(args, expected):
    result = run_cli(*args)
    assert result.exit_code == 2
    line = one_error_line(result.stderr)
    for text in expected:
        assert text in line, line
    assert "--variant" not in line.replace("--ot-variant", "")
    assert "╭" not in result.output and "Usage:" not in result.output
    if "papr" in args:  # docs/getting-started.md quotes this line word for word
        assert line in GETTING_STARTED.read_text(), line


def test_bad_option_values_are_refused_before_torch_or_transformers_is_imported(tmp_path):
    """Each refusal is checked in one fresh interpreter, after which torch must still be unloaded."""
    cases = [
        ["expand", "bundled:stories260k", "-o", str(tmp_path / "o"), "--dtype", "int8"],
        ["expand", "bundled:stories260k", "-o", str(tmp_path / "o"), "--method", "nope"],
        ["expand", "bundled:stories260k", "-o", str(tmp_path / "o"), "--device", "gpu"],
        ["plan", "bundled:stories260k", "--position", "sideways"],
        ["verify", "bundled:stories260k", "--dtype", "int8"],
        ["verify", "bundled:stories260k", "--protocol", "rolling"],
        ["verify", "bundled:stories260k", "--token-mode", "docs"],
        ["verify", "bundled:stories260k", "--device", "gpu"],
        ["verify", "bundled:stories260k", "--seq-len", "1"],
        ["verify", "bundled:stories260k", "--text", str(tmp_path / "missing.txt")],
        ["verify", str(tmp_path / "no-model")],
        ["ppl", "bundled:stories260k", "--max-tokens", "0"],
        ["ppl", "bundled:stories260k", "--lm-eval", "latest"],
        ["verify", "bundled:stories260k", "--max-length", "0"],
        ["ppl", "bundled:stories260k", "--text", "bundled:nope"],
        ["study", "bundled:stories260k", "--train", "bundled:tinystories-sample", "--methods", "ot,avg"],
        ["study", "bundled:stories260k", "--train", "bundled:tinystories-sample", "--seeds", "0,x"],
        ["study", "bundled:stories260k", "--train", "bundled:tinystories-sample", "--device", "gpu"],
        ["study", "bundled:stories260k"],
        ["diagnose", "bundled:stories260k", "--pair", "1,3"],
        ["diagnose", "bundled:stories260k", "--text", str(tmp_path / "missing.txt")],
        ["demo", "--method", "nope"],
        # list options: an empty item, a value named twice (where twice means nothing more)
        *(
            ["shrink", "bundled:stories260k", "-o", str(tmp_path / "o"), "--remove", removed]
            for removed in ["", "0,0", "1,,2"]
        ),
        ["plan", "bundled:stories260k", "--shrink", "drop", "--remove", "1,01"],
        ["expand", "bundled:stories260k", "-o", str(tmp_path / "o"), "--after", ""],
        ["plan", "bundled:stories260k", "--after", "1,,2"],
        ["study", "bundled:stories260k", "--train", "bundled:tinystories-sample", "--seeds", "1,1"],
        ["study", "bundled:stories260k", "--train", "bundled:tinystories-sample", "--methods", "ot,,copy"],
        ["study", "bundled:stories260k", "--train", "bundled:tinystories-sample", "--methods", "ot,ot"],
        ["study", "bundled:stories260k", "--train", "bundled:tinystories-sample", "--lr-sweep", "1e-3,0.001"],
        ["study", "bundled:stories260k", "--train", "bundled:tinystories-sample", "--lr-sweep", "1e-3,inf"],
        ["diagnose", "bundled:stories260k", "--pair", "1,"],
        ["trainable", str(tmp_path / "o"), "--also", "head", "--also", "head"],
    ]
    script = textwrap.dedent(
        """
        import json, sys
        from typer.testing import CliRunner
        from otdus_cli.cli import app
        for args in json.loads(sys.argv[1]):
            result = CliRunner().invoke(app, args)
            lines = [l for l in result.stderr.splitlines() if l.strip()]
            assert result.exit_code == 2, (args, result.output)
            assert len(lines) == 1 and lines[0].startswith("error:"), (args, result.stderr)
            heavy = [m for m in ("torch", "transformers") if m in sys.modules]
            assert not heavy, (args, heavy)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "o").exists()


# -- output through a pipe ------------------------------------------------------------------------
@pytest.mark.slow  # several CLI processes, each importing torch: make test-long
def test_piped_output_is_never_wrapped_and_sizes_are_in_human_units(tmp_path):
    model = Path(
        shutil.copytree(STORIES260K, tmp_path / ("a-folder-name-long-enough-to-pass-80-columns-" * 3))
    )
    inspected = otdus("inspect", model)
    assert inspected.returncode == 0, inspected.stderr
    assert inspected.stdout.splitlines()[0] == str(model)
    assert re.search(r"│ bytes +│ 1,040,128 \(1\.04 MB\) +│", inspected.stdout)
    out = model.parent / (model.name + "-deeper")
    expanded = otdus("expand", model, "--out", out, "--method", "copy", "--layers", "1")
    assert expanded.returncode == 0, expanded.stderr
    line = expanded.stdout.strip()
    assert "\n" not in line and line.startswith(f"wrote {out}: 5 -> 6 layers with copy"), line
    assert re.search(r", 1\.2\d MB in ", line) and "GB" not in line
    # stderr too: each warning whole on its line; --json stays one object on stdout
    warned = otdus("expand", model, "--out", tmp_path / "ot", "--max-iter", "2", "--layers", "1", "--json")
    assert warned.returncode == 0, warned.stderr
    warnings = [w for w in warned.stderr.splitlines() if w.strip()]
    assert warnings and all(w.startswith("warning: layer ") for w in warnings), warned.stderr
    assert all(w.endswith("raise --max-iter or --reg") for w in warnings)
    # where the time went: start-up to the first byte, the copy, the config check (a llama: otdus's
    # depth rules, transformers never imported for it)
    timings = json.loads(warned.stdout)["timings"]
    assert 0 < timings["startup_s"] < 300 and timings["copy_s"] > 0, timings
    assert timings["config_check"] == "otdus depth rules", timings
    # the README's pipeline: otdus expand ... --json | jq -r .out | xargs otdus verify
    verified = otdus("verify", json.loads(warned.stdout)["out"], "--max-tokens", "500", "--device", "cpu")
    assert verified.returncode == 0, verified.stderr
    assert "PARITY: function preserved" in verified.stdout


# -- hints that name values which work -------------------------------------------------------------
@pytest.mark.parametrize("method", ["llama-pro", "solar"])
def test_default_layer_count_failure_names_values_that_work(method):
    refused = run_cli("plan", "bundled:stories260k", "--method", method)
    assert refused.exit_code == 2
    line = one_error_line(refused.stderr)
    suggested = re.findall(r"--layers (\d+)", line.split(";")[-1])
    assert len(suggested) == 2 and line.endswith("would work"), line
    for layers in suggested:
        ok = run_cli("plan", "bundled:stories260k", "--method", method, "--layers", layers, "--json")
        assert ok.exit_code == 0, (layers, ok.output)


# -- shell completion ---------------------------------------------------------------------------------
def test_shell_completion_is_offered_and_completes_values():
    helptext = run_cli("--help", env={"COLUMNS": "200"}).stdout
    assert "--install-completion" in helptext and "--show-completion" in helptext
    env = {"_OTDUS_COMPLETE": "complete_bash", "COMP_WORDS": "otdus expand --method ", "COMP_CWORD": "3"}
    completed = CliRunner().invoke(app, [], prog_name="otdus", env=env)
    assert completed.exit_code == 0
    assert {"ot", "llama-pro", "solar"} <= set(completed.stdout.split())


# -- gated hub repositories -------------------------------------------------------------------------
def hub_refusal(status: int, error_code: str, repo: str) -> Exception:
    """The exception huggingface_hub's own status check raises for a refused API call."""
    from huggingface_hub.utils import _http, hf_raise_for_status

    http = getattr(_http, "httpx2", None) or _http.httpx
    request = http.Request("GET", f"https://huggingface.co/api/models/{repo}/revision/main")
    response = http.Response(status, headers={"X-Error-Code": error_code}, request=request)
    try:
        hf_raise_for_status(response)
    except Exception as exc:
        return exc
    raise AssertionError("no error raised")


@pytest.mark.parametrize(
    "status, error_code, expected",
    [
        (401, "GatedRepo", "is a gated repository and the hub refused access (HTTP 401)"),
        (403, "GatedRepo", "is a gated repository and the hub refused access (HTTP 403)"),
        (401, "RepoNotFound", "was not found on the hub (HTTP 401); if it is private or gated"),
        (403, "", "the hub refused access to meta-llama/Llama-3.1-8B (HTTP 403)"),
    ],
)
def test_refused_hub_access_says_what_to_do(tmp_path, monkeypatch, status, error_code, expected):
    import huggingface_hub
    from huggingface_hub import constants

    repo = "meta-llama/Llama-3.1-8B"

    def refuse(self, repo_id, **kwargs):
        raise hub_refusal(status, error_code, repo_id)

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", refuse)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    result = run_cli("plan", repo)
    assert result.exit_code == 2
    line = one_error_line(result.stderr)
    assert expected in line and "`hf auth login` or set HF_TOKEN" in line, line
    assert "give a local folder" in line
    if error_code == "GatedRepo":
        assert f"accept its licence on https://huggingface.co/{repo}" in line
        if status == 403:  # docs/getting-started.md quotes this line word for word
            assert line in GETTING_STARTED.read_text(), line
