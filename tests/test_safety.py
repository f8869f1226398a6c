"""otdus never deletes or overwrites what it did not create (docs/safety.md).

--force replaces only an earlier otdus output or an empty folder; concurrent runs to one --out are
exclusive; a folder that appears during a run is never replaced; signals and SIGKILL leave nothing
that is not reported or swept; the source is never touched.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from otdus_cli.errors import Interrupted, OtdusError
from otdus_cli.expand import expand
from otdus_cli.io import output_dir
from otdus_cli.io.output_dir import TMP_TAG, OutputLock
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import one_error_line
from tests.support.file_checks import OTDUS, leftovers, run_cli, tree_digest

runner = CliRunner()


@pytest.fixture()
def earlier_output(stories, tmp_path) -> Path:
    out = tmp_path / "earlier"
    expand(str(stories), out, ExpandOptions(method="copy", layers=1))
    return out


# -- what --force may replace ------------------------------------------------------------------------
def test_force_never_replaces_an_ancestor_of_the_source(stories, tmp_path):
    before = tree_digest(tmp_path)
    line = one_error_line(run_cli("expand", stories, "--out", tmp_path, "--force", "--method", "copy"))
    assert "contains the source model" in line
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("kind", ["folder", "file", "home-like"])
def test_force_never_replaces_what_otdus_did_not_write(stories, tmp_path, kind):
    target = tmp_path / "precious"
    if kind == "file":
        target.write_text("my thesis")
    else:
        target.mkdir()
        (target / "thesis.tex").write_text("chapter 1")
        if kind == "home-like":
            (target / ".bashrc").write_text("export A=1")
            (target / "models").mkdir()
    before = tree_digest(tmp_path)
    line = one_error_line(run_cli("expand", stories, "--out", target, "--force", "--method", "copy"))
    assert "replaces only an earlier otdus output" in line or "existing file" in line
    assert tree_digest(tmp_path) == before
    assert leftovers(tmp_path) == []


def test_force_refuses_an_otdus_output_holding_foreign_files(stories, earlier_output):
    (earlier_output / "notes.md").write_text("results of a week of training")
    before = tree_digest(earlier_output)
    line = one_error_line(run_cli("expand", stories, "--out", earlier_output, "--force", "--method", "copy"))
    assert "notes.md" in line and "otdus did not write" in line
    assert tree_digest(earlier_output) == before


def test_force_replaces_an_earlier_otdus_output_and_an_empty_folder(stories, earlier_output, tmp_path):
    args = ("--force", "--method", "copy", "--layers", "2")
    result = run_cli("expand", stories, "--out", earlier_output, *args)
    assert result.exit_code == 0, result.output
    assert json.loads((earlier_output / "config.json").read_text())["num_hidden_layers"] == 7
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli("expand", stories, "--out", empty, "--force", "--method", "copy").exit_code == 0
    assert (empty / "otdus.json").is_file()
    assert leftovers(tmp_path) == []


def test_without_force_an_existing_otdus_output_is_refused(stories, earlier_output):
    before = tree_digest(earlier_output)
    line = one_error_line(run_cli("expand", stories, "--out", earlier_output, "--method", "copy"))
    assert "already exists" in line and "--force" in line
    assert tree_digest(earlier_output) == before


def test_demo_does_not_replace_a_foreign_folder(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "data.csv").write_text("1,2,3")
    result = run_cli("demo", "--out", target)
    assert result.exit_code == 2, result.output
    assert (target / "data.csv").read_text() == "1,2,3"


@pytest.mark.parametrize("where", [".", "..", "cwd-abs"])
def test_out_of_the_working_directory_or_a_parent_is_refused(stories, tmp_path, monkeypatch, where):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("keep")
    monkeypatch.chdir(work)
    out = str(work) if where == "cwd-abs" else where
    before = tree_digest(tmp_path)
    line = one_error_line(run_cli("expand", stories, "--out", out, "--force", "--method", "copy"))
    assert "working directory" in line
    assert tree_digest(tmp_path) == before and leftovers(work) == [] and leftovers(tmp_path) == []


def test_symlink_and_mount_point_are_refused_up_front(stories, tmp_path):
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "nowhere")
    line = one_error_line(run_cli("expand", stories, "--out", dangling, "--method", "copy"))
    assert "symbolic link" in line
    assert leftovers(tmp_path) == [] and dangling.is_symlink()
    mount = Path("/proc")
    assert os.path.ismount(mount)
    line = one_error_line(run_cli("expand", stories, "--out", mount, "--force", "--method", "copy"))
    assert "mount point" in line
    assert not [p for p in Path("/").iterdir() if "otdus-" in p.name]


def test_unwritable_parent_is_one_line(stories, tmp_path):
    parent = tmp_path / "frozen"
    parent.mkdir()
    if subprocess.run(["chattr", "+i", str(parent)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        line = one_error_line(run_cli("expand", stories, "--out", parent / "out", "--method", "copy"))
        assert "cannot create files in" in line
    finally:
        subprocess.run(["chattr", "-i", str(parent)], check=True)
    assert list(parent.iterdir()) == []


# -- a failed or interrupted forced run keeps the earlier output -------------------------------------
@pytest.mark.parametrize("failure", [OtdusError("builder failed"), KeyboardInterrupt()])
def test_failed_forced_run_keeps_the_earlier_output(stories, earlier_output, monkeypatch, failure):
    import otdus_cli.source as sources

    before = tree_digest(earlier_output)

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(sources, "stack_fingerprints", fail)  # late in the run, before the swap
    with pytest.raises(type(failure)):
        expand(str(stories), earlier_output, ExpandOptions(method="average", layers=2), force=True)
    assert tree_digest(earlier_output) == before
    assert leftovers(earlier_output.parent) == []


def test_signal_during_the_forced_swap_is_held_and_reported_truthfully(stories, earlier_output, monkeypatch):
    real = output_dir.remove_otdus_output

    def interrupted_removal(folder, names):
        os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of the swap
        return real(folder, names)

    monkeypatch.setattr(output_dir, "remove_otdus_output", interrupted_removal)
    # Ctrl-C as in a terminal, even when the test runner was started with SIGINT ignored (a shell's
    # background job), which otdus would rightly leave ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_forced_swap(stories, earlier_output)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_forced_swap(stories: Path, earlier_output: Path) -> None:
    with pytest.raises(Interrupted) as info:
        expand(str(stories), earlier_output, ExpandOptions(method="copy", layers=2), force=True)
    assert "complete and in place" in str(info.value)
    assert info.value.exit_code == 130
    assert json.loads((earlier_output / "config.json").read_text())["num_hidden_layers"] == 7
    assert leftovers(earlier_output.parent) == []


# -- concurrent runs and folders that appear ---------------------------------------------------------
def test_a_folder_appearing_during_the_run_is_never_replaced(stories, tmp_path, monkeypatch):
    import otdus_cli.source as sources

    out = tmp_path / "out"
    real = sources.stack_fingerprints

    def someone_else_writes(source):
        out.mkdir()
        (out / "their.bin").write_text("theirs")
        return real(source)

    monkeypatch.setattr(sources, "stack_fingerprints", someone_else_writes)
    with pytest.raises(OtdusError, match="appeared while this run was writing"):
        expand(str(stories), out, ExpandOptions(method="copy"))
    assert (out / "their.bin").read_text() == "theirs"
    assert sorted(p.name for p in out.iterdir()) == ["their.bin"]
    assert leftovers(tmp_path) == []


def test_an_empty_folder_appearing_during_the_run_is_not_replaced_either(stories, tmp_path, monkeypatch):
    import otdus_cli.source as sources

    out = tmp_path / "out"
    real = sources.stack_fingerprints

    def someone_else_claims(source):
        out.mkdir()  # os.rename would silently replace an empty folder
        return real(source)

    monkeypatch.setattr(sources, "stack_fingerprints", someone_else_claims)
    with pytest.raises(OtdusError, match="appeared"):
        expand(str(stories), out, ExpandOptions(method="copy"))
    assert out.is_dir() and list(out.iterdir()) == []


_HOLD_LOCK = """
import sys, time
from pathlib import Path
from otdus_cli.io.output_dir import OutputLock
OutputLock(Path(sys.argv[1]).absolute()).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_concurrent_runs_to_one_out_one_wins(stories, tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True
    )  # another otdus process in the middle of its run
    try:
        assert holder.stdout.readline().strip() == "locked"
        line = one_error_line(run_cli("expand", stories, "--out", out, "--method", "copy"))
        assert f"pid {holder.pid}" in line and "writing" in line
        assert not out.exists()
    finally:
        holder.kill()  # SIGKILL: the kernel releases the lock
        holder.wait()
    assert run_cli("expand", stories, "--out", out, "--method", "copy").exit_code == 0
    assert leftovers(tmp_path) == []


