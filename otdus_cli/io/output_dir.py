"""The life cycle of an output folder: claim, temporary folder, swap into place, clean-up.

otdus never deletes or overwrites what it did not create:

* **claim**: ``--out`` is checked before anything is written. It may not be (or contain, or lie
  inside) the source model, the working directory or one of its parents, a mount point or a
  symbolic link. If it exists, it is replaced only with ``force`` and only when it is an empty folder
  or an earlier otdus output (its ``otdus.json`` manifest lists every file it holds). A lock file
  beside ``--out`` (``.NAME.otdus-lock``, an advisory ``flock`` the kernel releases when its owner
  dies) makes concurrent runs to one ``--out`` exclusive: the second one is refused.
* **temporary folder**: ``.NAME.otdus-tmp-PID@HOST.XXXX`` beside ``--out``: its owner is in its
  name, set atomically with its creation, so the folder of a run killed with SIGKILL is recognised
  and removed by the next run to the same ``--out`` (a folder of a live run, or of another host, is
  reported, never touched).
* **swap**: an atomic rename that fails if something appeared at ``--out`` meanwhile
  (``renameat2(RENAME_NOREPLACE)``), or, with ``--force``, an atomic exchange with the earlier output
  (``RENAME_EXCHANGE``), whose files are then removed one by one. Signals are held back during the
  swap and the clean-ups, so an interrupt never leaves a half-swapped or half-removed state.
* **clean-up**: any failure or interrupt removes the temporary folder; an ``Interrupted`` exception
  then says exactly what is where.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from otdus_cli.errors import Interrupted, OtdusError

MANIFEST = "otdus.json"  # also otdus_cli.manifest.MANIFEST (not imported: that module reads JSON)
TMP_TAG = "otdus-tmp-"
OLD_TAG = "otdus-old-"
LOCK_TAG = "otdus-lock"
# Files an otdus output holds besides those its manifest lists as copied side files.
_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_WRITTEN = {"config.json", "model.safetensors.index.json", MANIFEST}
# The signals held back while the output is swapped into place (SIGINT, timeout/Slurm's SIGTERM, SIGHUP).
HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@dataclass
class OutputReport:
    """What the life cycle did besides writing: stale folders removed or found, for the user.

    ``notify`` sees each note as it happens: a run interrupted later must still have said what it
    removed.
    """

    notes: list[str] = field(default_factory=list)
    replaced: bool = False  # --force replaced an earlier otdus output
    notify: Callable[[str], None] | None = None

    def add(self, notes: list[str]) -> None:
        for note in notes:
            self.notes.append(note)
            if self.notify:
                self.notify(note)


# -- claim ---------------------------------------------------------------------------------------
def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)


def otdus_output_files(folder: Path) -> set[str] | None:
    """The entries of ``folder`` an earlier otdus run wrote, if it is an otdus output; else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(manifest, dict) or "otdus_version" not in manifest:
        return None
    copied = manifest.get("copied_files")
    side = {str(n) for n in copied} if isinstance(copied, list) else set()
    names = {e.name for e in folder.iterdir()}
    return {n for n in names if n in _WRITTEN or n in side or _SHARD.fullmatch(n)}


def _replaceable(out: Path) -> str:
    """'empty' or 'otdus' when ``force`` may replace ``out``; otherwise one error naming what is there."""
    if not out.is_dir():
        raise OtdusError(f"--out {out} is an existing file; otdus writes a folder and replaces only its own")
    entries = sorted(e.name for e in out.iterdir())
    if not entries:
        return "empty"
    ours = otdus_output_files(out)
    if ours is None:
        raise OtdusError(
            f"--out {out} exists and is not an otdus output (no otdus.json manifest; it holds "
            f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, e.g. {entries[0]}); --force replaces "
            "only an earlier otdus output or "
            "an empty folder: choose another --out or move the folder yourself"
        )
    foreign = [e for e in entries if e not in ours or (out / e).is_dir()]
    if foreign:
        raise OtdusError(
            f"--out {out} is an otdus output but also holds {foreign[0]}, which otdus did not write; "
            "--force never deletes such files: move them out first or choose another --out"
        )
    return "otdus"


