"""Run every command block of README.md, CONTRIBUTING.md and docs/*.md from a fresh clone; report each exit.

    python -m scripts.check_docs            # every block: `make check-docs`
    python -m scripts.check_docs --quick    # the quick commands only (tests/test_docs.py runs these)
    python -m scripts.check_docs --list     # what would run, be shortened or be skipped, and why

The commands run one after the other in a copy of the repository (`git clone` of HEAD, or with
``--source worktree`` the files git tracks or would track, uncommitted changes included), offline
(HF_HUB_OFFLINE=1), each under a time limit, with `otdus` and `python` standing for this interpreter
and the copy's code. Long commands run with quick options (SHORTEN below); commands that need the
hub, a GPU, a cluster, a user's own model or hours are listed as skipped with the reason (SKIP).
Exit 0 when every command that ran exited as expected, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    "README.md",
    "CONTRIBUTING.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
]

# (pattern, reason): a command matching the pattern is not run
SKIP = [
    (r"^#!|^#SBATCH|\bsrun\b|\btorchrun\b|\bscontrol\b", "a Slurm/torchrun cluster script (docs/cluster.md)"),
    (r"\b(meta-llama|mistralai|Qwen|google)/", "needs the Hugging Face hub"),
    (
        r"(^|\s)\./(my-|llama-|mixtral-|deeper|wide|both)|\bM --out|my_corpus|/path/to/",
        "a placeholder for a user's own model",
    ),
    (r"--device cuda", "needs a GPU"),
    (r"^source |^pip install", "sets up an environment (needs the network)"),
    (r"^make check-docs\b", "this check itself"),
    (r"^make ", "a make target: sets up .venv (network) or runs for minutes to hours (make test: the suite)"),
    (
        r"^make smollm2\b|recipes/(shrink-)?smollm2-|out/smollm2-135m",
        "needs models/smollm2-135m, which `make smollm2` builds from a PyPI package (the network)",
    ),
    (r"--install-completion", "writes to the shell's start-up file"),
    (r"expand\.json|verify\.json|train\.py", "reads the files of a cluster job (docs/cluster.md)"),
    (r"^export |^OUT=|^set -", "a line of a cluster script"),
    (r"scripts\.evidence study", "hours of training: regenerates the stored studies (docs/evidence.md)"),
    (
        r"--recipe recipes/(llama|mistral|mixtral|qwen|solar)",
        "the recipe's model comes from the Hugging Face hub",
    ),
]
if importlib.util.find_spec("matplotlib") is None:  # the optional `plot` extra
    SKIP.append((r"--png |scripts\.evidence diagnose", "needs matplotlib (pip install -e '.[plot]')"))
# (pattern, replacement, reason): long commands with their quick options
SHORTEN = [
    (r"--steps 80", "--steps 2", "quick training"),
    (r"--seeds 0,1 ", "--seeds 0 ", "one seed"),
    (r"--eval-windows 64", "--eval-windows 4", "few held-out windows"),
    (r"--eval-every 20", "--eval-every 1", "quick training"),
    (
        r"(otdus study --recipe \S+) --out (\S+)",
        r"\1 --out out/check-docs-study --steps 1 --seeds 0 --eval-windows 2 --eval-every 1",
        "a whole study takes hours",
    ),
    (r"--max-tokens (20000|8192|2000)\b", "--max-tokens 1000", "fewer tokens"),
]
# commands run only by the full check (minutes each under load), not by --quick
# (diagnose and evidence.py render have their own tests: test_cli_commands.py, test_evidence.py)
SLOW = [r"^otdus study\b", r"scripts\.evidence\b", r"--png ", r"^otdus diagnose\b"]
# commands that exit non-zero on purpose: pattern -> expected exit code
EXPECTED_EXIT: list[tuple[str, int]] = [
    # README shows LLaMA-Factory's refusal of interleaved layers (one error line, exit 2)
    (r"^otdus trainable out/demo --format llama-factory$", 2),
]
TIMEOUT_S = 600


@dataclass
class Command:
    doc: str
    line: int
    text: str  # as the document shows it (continuations joined)
    run: str | None = None  # what is run (shortened), None when skipped
    why: str = ""  # why it was skipped or shortened
    slow: bool = False


def _blocks(text: str):
    """(first line number, body) of each fenced bash/sh block."""
    for match in re.finditer(r"^```(bash|sh|shell)\n(.*?)^```", text, re.S | re.M):
        yield text[: match.start()].count("\n") + 2, match.group(2)


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (not inside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(docs: list[str] = DOCS) -> list[Command]:
    """Every command of every bash block, continuation lines joined, with what to do with it."""
    found = []
    for doc in docs:
        text = (ROOT / doc).read_text()
        for first, body in _blocks(text):
            if body.startswith("#!"):  # a whole script (a Slurm job): one entry
                found.append(Command(doc, first, body.splitlines()[0] + " ... (a script)"))
                continue
            pending, start, loops = "", first, 0
            for offset, raw in enumerate(body.splitlines()):
                line = _strip_comment(raw).strip()
                if not line:
                    continue
                if not pending:
                    start = first + offset
                # a loop's lines are one command: `for ...; do`, its body and `done`, joined by `;`
                joint = " " if not pending or pending.endswith(("\\", " do")) else "; "
                pending = f"{pending.removesuffix(chr(92)).rstrip()}{joint}{line}" if pending else line
                loops += bool(re.match(r"(for|while|until) .*\bdo$", line)) - (line == "done")
                if pending.endswith("\\") or loops > 0:
                    continue
                found.append(Command(doc, start, pending))
                pending = ""
    for c in found:
        reason = next((why for pattern, why in SKIP if re.search(pattern, c.text)), None)
        if reason is None and c.text.startswith(("jq", "NEW=", "MODEL=", "echo")):
            reason = "a line of a cluster script"
        if reason is not None:
            c.why = reason
            continue
        run, reasons = c.text, []
        for pattern, replacement, why in SHORTEN:
            new = re.sub(pattern, replacement, run)
            if new != run:
                run, reasons = new, [*reasons, why]
        c.run, c.why = run, ", ".join(dict.fromkeys(reasons))
        c.slow = any(re.search(p, c.text) for p in SLOW)
    return found


def _copy(source: str, dest: Path) -> None:
    if source == "head":
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{ROOT}", str(dest)], check=True)
        return
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    dest.mkdir()
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def _environment(clone: Path, bin_dir: Path) -> dict[str, str]:
    """`otdus` and `python` for this interpreter, the copy's code first, offline."""
    bin_dir.mkdir()
    (bin_dir / "otdus").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m otdus_cli.cli "$@"\n')
    (bin_dir / "otdus").chmod(0o755)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(clone), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["OTDUS_PROGRESS_INTERVAL"] = "3600"
    return env


