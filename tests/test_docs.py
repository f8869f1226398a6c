"""Docs are promises: every path, script, make target and otdus command that README.md, CONTRIBUTING.md
and docs/*.md name exists, every link resolves, the front page stays short, and the quick command
blocks run from a fresh copy (scripts/check_docs.py; `make check-docs` runs every block)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
# a path as docs write it: under a folder of the repository, with a file name
PATH = re.compile(r"(?<![\w./-])((?:otdus_cli|scripts|recipes|docs|tests)/[\w./*-]*[\w*])")
# placeholders and what a run writes, not files of the repository
NOT_FILES = re.compile(
    r"\*|/(NAME|DIR|OUT)\b|^docs/evidence/.*\.png$|^tests/fixtures/tinystories_sample.txt$"
)


def _text(doc: Path) -> str:
    return doc.read_text()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_named_in_the_docs_exists(doc):
    missing = sorted(
        {
            path.rstrip(".")
            for path in PATH.findall(_text(doc))
            if not NOT_FILES.search(path) and not (ROOT / path.rstrip(".")).exists()
        }
    )
    assert not missing, f"{doc.name} names paths this repository does not have: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_reference_a_reader_cannot_open(doc):
    text = _text(doc)
    for pattern in (r"reference\.md", r"\.\./shared", r"\b[Ii]ssues? \d+", r"/work/"):
        assert not re.search(pattern, text), (doc.name, pattern, re.search(pattern, text).group(0))


def test_every_command_named_in_the_docs_exists():
    import typer.main

    from otdus_cli.cli import app

    commands = set(typer.main.get_command(app).commands)
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for doc in DOCS:
        text = _text(doc)
        blocks = "\n".join(re.findall(r"^```\w*\n(.*?)^```", text, re.S | re.M))
        named = re.findall(r"`otdus ([a-z][\w-]*)", text) + re.findall(r"^otdus ([a-z][\w-]*)", blocks, re.M)
        for name in named:
            assert name in commands, (doc.name, f"otdus {name}")
        named = re.findall(r"`make ([a-z][\w-]*)", text) + re.findall(r"^make ([a-z][\w-]*)", blocks, re.M)
        for target in named:
            assert target in targets, (doc.name, f"make {target}")
        # scripts run as modules of the scripts package, from the repository root
        assert not re.search(r"python3? scripts/", text), (
            doc.name,
            "python -m scripts.X, not python -m scripts.X",
        )
        for script in re.findall(r"python3? -m scripts\.(\w+)", text):
            assert (ROOT / "scripts" / f"{script}.py").is_file(), (doc.name, f"scripts.{script}")


# words that point at who worked on otdus, or when, rather than at anything a reader can open
UNPLACEABLE = (r"\bthe review\b", r"\bsessions?\b", r"\blent to\b", r"\bour machines\b", r"\btested with\b")


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "Makefile"], ids=lambda p: p.name)
def test_no_word_a_reader_cannot_place(doc):
    for pattern in UNPLACEABLE:
        found = re.search(pattern, _text(doc), re.I)
        assert not found, (doc.name, found and found.group(0))


def _anchors(text: str) -> Iterator[str]:
    """The #anchors GitHub gives the headings of a Markdown page (a repeated heading gets -1, -2 ...)."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def _prose(text: str) -> str:
    """The page without its fenced blocks (a `# comment` in a shell block is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_resolves(doc):
    """Every relative link names a file of the repository, and every #anchor a heading of its page."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(_text(doc))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        page = (doc.parent / path).resolve() if path else doc
        found = page.exists() and ROOT in page.parents
        if found and anchor:
            found = page.suffix == ".md" and anchor in set(_anchors(page.read_text()))
        if not found:
            broken.append(target)
    assert not broken, f"{doc.name} links to what does not exist: {broken}"


def test_the_front_page_is_short():
    """README.md is the front page: what otdus is, the quick start, one line per command; the manual is
    under docs/."""
    lines = _text(ROOT / "README.md").count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move the detail to a page under docs/"


def test_readme_prints_no_test_counts():
    """Counts drift (README said 742 + 150 when a clone ran 813 + 190): pytest prints them."""
    assert not re.search(r"\d+ \+ \d+ tests|\d{3,} tests", _text(ROOT / "README.md"))


