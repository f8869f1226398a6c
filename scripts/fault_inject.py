"""Kill `otdus expand`, `widen`, `expand --experts`, `study` and `verify --card` at random moments and
check that no data is ever lost (docs/safety.md).

On synthetic checkpoints (scripts/make_synthetic.py: a dense one, by default the tiny Llama, or
`--dense llama-3.2-1b --layers 4` for ~1 GB, and a tiny Mixtral for the MoE commands), each run is a
real `otdus` process: `expand` (copy, llama-pro or average), `widen` or `expand --experts 2` into one
model output, a two-step `study` of the dense source into a study output, about half of them
`--force` onto an earlier output, or `verify --card` on the model output in place; killed after a
random delay with SIGINT, SIGTERM, SIGHUP or SIGKILL (or left to finish). A share of the delays
(--startup-share) falls in the first two seconds of the process, while Python, Typer, torch, numpy
and scipy are being imported; the others span an undisturbed run of that command. After every run:

* the source is byte-identical to what it was (SHA-256 of every file): zero lost source bytes;
* the exit code is 128 + the signal (or 0 when the run finished first; -9 for SIGKILL);
* nothing is left beside --out but what a SIGKILLed run leaves (its temporary folder), and every
  such folder is removed, and reported, by a later run (a final clean run sweeps the rest);
* an interrupted `--force` or `verify --card` run left the earlier output byte-identical, or, when it
  says it had finished, put the new output (the new card) in place;
* every output that exists is complete: `otdus verify` passes on a model output (the static check,
  and the perplexity run with `--verify full`), and every file of a model or study output is what
  its otdus.json records (the check `--force` and `verify --card` make).

    python -m scripts.fault_inject --runs 150      # make faults
    python -m scripts.fault_inject --runs 10 --workdir /tmp/faults --keep
    python -m scripts.fault_inject --dense llama-3.2-1b --layers 4   # ~1 GB dense source

A signal that lands before Python runs any otdus code (the interpreter's own start-up, the first tens
of milliseconds: initialisation and `site`) ends it as the interpreter does: the default action
(exit -signal here, 128 + signal in a shell) or, for SIGINT, Python's KeyboardInterrupt (a traceback
with no otdus frame, exit -2, or `Fatal Python error: init_...`, exit 1), with nothing written; it is
counted apart ("killed in interpreter start-up").

Prints one line per run and a summary; exit 1 if any check failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OTDUS = str(Path(sys.executable).parent / "otdus")
STORIES = HERE.parent / "otdus_cli" / "data" / "stories260k"
SIGNALS = {
    "SIGINT": signal.SIGINT,
    "SIGTERM": signal.SIGTERM,
    "SIGHUP": signal.SIGHUP,
    "SIGKILL": signal.SIGKILL,
}
# (source, command line after the model) for each kind of run; the output each writes (OUTPUTS)
COMMANDS = {
    "copy": ("dense", ["expand", "--method", "copy", "--layers", "2"]),
    "llama-pro": ("dense", ["expand", "--method", "llama-pro", "--layers", "2"]),
    "average": ("dense", ["expand", "--method", "average", "--layers", "1"]),
    "widen": ("moe", ["widen", "--noise", "0"]),
    "experts": ("moe", ["expand", "--method", "copy", "--layers", "2", "--experts", "2"]),
    "study": ("dense", ["study", "--train", "bundled:tinystories-sample", "--methods", "copy", "--reference",
                        "copy", "--seeds", "0", "--steps", "2", "--batch", "2", "--seq-len", "32",
                        "--eval-every", "2", "--eval-windows", "2", "--layers", "1"]),
    # on the model output in place (no --out): the command's "source" is that output
    "card": ("model", ["verify", "--card", "--text", "bundled:tinystories-sample", "--protocol", "token",
                       "--max-tokens", "64", "--seq-len", "32"]),
}  # fmt: skip
OUTPUTS = {"study": "study", "card": "model"}  # every other kind writes the model output
IN_PLACE = {"card"}
PROGRESS = re.compile(r"(study|otdus \w+): ")
STARTUP_S = 2.0
# what a run says of a temporary folder a SIGKILLed run left, when it removes it
REMOVED = r"removed \S*/(\.[^/\s,]+), left by an otdus run that died"


def tree_digest(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 24), b""):
                    h.update(block)
            out[str(p.relative_to(folder))] = h.hexdigest()
    return out


def leftovers(parent: Path, out_name: str) -> set[str]:
    """Temporary folders beside --out (the lock file a SIGKILLed run leaves is unlinked by the next
    run that takes the lock; the final check requires it gone too)."""
    lock = f".{out_name}.otdus-lock"
    return {p.name for p in parent.iterdir() if p.name.startswith(f".{out_name}.otdus-") and p.name != lock}


def in_interpreter_startup(code: int, signum: int, stderr: str) -> bool:
    """Did ``signum`` end the process before any otdus code ran? Then the interpreter reports it:
    the default action (exit -signum, nothing said); or, for SIGINT, Python's KeyboardInterrupt, as
    a traceback through the console script's first line (exit -2) or a fatal error while Python
    initialises (`Fatal Python error: init_import_site`, `init_sys_streams`: exit 1); never with a
    frame in otdus_cli (the console script's own line `from otdus_cli.entry import main` may show:
    importing the package, before entry's first line)."""
    if re.search(r'File "[^"]*otdus_cli/', stderr):
        return False
    if code == -signum:
        return not stderr.strip() or (
            signum == signal.SIGINT and stderr.rstrip().endswith("KeyboardInterrupt")
        )
    return code == 1 and signum == signal.SIGINT and "Fatal Python error: init_" in stderr


def make_source(path: Path, shape: str, layers: int | None) -> None:
    if (path / "config.json").is_file():
        return
    subprocess.run(
        [sys.executable, "-m", "scripts.make_synthetic", shape, "--out", str(path.resolve()),
         *(["--layers", str(layers)] if layers else []), "--fill", "fast", "--max-shard-size", "300MB",
         "--tokenizer-from", str(STORIES)],
        check=True, cwd=HERE.parent,
    )  # fmt: skip


def default_signals() -> None:
    """The child starts with default signal dispositions whatever this script inherited: started as a
    shell's background job, it would ignore SIGINT (as otdus rightly keeps it), and the SIGINT runs
    would test nothing."""
    for sig in SIGNALS.values():
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)


