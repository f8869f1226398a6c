"""`otdus verify` as users run it: exit codes, verdicts, and memory that does not grow with the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from otdus_cli.cli import app
from otdus_cli.expand import expand
from otdus_cli.methods.lesa import LesaOptions
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import one_error_line
from tests.support.memory_limits import run_limited, write_random_checkpoint

pytestmark = [pytest.mark.compat]

runner = CliRunner()
QUICK = ["--max-tokens", "2048", "--device", "cpu", "--json"]
QUICK_LESA = LesaOptions(epochs=2)  # the predictor's quality does not matter here
TINYSTORIES = Path(__file__).parent.parent / "otdus_cli" / "data" / "tinystories_sample_cs336.txt"


def verify(*args) -> tuple[int, dict]:
    result = runner.invoke(app, ["verify", *map(str, args), *QUICK])
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else {}


def test_function_preserving_expansions_hold_parity_exactly(tmp_path):
    for method, layers in (("llama-pro", 5), ("ot", 2), ("lesa", 2)):
        out = tmp_path / method
        expand("bundled:stories260k", out, ExpandOptions(method=method, layers=layers, lesa=QUICK_LESA))
        code, report = verify(out)  # base from the manifest
        assert code == 0 and report["parity"] and report["logits_equal"], report["verdict"]
        assert report["base"]["word_perplexity"] == report["expanded"]["word_perplexity"]
        assert report["verdict"].startswith("PARITY")
        assert report["verdict"].endswith("[wikitext figures of lm-eval 0.4.13]")  # the default release


def test_non_preserving_methods_report_the_rise_and_exit_0(tmp_path):
    # LESA as published zeroes nothing: its predicted o/down change the function (a little, with a
    # predictor trained this briefly: its coefficients, hence o/down, come out small)
    published = LesaOptions(epochs=2, variant="published")
    for method, layers, rise in (("solar", 3, 1.05), ("average", 2, 1.05), ("lesa", 2, 1.0)):
        out = tmp_path / method
        expand("bundled:stories260k", out, ExpandOptions(method=method, layers=layers, lesa=published))
        # in-domain text: the trained model's perplexity rises when its function is disturbed
        code, report = verify(out, "--protocol", "token", "--token-mode", "documents", "--text", TINYSTORIES)
        assert code == 0 and not report["expect_parity"] and not report["logits_equal"]
        assert "not function-preserving" in report["verdict"]
        assert report["expanded"]["token_perplexity"] > report["base"]["token_perplexity"] * rise


def test_corrupted_new_layer_exits_1_naming_it(tmp_path):
    out = tmp_path / "ot"
    expand("bundled:stories260k", out, ExpandOptions(method="ot", layers=2))
    shard = out / "model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(shard))
    tensors["model.layers.5.self_attn.o_proj.weight"][0, 0] = 0.5  # one nonzero entry in a zero-init layer
    save_file(tensors, str(shard), metadata={"format": "pt"})
    code, report = verify(out)
    assert code == 1 and not report["parity"]
    assert "5" in report["first_divergence"]["name"] and report["first_divergence"]["expanded_layer"] == 5
    plain = runner.invoke(app, ["verify", str(out), "--max-tokens", "2048", "--device", "cpu"])
    assert plain.exit_code == 1 and "BROKEN" in plain.stdout


def test_ppl_of_one_model(tmp_path):
    result = runner.invoke(
        app,
        [
            "ppl",
            "bundled:stories260k",
            "--protocol",
            "token",
            "--token-mode",
            "documents",
            "--text",
            str(Path(__file__).parent.parent / "otdus_cli/data/tinystories_sample_cs336.txt"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert abs(json.loads(result.stdout)["metrics"]["token_perplexity"] - 3.548) < 0.01
    bad = runner.invoke(app, ["verify", str(tmp_path / "missing")])
    assert bad.exit_code == 2 and bad.stderr.startswith("error:")


def test_ppl_takes_lm_eval_s_softmax_dtype():
    """--softmax-dtype model: the log-softmax in --dtype and each window summed in it, as lm-eval (its
    figures are checked in tests/test_verify_perplexity.py); an unknown value is one error line."""
    args = ["ppl", "bundled:stories260k", "--max-docs", "1", "--dtype", "bfloat16", "--device", "cpu"]
    result = runner.invoke(app, [*args, "--softmax-dtype", "model", "--json"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)["metrics"]
    assert metrics["settings"]["softmax_dtype"] == "bfloat16"
    assert metrics["loglikelihood"] == int(metrics["loglikelihood"])  # sums of whole bfloat16 numbers
    one_error_line(runner.invoke(app, [*args, "--softmax-dtype", "bfloat16"]), message="softmax-dtype")


SMALL = ["--protocol", "token", "--token-mode", "documents", "--text", str(TINYSTORIES), "--seq-len", "64"]
SMALL += ["--max-tokens", "128", "--device", "cpu"]


def corrupt(folder: Path, name: str) -> None:
    """Add 0.01 to one weight of `name` in a single-file checkpoint."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors[name][0, 0] += 0.01
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_verify_with_explicit_base(stories, tmp_path):
    """--base replaces the manifest's source: against a copy of the recorded base parity holds; an
    altered copy is not the model the expansion was made from (exit 2, naming the changed layer)."""
    import shutil

    out = tmp_path / "out"
    expand(str(stories), out, ExpandOptions(method="llama-pro", layers=5))
    same_model = Path(shutil.copytree(stories, tmp_path / "same"))
    same = runner.invoke(app, ["verify", str(out), "--base", str(same_model), *SMALL, "--json"])
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["base_model"] == str(same_model)
    other = Path(shutil.copytree(stories, tmp_path / "other"))
    corrupt(other, "model.layers.3.mlp.up_proj.weight")
    result = runner.invoke(app, ["verify", str(out), "--base", str(other), *SMALL, "--json"])
    assert result.exit_code == 2, result.output
    assert "layer 3 differs from the recorded fingerprint" in result.stderr and not result.stdout