def run(
    cmds: list[Command], source: str, timeout: float, echo=print
) -> list[tuple[Command, int | None, str]]:
    """Run the commands in a fresh copy; (command, exit code or None when skipped, output tail)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="otdus-check-docs-") as tmp:
        clone = Path(tmp) / "otdus"
        _copy(source, clone)
        env = _environment(clone, Path(tmp) / "bin")
        for c in cmds:
            if c.run is None:
                results.append((c, None, ""))
                echo(f"SKIP {c.doc}:{c.line}: {c.text}\n     ({c.why})")
                continue
            t0 = time.monotonic()
            try:
                done = subprocess.run(
                    ["bash", "-o", "pipefail", "-c", c.run],
                    cwd=clone,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
                code, output = done.returncode, (done.stdout + done.stderr)[-2000:]
            except subprocess.TimeoutExpired:
                code, output = 124, f"timed out after {timeout:.0f} s"
            expected = next((e for p, e in EXPECTED_EXIT if re.search(p, c.run)), 0)
            status = "ok  " if code == expected else "FAIL"
            shown = c.run + (f"   [shortened: {c.why}]" if c.why else "")
            echo(f"{status} {c.doc}:{c.line}: exit {code} in {time.monotonic() - t0:.0f} s: {shown}")
            if code != expected:
                echo("     " + output.strip().replace("\n", "\n     "))
            results.append((c, code, output))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the quick commands (not SLOW)")
    ap.add_argument("--list", action="store_true", help="list the commands and what is done with each")
    ap.add_argument("--source", choices=("head", "worktree"), default="head", help="what the copy holds")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per command")
    args = ap.parse_args()
    cmds = commands()
    if args.quick:
        for c in cmds:
            if c.slow and c.run is not None:
                c.run, c.why = None, "slow: runs in the full check (make check-docs)"
    if args.list:
        for c in cmds:
            what = "skip" if c.run is None else ("run " if not c.why else "run*")
            print(f"{what} {c.doc}:{c.line}: {c.run or c.text}" + (f"   ({c.why})" if c.why else ""))
        return 0
    results = run(cmds, args.source, args.timeout)
    ran = [r for r in results if r[1] is not None]
    failed = [r for r in ran if r[1] != next((e for p, e in EXPECTED_EXIT if re.search(p, r[0].run)), 0)]
    print(f"{len(ran)} commands run, {len(failed)} failed, {len(results) - len(ran)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