def test_two_real_runs_to_one_out(stories, tmp_path):
    out = tmp_path / "out"
    cmd = [OTDUS, "expand", str(stories), "--out", str(out), "--method", "ot", "--json"]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [subprocess.Popen(cmd, **pipes) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    codes = sorted(r[0] for r in results)
    assert codes in ([0, 0], [0, 2]), results
    if codes == [0, 2]:  # they overlapped: the loser says why, the winner's output is whole
        loser = next(r for r in results if r[0] == 2)
        assert "another otdus run" in loser[2] or "already exists" in loser[2], loser
    assert json.loads((out / "otdus.json").read_text())["num_hidden_layers"] == 7
    assert leftovers(tmp_path) == []


# -- signals ---------------------------------------------------------------------------------------
def _signals_as(ignored: tuple[int, ...] = ()) -> Callable[[], None]:
    """A preexec_fn: the child starts with default signal dispositions, but for ``ignored``.

    Without it the child would inherit the test runner's (a shell's background job ignores SIGINT).
    """

    def preexec() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)

    return preexec


def _start_expand(stories: Path, out: Path, ignored: tuple[int, ...] = ()) -> subprocess.Popen:
    """A real `otdus expand` process (average: it builds a layer, so it runs for a few seconds)."""
    cmd = [OTDUS, "expand", str(stories), "--out", str(out), "--method", "average"]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.Popen(cmd, preexec_fn=_signals_as(ignored), **pipes)