def test_first_divergence_in_a_corrupted_copied_base_layer(stories, tmp_path):
    out = tmp_path / "out"
    result = expand(str(stories), out, ExpandOptions(method="llama-pro", layers=5))
    (copy_of_2,) = [
        lay["index"] for lay in result.manifest["layers"] if lay["source"] == 2 and not lay["new"]
    ]
    corrupt(out, f"model.layers.{copy_of_2}.self_attn.v_proj.weight")
    plain = runner.invoke(app, ["verify", str(out), *SMALL], env={"COLUMNS": "200"})
    assert plain.exit_code == 1, plain.output
    lines = [line for line in plain.stdout.splitlines() if line.startswith("first divergence: ")]
    name = f"layer {copy_of_2} (copy of base layer 2)"
    assert len(lines) == 1 and lines[0].startswith(f"first divergence: {name} (max |diff| "), plain.stdout
    assert (
        "BROKEN: expected function preservation" in plain.stdout
        and f"first divergence at {name}" in plain.stdout
    )


def test_verify_with_no_manifest_and_no_base_refuses_and_points_at_ppl(stories, tmp_path):
    """A perplexity table with exit 0 read as a passed check although no parity was checked."""
    result = runner.invoke(app, ["verify", str(stories), *SMALL])
    line = one_error_line(result, message="nothing to check parity against")
    assert "--base" in line and f"otdus ppl {stories}" in line
    ppl = runner.invoke(app, ["ppl", str(stories), *SMALL, "--json"])
    assert ppl.exit_code == 0 and json.loads(ppl.stdout)["metrics"]["n_tokens"] > 0
    # a folder with no config.json is named as such, with what to give instead
    no_config = runner.invoke(app, ["verify", str(tmp_path)])
    assert "holds no config.json" in one_error_line(no_config) and "otdus expand" in no_config.stderr


def test_verdict_line_keeps_its_lm_eval_note_and_no_trailing_space(tmp_path):
    out = tmp_path / "ot"
    expand("bundled:stories260k", out, ExpandOptions(method="llama-pro", layers=1))
    result = runner.invoke(app, ["verify", str(out), "--max-tokens", "256", "--device", "cpu", "-q"])
    assert result.exit_code == 0, result.output
    verdict = next(line for line in result.stdout.splitlines() if line.startswith("PARITY"))
    assert verdict.endswith("[wikitext figures of lm-eval 0.4.13]"), verdict  # rich markup ate it


@pytest.mark.slow
def test_verify_runs_under_a_memory_limit_smaller_than_the_checkpoint(tmp_path):
    size = write_random_checkpoint(tmp_path / "big", layers=20, hidden=1024, inter=4096)
    limit = 900_000_000
    assert size > 1.4 * limit
    stories = Path(__file__).parent.parent / "otdus_cli" / "data" / "stories260k"
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        (tmp_path / "big" / f).write_bytes((stories / f).read_bytes())
    expand(str(tmp_path / "big"), tmp_path / "deeper", ExpandOptions(method="llama-pro", layers=2))
    # the limit is real, and what fails under it is memory: loading the weights whole cannot map
    # them (ENOMEM), and the checkpoint's bytes alone do not fit
    shard = str(tmp_path / "big" / "model.safetensors")
    whole = run_limited(
        ["-c", "import sys; from safetensors.torch import load_file; load_file(sys.argv[1])", shard], limit
    )
    assert whole.returncode != 0 and "Cannot allocate memory" in whole.stderr, whole.stderr[-1000:]
    read = run_limited(["-c", "import sys; open(sys.argv[1], 'rb').read()", shard], limit)
    assert read.returncode != 0 and "MemoryError" in read.stderr, read.stderr[-1000:]
    done = run_limited(
        [
            "-m",
            "otdus_cli.cli",
            "verify",
            str(tmp_path / "deeper"),
            "--protocol",
            "token",
            "--seq-len",
            "128",
            "--max-tokens",
            "512",
            "--device",
            "cpu",
            "--json",
        ],
        limit,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["parity"] and report["base_model"] == str(tmp_path / "big")