def check_target(out: Path, protected: list[Path], force: bool) -> str:
    """Refuse any --out that could lose data; returns 'absent', 'empty' or 'otdus'."""
    out = Path(out)
    if out.is_symlink():
        raise OtdusError(f"--out {out} is a symbolic link; give the real folder it should be")
    absolute = Path(os.path.abspath(out))
    real = absolute.resolve()
    cwd = Path.cwd().resolve()
    if _is_within(cwd, real):
        raise OtdusError(f"--out {out} is the working directory or one of its parents; give a new folder")
    for folder in protected:
        folder = Path(folder).resolve()
        if _is_within(real, folder):
            raise OtdusError(f"--out {out} is inside the source model folder; the input is never modified")
        if _is_within(folder, real):
            raise OtdusError(f"--out {out} contains the source model {folder}; the input is never modified")
    if not absolute.parent.is_dir():
        raise OtdusError(f"parent folder of --out does not exist: {absolute.parent}")
    if not os.path.lexists(out):
        return "absent"
    if os.path.ismount(out):
        raise OtdusError(f"--out {out} is a mount point; give a folder inside it")
    if not force:
        raise OtdusError(
            f"output folder {out} already exists "
            "(--force replaces an earlier otdus output or an empty folder)"
        )
    return _replaceable(absolute)


# -- lock and owner records --------------------------------------------------------------------------
def _owner_record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class OutputLock:
    """An exclusive advisory lock on one --out, held from the claim to the end of the run."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out.parent / f".{out.name}.{LOCK_TAG}"
        self.fd: int | None = None

    def acquire(self) -> None:
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise OtdusError(f"cannot create files in {self.path.parent} ({exc.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_record(fd)
                os.close(fd)
                who = f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "another process"
                raise OtdusError(
                    f"another otdus run ({who}) is writing {self.out}; "
                    "wait for it to finish or choose another --out"
                ) from None
            # the holder before us may have unlinked the file after we opened it: lock the live file
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(_owner_record()).encode(), 0)
                self.fd = fd
                return
            os.close(fd)
        raise OtdusError(f"cannot lock {self.path} (it keeps changing)")

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self.fd)  # closing releases the flock
            self.fd = None


def _read_record(fd: int) -> dict | None:
    """The lock holder's record (pid, host, start), if readable."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def owner_prefix(out: Path, tag: str) -> str:
    """Name prefix of this process's temporary folders for ``out``: the owner is part of the name."""
    return f".{out.name}.{tag}{os.getpid()}@{socket.gethostname()}."


def _owner_of(folder: Path, out: Path, tag: str) -> tuple[int, str] | None:
    rest = folder.name[len(f".{out.name}.{tag}") :]
    pid, at, host_and_suffix = rest.partition("@")
    host = host_and_suffix.rpartition(".")[0]
    return (int(pid), host) if at and pid.isdigit() and host else None


def sweep_stale(out: Path) -> list[str]:
    """Remove temporary folders of dead otdus runs to ``out`` (caller holds the lock); report the rest."""
    notes = []
    for tag in (TMP_TAG, OLD_TAG):
        for folder in sorted(out.parent.glob(f".{glob_escape(out.name)}.{tag}*")):
            owner = _owner_of(folder, out, tag) if folder.is_dir() else None
            if owner is None:
                notes.append(f"{folder} looks like an otdus temporary folder but names no owner; kept")
                continue
            pid, host = owner
            if host == socket.gethostname() and not _pid_alive(pid):
                shutil.rmtree(folder, ignore_errors=True)
                notes.append(f"removed {folder}, left by an otdus run that died (pid {pid})")
            else:
                notes.append(
                    f"{folder} belongs to otdus pid {pid} on {host}, which may still run; "
                    "remove it yourself once that run is gone"
                )
    return notes


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