def test_docs_commands_are_found_and_sorted():
    from scripts import check_docs

    cmds = check_docs.commands()
    run = [c for c in cmds if c.run is not None]
    assert any(c.run.startswith("otdus study bundled:stories260k") and "--steps 2" in c.run for c in run)
    assert all(c.why for c in cmds if c.run is None)  # every skip says why
    skipped = {c.text for c in cmds if c.run is None}
    assert any("meta-llama/" in t for t in skipped) and "make check-docs" in skipped  # no recursion
    # a shell loop is one command, not a `for ...; do` line, its body and a `done` run one by one
    loops = [c.text for c in cmds if c.text.startswith("for ")]
    assert loops and all(t.endswith("; done") for t in loops)
    assert not [c for c in cmds if c.text == "done" or c.text.endswith(" do")]
    # what runs offline is run (only an optional extra may be missing)
    assert all("matplotlib" in c.why for c in cmds if c.run is None and "bundled:" in c.text)


@pytest.mark.slow  # a minute or two of CPU: make test-long (CI runs it after make test)
def test_quick_docs_commands_run_from_a_fresh_copy():
    """`python -m scripts.check_docs --quick`: README's first hour, offline widening, ppl, diagnose...
    exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", "scripts.check_docs", "--quick", "--source", "worktree"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"(\d+) commands run, 0 failed", done.stdout)


def test_coverage_table_keeps_details_whole_and_records_when(tmp_path):
    from scripts import coverage

    detail = "refused: " + "word " * 60 + "end"
    counts = {"exact": 0, "derived": 0, "refused": 1, "failed": 0, "not built": 0}
    out = tmp_path / "compatibility.md"
    columns = {"zero-init": "refused", "OT": "", "LESA": "", "verify": ""}
    row = ("x", "XForCausalLM", "refused", "", detail, columns)
    coverage.write_table(out, [row], counts, "5.0", coverage.run_stamp())
    text = out.read_text()
    assert detail in text and re.search(r"on \d{4}-\d\d-\d\d \d\d:\d\d UTC, git \w+", text)
    assert "| zero-init | OT | LESA | verify |" in text
    assert "| x | XForCausalLM | refused |  | refused |" in text
    assert coverage._one_line(ValueError("a\nb  c")) == "a b c"


def test_coverage_checks_an_architecture_end_to_end(tmp_path, single_thread):
    """One row as `make coverage` makes it: DiffLLaMA's zero-init is refused in the middle of the stack
    (its layers' index enters their computation) and kept with the new layers after the last one, and
    verify's verdict on it is PARITY (the script read an evaluation set that no longer existed)."""
    from scripts import coverage

    kind, family, detail, columns = coverage.check("diffllama", tmp_path)
    assert (kind, family) == ("derived", "derived:diffllama")
    assert columns["zero-init"] == "bitwise" and columns["verify"] == "PARITY", columns
    assert "with the new layers after the last one (in the middle: zero-init for derived:diffllama" in detail
    # OT and LESA are refused for one reason, said once, short: a per-head parameter (DiffLlama's lambdas)
    why = "; OT, LESA refused: no layer kind has roles (DiffLlamaAttention+DiffLlamaMLP: no template's roles"
    assert columns["OT"] == columns["LESA"] == "refused" and why in detail and "use copy" not in detail


def test_coverage_says_why_a_method_is_refused(tiny_models):
    """A method's own refusal (OLMo 2's post-norm layers for OT) without the alternatives otdus suggests;
    each method's reason where they differ."""
    from scripts import coverage

    olmo2, mixtral = tiny_models["olmo2"], tiny_models["mixtral"]
    post_norm = coverage._refusal(olmo2, "ot")
    assert post_norm.startswith("post-norm layers (no norm before attention or the MLP)"), post_norm
    assert coverage._refusal(olmo2, "lesa") == "" and "use " not in post_norm
    moe = coverage._refusal(mixtral, "lesa")
    assert moe.startswith("MoE layers") and coverage._refusal(mixtral, "ot") == ""
    both = coverage._roles_note({"OT": post_norm, "LESA": moe})
    assert both == f"; OT refused: {post_norm}; LESA refused: {moe}"
    assert coverage._roles_note({"OT": moe, "LESA": moe}) == f"; OT, LESA refused: {moe}"
    assert coverage._roles_note({"OT": "", "LESA": ""}) == ""


def test_what_the_docs_run_writes_under_out():
    """The examples the docs run write under out/ (git ignores it; the README has it made first):
    `--out demo` and the stories260K ablation recipe's ./stories260k-average-zero landed beside it."""
    import yaml

    from scripts import check_docs

    for c in check_docs.commands():
        for out in re.findall(r"(?:--out|-o) (\S+)", c.run or ""):
            assert out.startswith(("out/", "$")), (c.doc, c.line, c.text)
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        data = yaml.safe_load(recipe.read_text())
        if str(data.get("model", "")).startswith("bundled:") and "out" in data:
            assert data["out"].startswith("out/"), (recipe.name, data["out"])
