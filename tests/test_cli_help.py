"""Every command's --help explains its options with their defaults (rich markup must not eat them)."""

import re
import shlex

import pytest
from typer.testing import CliRunner

from otdus_cli.cli import app
from tests.support.cli_checks import one_error_line

COMMANDS = ["expand", "plan", "inspect", "verify", "ppl", "demo", "study", "diagnose", "shrink"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_options_with_defaults(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = result.stdout
    options = set(re.findall(r"--[a-z][a-z-]+", text)) - {"--help", "--json", "--no-zero-init"}
    assert options or command == "inspect"  # inspect takes only a path and --json
    if command == "expand":
        for default in (
            "[default: ot]",
            "[default: top]",
            "[default: 5GB]",
            "[default: 0.06]",
            "[default: auto]",
        ):
            assert default in text, default
    if command == "verify":
        assert "[default: wikitext]" in text and "[default: 2048" in text


def test_version_plain_and_json():
    import json

    from otdus_cli import __version__

    plain = CliRunner().invoke(app, ["version"])
    assert plain.exit_code == 0 and plain.stdout.strip() == __version__
    data = json.loads(CliRunner().invoke(app, ["version", "--json"]).stdout)
    assert data["otdus"] == __version__ and data["libraries"]["torch"] and data["python"]


def _params(command: str) -> dict:
    import typer.main

    return {p.name: p for p in typer.main.get_command(app).commands[command].params}


def _shown(param) -> str:
    """The default a hand-written help string shows, "[default: X]" (options whose real default is
    None so that recipes can fill them)."""
    match = re.search(r"\[default: ([^\]]+)\]", param.help or "")
    assert match, (param.name, param.help)
    return match.group(1)


@pytest.mark.parametrize("command", ["expand", "plan"])
def test_shown_expand_defaults_are_the_real_defaults(command):
    from otdus_cli.cli.flags import method_flags
    from otdus_cli.methods.registry import METHODS
    from otdus_cli.options import ExpandOptions, option_groups

    expand_defaults = ExpandOptions()
    real = {
        "method": expand_defaults.method,
        "position": expand_defaults.position,
        "device": expand_defaults.device,
        "dtype": expand_defaults.dtype,
        "max_shard_size": expand_defaults.max_shard_size,
        "seed": expand_defaults.seed,
    }
    # the methods' flags (generated from their options models), where the default is a value
    for flag in method_flags():
        default = option_groups()[flag.group]().model_dump()[flag.field]
        if default is not None:
            real[flag.param] = default
    params = _params(command)
    checked = 0
    for name, value in real.items():
        if name in params:
            shown = _shown(params[name]).split("; with --shrink: ")[0]  # plan also gives a shrink's
            assert shown == str(value) or float(shown) == value, (name, shown, value)
            checked += 1
    assert checked == (16 if command == "expand" else 4)
    zero_on = [m.name for m in METHODS.values() if m.zero_init_default]
    variants_off = [f"{m.name} {v}" for m in METHODS.values() for v in m.zero_init_off_for]
    assert zero_on == ["ot", "lesa", "llama-pro"] and variants_off == ["lesa published"]
    shown = _shown(params["zero_init"])
    assert shown == "on for ot, lesa and llama-pro (off for lesa published), off otherwise"
    assert _shown(params["layers"]).startswith("half the base depth")


# CLI defaults that differ from the library's on purpose
INTENDED = {("verify", "device"), ("ppl", "device")}  # the CLI picks a GPU when there is one


@pytest.mark.parametrize("command", ["verify", "ppl", "study", "diagnose"])
def test_cli_defaults_are_the_library_defaults(command):
    """Typer shows these defaults itself; they must be what the library does when called directly."""
    import inspect

    from otdus_cli.study.diagnose import diagnose
    from otdus_cli.study.runner import study
    from otdus_cli.verify.eval_set import make_eval_set
    from otdus_cli.verify.perplexity import perplexity

    functions = {"verify": [make_eval_set, perplexity], "ppl": [make_eval_set, perplexity]}
    functions |= {"study": [study], "diagnose": [diagnose]}
    library = {}
    for fn in functions[command]:
        for name, p in inspect.signature(fn).parameters.items():
            if p.default is not inspect.Parameter.empty:
                library.setdefault(name, p.default)
    if command == "study":  # the study's settings: their model's defaults
        from otdus_cli.study_settings import DEFAULT_METHODS, StudySettings

        library |= StudySettings().model_dump() | {"methods": DEFAULT_METHODS}
        library["eval_windows"] = str(library["eval_windows"])
    # CLI spellings of library parameters
    library |= {
        "methods": ",".join(library.get("methods", ())),
        "seeds": ",".join(map(str, library.get("seeds", ()))),
    }
    if command == "study":
        library["train_all"] = not library["train_new_only"]
    compared = []
    for name, param in _params(command).items():
        if name == "json_out" or (command, name) in INTENDED or name not in library:
            continue
        assert param.default == library[name], (command, name, param.default, library[name])
        compared.append(name)
    expected = {"verify": 10, "ppl": 11, "study": 16, "diagnose": 6}[command]
    assert len(compared) == expected, compared


def _commands():
    import typer.main

    group = typer.main.get_command(app)
    return group, group.commands


@pytest.mark.parametrize("width", [60, 80, 200])
def test_help_shows_every_option_and_default_whole_at_any_width(width):
    """At 80 columns rich's panels cut option names (`--allow-unknown-…`) and defaults and squeezed
    descriptions to ~18 characters: every name and default must appear whole, on one line."""
    group, commands = _commands()
    for name, command in [(None, group), *commands.items()]:
        args = ["--help"] if name is None else [name, "--help"]
        result = CliRunner().invoke(app, args, env={"COLUMNS": str(width)})
        assert result.exit_code == 0, (name, result.output)
        text = result.stdout
        assert "…" not in text and "<bool>" not in text, (name, width)
        lines = text.splitlines()
        for param in command.params:
            for opt in [*param.opts, *getattr(param, "secondary_opts", [])]:
                if opt.startswith("-"):
                    assert re.search(rf"(^|[\s,/]){re.escape(opt)}($|[\s,/])", text), (name, width, opt)
            shown = re.search(r"\[default: ([^\]]+)\]", param.help or "")
            if shown:
                default = shown.group(1)
            elif getattr(param, "show_default", False) and param.default not in (None, False, ()):
                default = str(param.default)
            else:
                continue
            words = default.split()
            # "[default: X" with X's first word stays on one line; no word of X is broken
            assert any(f"[default: {words[0]}" in line for line in lines), (name, width, default)
            for word in words:
                assert word in text, (name, width, word)
        if width >= 80:  # the text uses the width (descriptions were squeezed to ~18 characters)
            assert min(width, 100) - 25 <= max(map(len, lines)) <= min(width, 100) + 30, (name, width)


def test_dash_h_and_version_flag():
    from otdus_cli import __version__

    short = CliRunner().invoke(app, ["expand", "-h"])
    assert short.exit_code == 0 and "--method" in short.stdout
    assert CliRunner().invoke(app, ["-h"]).exit_code == 0
    version = CliRunner().invoke(app, ["--version"])
    assert version.exit_code == 0 and version.stdout.strip() == __version__


# the panels of `otdus -h`, in order, and the commands under each
PANELS = {
    "Grow": ["expand", "widen"],
    "Shrink": ["shrink"],
    "Check": ["plan", "inspect", "verify", "ppl"],
    "Study": ["study", "diagnose"],
    "Hand-off": ["trainable"],
    "About": ["demo", "version"],
}


def test_commands_are_grouped_in_order_with_whole_summaries():
    """The commands were listed in the order they were added (shrink, widen, trainable after version),
    each summary cut at 45 characters with "..."."""
    text = CliRunner().invoke(app, ["-h"], env={"COLUMNS": "100"}).stdout
    sections = re.findall(r"^(\S[^:\n]*):\n((?:  .*\n|\n)*?)(?=\S|\Z)", text + "\n", re.M)
    listed = {title: re.findall(r"^  (\S+)", body, re.M) for title, body in sections if title in PANELS}
    assert list(listed) == list(PANELS) and listed == PANELS, text
    _, commands = _commands()
    for command in commands.values():  # each summary whole: its first sentence, however long
        summary = " ".join(command.get_short_help_str(limit=10_000).split())
        assert summary in " ".join(text.split()) and not summary.endswith("...")
    assert not any("..." in body for _, body in sections)


def test_required_arguments_and_options_are_marked():
    """expand, shrink and plan showed [model] as if it could be left out, and --out unmarked."""
    for name in ("expand", "shrink", "plan"):
        text = CliRunner().invoke(app, [name, "-h"]).stdout
        assert text.startswith(f"Usage: root {name} [OPTIONS] MODEL\n"), text
        assert "bundled:stories260k. [required unless --recipe names it]" in " ".join(text.split())
        if name != "plan":
            out = " ".join(text.split("-o, --out <path>")[1].split("\n  --recipe")[0].split())
            assert out == "Output folder (must not exist). [required unless --recipe names it]"
    widen = " ".join(CliRunner().invoke(app, ["widen", "-h"]).stdout.split())
    assert "Usage: root widen [OPTIONS] MODEL " in widen and "(must not exist). [required]" in widen


def test_closed_sets_show_their_values():
    """trainable showed `--format <str>` and `--also <list[str]>`."""
    text = CliRunner().invoke(app, ["trainable", "-h"]).stdout
    assert "--format <axolotl|llama-factory|json|names>" in text
    assert "--also <embeddings|norms|head>" in text


def test_every_command_ends_with_an_example_that_parses():
    """An example per command, last in its help, each one a valid command line whose --out is under
    out/, which the README has the reader create."""
    _, commands = _commands()
    for name, command in commands.items():
        text = CliRunner().invoke(app, [name, "-h"]).stdout
        example = text.split("\nExample:\n")[1].strip()
        assert "\n" not in example, (name, text)
        argv = shlex.split(example)
        assert argv[:2] == ["otdus", name], example
        command.make_context(name, argv[2:])  # the parse: options, values, parsers
        for flag, value in zip(argv, argv[1:], strict=False):
            if flag in ("--out", "-o"):
                assert value.startswith("out/"), example


def test_an_unknown_option_suggests_only_a_near_one():
    """`verify --out` suggested "(Possible options: --quiet)"."""
    far = one_error_line(CliRunner().invoke(app, ["verify", "x", "--out", "y"]))
    assert far == "error: No such option: --out; see `otdus verify --help`"
    near = one_error_line(CliRunner().invoke(app, ["verify", "x", "--max-token", "3"]))
    assert "(did you mean --max-tokens?)" in near