# -- swap ----------------------------------------------------------------------------------------
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux renameat2; False when the kernel, libc or filesystem does not support the flag."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename tmp -> out, failing if anything exists at out."""
    try:
        if _renameat2(tmp, out, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        raise _appeared(out) from None
    if os.path.lexists(out):  # no renameat2: a check, then rename (os.rename would replace an empty folder)
        raise _appeared(out)
    os.rename(tmp, out)


def _appeared(out: Path) -> OtdusError:
    return OtdusError(
        f"{out} appeared while this run was writing (another job?); it was left untouched and this "
        "run's output was removed"
    )


def remove_otdus_output(folder: Path, names: set[str]) -> list[str]:
    """Delete the listed files of an earlier otdus output and the folder if that empties it."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    try:
        folder.rmdir()
    except OSError:
        left = sorted(e.name for e in folder.iterdir())
        return [f"kept {folder}: it holds {', '.join(left[:3])}, which otdus did not write"]
    return []


def _swap(tmp: Path, out: Path, expected: str, parent: Path) -> list[str]:
    """Put the finished ``tmp`` at ``out``; ``expected`` is what the claim found there."""
    if expected == "absent":
        _move_into_place(tmp, out)
        return []
    if check_target(out, [], True) != expected:  # still what --force was allowed to replace?
        raise OtdusError(f"{out} changed while this run was writing; it was left untouched")
    old_names = otdus_output_files(out) if expected == "otdus" else set()
    if _renameat2(tmp, out, _RENAME_EXCHANGE):  # tmp now holds the earlier output
        return remove_otdus_output(tmp, old_names or set())
    trash = Path(tempfile.mkdtemp(prefix=owner_prefix(out, OLD_TAG), dir=parent))
    os.rename(out, trash / "old")
    try:
        _move_into_place(tmp, out)
    except BaseException:
        os.rename(trash / "old", out)
        shutil.rmtree(trash, ignore_errors=True)
        raise
    notes = remove_otdus_output(trash / "old", old_names or set())
    if not notes:
        shutil.rmtree(trash, ignore_errors=True)
    return notes


# -- signals ---------------------------------------------------------------------------------------
def _signum(exc: BaseException) -> int:
    return getattr(exc, "signum", signal.SIGINT)


@contextlib.contextmanager
def held_signals() -> Iterator[Callable[[], int | None]]:
    """Hold SIGINT/SIGTERM/SIGHUP back for the block; yields a function that, after the block, tells
    which signal arrived meanwhile (it does not fire later), or None.

    Python runs signal handlers in the main thread only, so swapping in a recording handler holds a
    signal whichever thread the kernel delivers it to (a signal mask would cover one thread only).
    Outside the main thread nothing is held, and nothing needs to be: no handler interrupts us there.
    """
    arrived: list[int] = []

    def record(signum: int, frame: object) -> None:
        arrived.append(signum)

    previous = {}
    try:
        for sig in HELD_SIGNALS:
            if signal.getsignal(sig) != signal.SIG_IGN:  # ignored (nohup, a background job): stays so
                previous[sig] = signal.signal(sig, record)
    except ValueError:  # not the main thread
        pass
    try:
        yield lambda: arrived[0] if arrived else None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- the whole life cycle -----------------------------------------------------------------------------
@contextlib.contextmanager
def staged_output(
    out: str | os.PathLike[str], *, protected: list[Path], force: bool, report: OutputReport | None = None
) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it becomes ``out``, on any failure it vanishes.

    ``protected``: folders that --out may neither be inside of nor contain (the source model).
    """
    out = Path(out)
    report = report if report is not None else OutputReport()
    check_target(out, protected, force)  # fail fast, before taking the lock
    absolute = Path(os.path.abspath(out))
    lock = OutputLock(absolute)
    expected = "absent"
    tmp: Path | None = None
    try:
        # the claim is held together: a signal in the middle would leave a lock file or a folder
        # that no variable names yet
        with held_signals() as arrived:
            lock.acquire()
            expected = check_target(out, protected, force)  # again, now that no other run can race us
            report.add(sweep_stale(absolute))
            tmp = _make_temporary(absolute)
        if arrived() is not None:
            raise Interrupted(arrived())
        yield tmp
    except BaseException as exc:
        with held_signals():  # a second Ctrl-C must not stop the clean-up half way
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            lock.release()
        kept = "was not changed" if expected != "absent" else "was not created"
        if isinstance(exc, KeyboardInterrupt):
            what = "the partial output was removed" if tmp is not None else "nothing was written"
            raise Interrupted(_signum(exc), f"{what}; {out} {kept}") from None
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise OtdusError(f"disk full while writing {out}; nothing was left behind") from None
        raise
    with held_signals() as arrived:
        try:
            report.add(_swap(tmp, absolute, expected, absolute.parent))
            report.replaced = expected == "otdus"
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            lock.release()
    if arrived() is not None:
        raise Interrupted(arrived(), f"the run had already finished: {out} is complete and in place")


def _make_temporary(out: Path) -> Path:
    """The temporary folder beside ``out``, named after its owner for stale-folder sweeps."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=owner_prefix(out, TMP_TAG), dir=out.parent))
    except OSError as exc:
        raise OtdusError(f"cannot create the output folder in {out.parent} ({exc.strerror})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the result should look like any folder
    return tmp