def _wait_for_tmp(parent: Path, proc: subprocess.Popen, timeout: float = 60) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in parent.iterdir() if "otdus-tmp-" in p.name]
        if found:
            return found[0]
        if proc.poll() is not None:
            raise AssertionError(f"run ended before writing: {proc.stderr.read()}")
        time.sleep(0.005)
    raise AssertionError("no temporary folder appeared")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signals_leave_nothing_and_say_so(stories, tmp_path, sig):
    before = tree_digest(stories)
    out = tmp_path / "out"
    proc = _start_expand(stories, out)
    _wait_for_tmp(tmp_path, proc)
    proc.send_signal(sig)
    code = proc.wait(timeout=60)
    stderr = proc.stderr.read()
    assert code == 128 + sig, stderr
    assert f"interrupted by {signal.Signals(sig).name}" in stderr
    assert "partial output was removed" in stderr or "nothing was written" in stderr, stderr
    assert "Traceback" not in stderr
    assert not out.exists() and leftovers(tmp_path) == []
    assert tree_digest(stories) == before


def test_a_signal_as_the_temporary_folder_is_taken_in_charge_removes_it(stories, tmp_path, monkeypatch):
    """A signal between the staged folder's creation and the pipeline taking charge of it (the few
    bytecodes in which ExitStack.enter_context registers its exit) escaped the clean-up: the run ended
    saying only "interrupted by SIGTERM", its folder left to the garbage collector. The signal is sent
    at that exact point here."""
    import contextlib

    from otdus_cli.signals import raise_interrupted

    register = contextlib.ExitStack._push_cm_exit

    def signal_on_registering(stack, cm, exit_method):
        if getattr(getattr(cm, "gen", None), "__name__", "") == "staged_output":
            os.kill(os.getpid(), signal.SIGTERM)
        return register(stack, cm, exit_method)

    monkeypatch.setattr(contextlib.ExitStack, "_push_cm_exit", signal_on_registering)
    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        with pytest.raises(Interrupted) as caught:
            expand(str(stories), tmp_path / "out", ExpandOptions(method="copy", layers=1))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "the partial output was removed" in str(caught.value), str(caught.value)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_signals_ignored_at_start_stay_ignored(stories, tmp_path):
    """`nohup otdus expand ... &`: the log-out's SIGHUP (and the terminal's Ctrl-C, which a shell's
    background job ignores) must not stop the run; it finishes with a whole output."""
    out = tmp_path / "out"
    proc = _start_expand(stories, out, ignored=(signal.SIGHUP, signal.SIGINT))
    _wait_for_tmp(tmp_path, proc)
    proc.send_signal(signal.SIGHUP)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=120)
    stderr = proc.stderr.read()
    assert code == 0, stderr
    assert json.loads((out / "otdus.json").read_text())["num_hidden_layers"] == 7
    assert leftovers(tmp_path) == []


def test_after_sigkill_the_next_run_sweeps_the_dead_runs_folder(stories, tmp_path):
    out = tmp_path / "out"
    proc = _start_expand(stories, out)
    stale = _wait_for_tmp(tmp_path, proc)
    proc.kill()
    proc.wait()
    assert stale.name.startswith(f".out.{TMP_TAG}{proc.pid}@{socket.gethostname()}.")
    live = (
        tmp_path / f".out.{TMP_TAG}{os.getpid()}@{socket.gethostname()}.abcd"
    )  # a live run's: never touched
    live.mkdir()
    result = run_cli("expand", stories, "--out", out, "--method", "copy")
    assert result.exit_code == 0, result.output
    assert "removed" in result.stderr and stale.name in result.stderr
    assert "may still run" in result.stderr and live.name in result.stderr
    assert not stale.exists() and live.is_dir()


def test_lock_is_released_and_reacquirable(tmp_path):
    out = tmp_path / "x"
    lock = OutputLock(out)
    lock.acquire()
    with pytest.raises(OtdusError, match="another otdus run"):
        OutputLock(out).acquire()
    lock.release()
    second = OutputLock(out)
    second.acquire()
    second.release()
    assert leftovers(tmp_path) == []


def test_a_sweep_is_said_even_when_the_run_is_interrupted_later(stories, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is surely gone
    stale = tmp_path / f".out.{TMP_TAG}{dead.pid}@{socket.gethostname()}.zzzz"
    stale.mkdir()
    proc = _start_expand(stories, tmp_path / "out")
    deadline = time.monotonic() + 60
    while stale.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    stderr = proc.stderr.read()
    assert f"removed {stale}, left by an otdus run that died (pid {dead.pid})" in stderr, stderr
    assert leftovers(tmp_path) == []