def command(kind: str, sources: dict[str, Path], out: Path, force: bool) -> list[str]:
    source, args = COMMANDS[kind]
    if kind in IN_PLACE:
        return [OTDUS, args[0], str(out), *args[1:]]
    return [
        OTDUS,
        args[0],
        str(sources[source]),
        "--out",
        str(out),
        *args[1:],
        *(["--force"] if force else []),
    ]


def whole(out: Path, output: str) -> tuple[bool, str]:
    """Is every file of the output what its otdus.json records, and nothing else there?"""
    from otdus_cli.errors import OtdusError
    from otdus_cli.io.output_dir import earlier_output_files

    try:
        earlier_output_files(out, output)
    except OtdusError as exc:
        return False, str(exc)
    return True, ""


def verify(out: Path, full: bool) -> tuple[bool, str]:
    args = [OTDUS, "verify", str(out), "--json"]
    args += ["--protocol", "token", "--max-tokens", "64", "--seq-len", "32"] if full else ["--static"]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        return False, proc.stderr.strip() or proc.stdout[-300:]
    report = json.loads(proc.stdout)
    # a method that does not preserve the function (average) is whole when verify runs it and says so
    ok = (
        report["verdict"].startswith("PARITY" if report["expect_parity"] else "no parity expected")
        if full
        else report["preserving"] or not report["claims_preserving"]
    )
    return ok, report.get("verdict", report.get("reason", ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=120)
    ap.add_argument("--dense", default="tiny", help="make_synthetic.py shape of the dense source")
    ap.add_argument("--layers", type=int, default=None, help="dense source layers (llama-3.2-1b 4: ~1.0 GB)")
    ap.add_argument("--startup-share", type=float, default=0.4,
                    help="share of runs signalled in the first two seconds of the process")  # fmt: skip
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/otdus-faults"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify", choices=("static", "full"), default="static",
                    help="static: fingerprints and zeros (seconds); full: also a perplexity run")  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    sources = {"dense": work / f"source-{args.dense}-{args.layers or 'all'}", "moe": work / "source-moe"}
    make_source(sources["dense"], args.dense, args.layers)
    make_source(sources["moe"], "tiny-mixtral", None)
    digests = {k: tree_digest(p) for k, p in sources.items()}
    sizes = {k: sum((p / name).stat().st_size for name in digests[k]) for k, p in sources.items()}
    out_parent = Path(tempfile.mkdtemp(prefix="outs-", dir=work))  # its own: only it is removed after
    outs = {"model": out_parent / "deeper", "study": out_parent / "study"}
    print(
        f"sources: {', '.join(f'{k} {sizes[k] / 1e6:.1f} MB' for k in sources)}; {args.runs} runs", flush=True
    )

    # how long an undisturbed run takes, per command: the kill delays are drawn over that span
    durations = {}
    for kind in COMMANDS:
        out = outs[OUTPUTS.get(kind, "model")]
        t = time.monotonic()
        force = out.exists() and kind not in IN_PLACE
        subprocess.run(command(kind, {**sources, "model": out}, out, force), check=True, capture_output=True)
        durations[kind] = time.monotonic() - t
    print("undisturbed: " + ", ".join(f"{k} {d:.1f} s" for k, d in durations.items()), flush=True)

    failures: list[str] = []
    stale: set[str] = set()  # temporary folders SIGKILLed runs left, not yet swept
    reported: set[str] = set()
    counts: dict[str, int] = {}
    codes: dict[int, int] = {}
    kinds: dict[str, int] = {}
    lost_outputs = 0
    startup_runs = 0
    before_python = 0  # killed by the default action before any otdus code ran
    verified = 0
    for run in range(args.runs):
        kind = rng.choice(list(COMMANDS))
        output = OUTPUTS.get(kind, "model")
        out = outs[output]
        if kind in IN_PLACE and not out.exists():  # something to put a card on: an undisturbed copy run
            made = subprocess.run(command("copy", sources, out, False), capture_output=True, text=True)
            for name in re.findall(REMOVED, made.stderr):
                reported.add(name)
                stale.discard(name)
            if made.returncode != 0:
                failures.append(f"run {run + 1}: making the output to verify: {made.stderr.strip()[-200:]}")
                continue
        kinds[kind] = kinds.get(kind, 0) + 1
        force = kind not in IN_PLACE and out.exists() and rng.random() < 0.5
        if kind not in IN_PLACE and out.exists() and not force:
            shutil.rmtree(out)  # the harness's own cleanup between runs: otdus never does this
        before = tree_digest(out) if out.exists() else None
        sig_name = rng.choice(list(SIGNALS))
        startup = rng.random() < args.startup_share
        startup_runs += startup
        delay = rng.uniform(0, STARTUP_S) if startup else rng.uniform(0, 1.1 * durations[kind])
        proc = subprocess.Popen(command(kind, {**sources, "model": out}, out, force), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)  # fmt: skip
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(SIGNALS[sig_name])
        code = proc.wait()
        stderr = proc.stderr.read()
        outcome = "finished" if code == 0 else sig_name
        counts[outcome] = counts.get(outcome, 0) + 1
        codes[code] = codes.get(code, 0) + 1
        problems = []

        for k, p in sources.items():
            if tree_digest(p) != digests[k]:
                problems.append(f"SOURCE CHANGED ({k})")
        # a signal in the interpreter's own start-up, before the console script reached otdus code
        # (otdus_cli.entry installs its handlers first thing): Python's to report, nothing written yet
        early = sig_name != "SIGKILL" and in_interpreter_startup(code, SIGNALS[sig_name], stderr)
        before_python += early
        if early and leftovers(out_parent, out.name) - stale:
            problems.append("killed in interpreter start-up, yet something was left beside --out")
        if code == -SIGNALS[sig_name] and sig_name != "SIGKILL" and not early:
            problems.append("killed by the default action after otdus had started")
        allowed = {0, 128 + SIGNALS[sig_name]} | ({-signal.SIGKILL} if sig_name == "SIGKILL" else set())
        if code not in allowed and not early:
            problems.append(f"exit {code}: {stderr.strip()[-200:]}")
        # besides the one line that says why it stopped: the progress lines a log gets (study's runs,
        # verify's passes), each starting with the command's name
        lines = [line for line in stderr.splitlines() if line.strip() and not PROGRESS.match(line)]
        if (
            code not in (0, -signal.SIGKILL)
            and not early
            and len(lines) > 1 + stderr.count(", left by an otdus run")
        ):
            problems.append(f"{len(lines)} lines on stderr")
        if "Traceback" in stderr and not early:
            problems.append("traceback on stderr")
        removals = re.findall(REMOVED, stderr)
        for name in sorted(set(removals)):
            # one folder, one line: a repeated line is a defect of its own, not a second folder
            if removals.count(name) > 1:
                problems.append(f"said {removals.count(name)} times that it removed {name}")
            if name not in stale:
                problems.append(f"reported removing {name}, which no killed run left")
            reported.add(name)
            stale.discard(name)
        now = set().union(*(leftovers(out_parent, o.name) for o in outs.values()))
        if code == -signal.SIGKILL:
            stale |= now
        unexplained = now - stale
        if unexplained:
            problems.append(f"left behind: {sorted(unexplained)}")
        # whatever the exit code, an output in place must be whole: the earlier one, untouched, or the
        # new one (even a signal during interpreter shutdown, after the swap, can end a finished run)
        if out.exists():
            unchanged = before is not None and tree_digest(out) == before
            if before is not None and not unchanged and "was not changed" in stderr:
                problems.append("said the earlier output was not changed, but it was")
                lost_outputs += 1
            # a caught signal after the swap says so; SIGKILL after it leaves the new output, whole
            interrupted = code == 128 + SIGNALS[sig_name]
            if before is not None and not unchanged and interrupted and "already finished" not in stderr:
                flag = "--card" if kind in IN_PLACE else "--force"
                problems.append(f"an interrupted {flag} run changed the earlier output")
                lost_outputs += 1
            if not unchanged:
                ok, what = whole(out, output)
                if ok and output == "model":
                    ok, what = verify(out, args.verify == "full")
                verified += ok
                if not ok:
                    problems.append(f"output in place but verify fails: {what[:200]}")
            if before is None and "was not created" in stderr:
                problems.append("said the output was not created, but it exists")
        if before is not None and not out.exists():
            problems.append("the earlier output is gone")
            lost_outputs += 1
        status = "ok" if not problems else "FAIL: " + "; ".join(problems) + f"\n    stderr: {stderr.strip()}"
        when = f"{sig_name} after {delay:5.2f} s{' (start-up)' if startup else ''}"
        what = f"{kind}{' --force' if force else ''}"
        print(f"run {run + 1:3d}: {what} {when} -> exit {code} ({outcome}) {status}", flush=True)
        failures += [f"run {run + 1}: {p}" for p in problems]

    # a last undisturbed run to each output sweeps what SIGKILLed runs left, and says so
    rest: set[str] = set()
    for kind in ("copy", "study"):
        out = outs[OUTPUTS.get(kind, "model")]
        final = subprocess.run(command(kind, sources, out, out.exists()), capture_output=True, text=True)
        for name in re.findall(REMOVED, final.stderr):
            reported.add(name)
            stale.discard(name)
        if final.returncode != 0:
            failures.append(f"final {kind} run: exit {final.returncode}: {final.stderr.strip()[-200:]}")
        rest |= {p.name for p in out_parent.iterdir() if p.name.startswith(f".{out.name}.otdus-")}
    if rest or stale:
        failures.append(f"unreported leftovers: {sorted(rest | stale)}")
    lost = sum(sizes[k] for k, p in sources.items() if tree_digest(p) != digests[k])
    print()
    print(f"runs: {args.runs} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})")
    print(f"commands: {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}; signalled in start-up "
          f"(first {STARTUP_S:.0f} s): {startup_runs}")  # fmt: skip
    print(f"exit codes: {', '.join(f'{k}: {v}' for k, v in sorted(codes.items()))} "
          f"(killed in interpreter start-up, before otdus code: {before_python})")  # fmt: skip
    print(f"lost source bytes: {lost}")
    print(f"lost earlier outputs: {lost_outputs}")
    print(f"temporary folders of SIGKILLed runs: {len(reported)}, all removed and reported: {not stale}")
    print(f"unreported leftovers: {len(rest | stale)}")
    print(f"outputs in place verified ({args.verify}): {verified}, failed: "
          f"{sum('verify fails' in f for f in failures)}")  # fmt: skip
    print(f"failures: {len(failures)}")
    for f in failures:
        print("  " + f)
    if not args.keep:
        shutil.rmtree(out_parent, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
