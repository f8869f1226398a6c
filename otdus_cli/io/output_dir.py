"""The life cycle of an output folder: claim, temporary folder, swap into place, clean-up.

otdus never deletes or overwrites what it did not create:

* **claim**: ``--out`` is checked before anything is written. It may not be (or contain, or lie
  inside) the source model, the working directory or one of its parents, a mount point or a
  symbolic link; nor may it hold any of the source's files, judged by what they are (real location,
  device and inode), not by their names: a shard that is a link into ``--out`` protects it. If it
  exists, it is replaced only with ``force`` and only when it is an empty folder or an earlier otdus
  output of the same kind (a model, a study's results: the manifest's ``output``) that nobody
  changed since: its ``otdus.json`` manifest lists every file it holds with the size and hash otdus
  wrote (io/file_hashes.py). A lock file beside ``--out`` (``.NAME.otdus-lock``,
  an advisory ``flock`` the kernel releases when its owner dies) makes concurrent runs to one
  ``--out`` exclusive: the second one is refused. The lock file is created exclusively and never
  through a link; a file at its name that is not a stale otdus lock is refused, never touched.
* **temporary folder**: ``.NAME.otdus-tmp-PID@HOST.XXXX`` beside ``--out``: its owner is in its
  name, set atomically with its creation, so the folder of a run killed with SIGKILL is recognised
  and removed by the next run to the same ``--out`` (a folder of a live run, or of another host, is
  reported, never touched). The scratch folder of ``expand --experts`` (``.NAME.otdus-deeper-...``)
  is named and swept alike.
* **swap**: an atomic rename that fails if something appeared at ``--out`` meanwhile
  (``renameat2(RENAME_NOREPLACE)``), or, with ``--force``, an atomic exchange with the earlier output
  (``RENAME_EXCHANGE``), whose files are then removed one by one (a file that cannot be removed is
  left in the temporary folder, and a note says where: the new output is in place). Signals are
  held back during the swap and the clean-ups, so an interrupt never leaves a half-swapped or
  half-removed state.
* **clean-up**: any failure or interrupt removes the temporary folder; an ``Interrupted`` exception
  then says exactly what is where.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from otdus_cli.errors import Interrupted, OtdusError
from otdus_cli.io.file_hashes import edited_line, file_changes, manifest_check, plain_name, valid_records
from otdus_cli.io.output_lock import OutputLock
from otdus_cli.signals import output_in_place

MANIFEST = "otdus.json"  # also otdus_cli.manifest.MANIFEST (not imported: that module reads JSON)
TMP_TAG = "otdus-tmp-"
OLD_TAG = "otdus-old-"
DEEPER_TAG = "otdus-deeper-"
# What an output holds, as its manifest's "output" says; a manifest without the key is a model's.
MODEL = "model"
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


def read_output_manifest(folder: Path) -> dict | None:
    """The JSON of ``folder``'s otdus manifest (never through a link), or None if it is not one."""
    try:
        fd = os.open(folder / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    return manifest if isinstance(manifest, dict) and "otdus_version" in manifest else None


def output_kind(manifest: dict) -> str:
    """What an otdus output holds, by its manifest: "model" or another kind ("study")."""
    kind = manifest.get("output", MODEL)
    return kind if isinstance(kind, str) else repr(kind)


def earlier_output_files(out: Path, kind: str = MODEL) -> set[str]:
    """The entries of the earlier otdus output ``out`` that --force will delete: all of them, when
    it is an output of ``kind``, every file its manifest lists is still what otdus wrote and it
    holds nothing else; otherwise one error saying what is not."""
    entries = sorted(os.listdir(out))
    manifest = read_output_manifest(out)
    if manifest is None:
        raise OtdusError(
            f"--out {out} exists and is not an otdus output (no otdus.json manifest; it holds "
            f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, e.g. {entries[0]}); --force replaces "
            "only an earlier otdus output or "
            "an empty folder: choose another --out or move the folder yourself"
        )
    if output_kind(manifest) != kind:
        raise OtdusError(
            f"--out {out} is an otdus {output_kind(manifest)} output, not a {kind} one; --force replaces "
            f"only an earlier {kind} output: choose another --out"
        )
    records = manifest.get("files")
    if records is None:
        # written before otdus recorded hashes: whether its files changed cannot be told, so no
        raise OtdusError(
            f"--out {out} was written by an earlier otdus version whose otdus.json records no hashes of "
            "its files, so otdus cannot tell whether they changed since (a model saved into it?); --force "
            "replaces only outputs it can check: choose another --out, or move or delete the folder yourself"
        )
    check = manifest_check(manifest)
    if check != "unchanged":
        what = (
            edited_line(out)
            if check == "edited"
            else f"the otdus.json of {out} records no hash of itself (an earlier otdus version)"
        )
        raise OtdusError(
            f"--out {out}: {what}, so otdus cannot tell whether it still lists what it wrote there; "
            "--force replaces only an unchanged otdus output: choose another --out, or move or delete "
            "the folder yourself"
        )
    copied = manifest.get("copied_files", [])
    if not valid_records(records) or not (isinstance(copied, list) and all(map(plain_name, copied))):
        raise OtdusError(
            f"--out {out}: the file list of its otdus.json is damaged, so otdus cannot tell what it wrote "
            "there; choose another --out, or move or delete the folder yourself"
        )
    foreign = [e for e in entries if e != MANIFEST and e not in records]
    if foreign:
        raise OtdusError(
            f"--out {out} is an otdus output but also holds {foreign[0]}, which otdus did not write; "
            "--force never deletes such files: move them out first or choose another --out"
        )
    changed = file_changes(out, records)
    if changed:
        raise OtdusError(
            f"--out {out} is an otdus output, but {len(changed)} of its files changed since otdus wrote "
            f"them: {', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}; --force replaces only "
            "an unchanged otdus output: choose another --out, or move or delete the folder yourself"
        )
    return set(entries)


def _replaceable(out: Path, kind: str) -> tuple[str, set[str]]:
    """('empty' or 'otdus', the entries --force deletes) when ``force`` may replace ``out``;
    otherwise one error naming what is there."""
    if not os.listdir(out):
        return "empty", set()
    return "otdus", earlier_output_files(out, kind)


def source_identities(folders: list[Path]) -> dict[tuple[int, int], Path]:
    """(st_dev, st_ino) -> real location of every entry of the source folders (shards, index,
    config, side files): what the source is, wherever its names point."""
    found: dict[tuple[int, int], Path] = {}
    for folder in folders:
        try:
            entries = sorted(Path(folder).iterdir())
        except OSError:
            continue
        for entry in entries:
            try:
                st = os.stat(entry)  # through links: the file itself
            except OSError:
                continue
            found[(st.st_dev, st.st_ino)] = Path(os.path.realpath(entry))
    return found


def _check_identities(out: Path, real: Path, protected: list[Path]) -> None:
    """Refuse an ``out`` that contains a source file by its real location or holds one by inode
    (a link, hard or symbolic, between the source and ``out``)."""
    sources = source_identities(protected)
    for path in sources.values():
        if _is_within(path, real):
            raise OtdusError(
                f"--out {out} holds {path}, a file of the source model (a link points there); "
                "the input is never modified: choose another --out"
            )
    if not real.is_dir():
        return
    for name in sorted(os.listdir(real)):
        try:
            st = os.lstat(real / name)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in sources:
            raise OtdusError(
                f"--out {out} holds {name}, which is the source model's file "
                f"{sources[(st.st_dev, st.st_ino)]} (a hard link); the input is never modified: "
                "choose another --out"
            )


def _claimable(out: Path, protected: list[Path], force: bool, kind: str) -> tuple[str, set[str]]:
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
    _check_identities(out, real, protected)
    if not absolute.parent.is_dir():
        raise OtdusError(f"parent folder of --out does not exist: {absolute.parent}")
    if not os.path.lexists(out):
        return "absent", set()
    if os.path.ismount(out):
        raise OtdusError(f"--out {out} is a mount point; give a folder inside it")
    if not absolute.is_dir():  # the same line with --force or without: nothing replaces a file
        raise OtdusError(f"--out {out} is an existing file; otdus writes a folder and replaces only its own")
    if not force:
        raise OtdusError(
            f"output folder {out} already exists "
            "(--force replaces an earlier otdus output or an empty folder)"
        )
    return _replaceable(absolute, kind)


def check_target(out: Path, protected: list[Path], force: bool, kind: str = MODEL) -> str:
    """Refuse any --out that could lose data; returns 'absent', 'empty' or 'otdus'.

    ``protected``: the source model's folders; --out may neither be inside one, contain one, nor
    hold any of their files (by real location or inode). ``kind``: what the new output holds; --force
    replaces only an earlier output of that kind."""
    return _claimable(out, protected, force, kind)[0]


# -- owner records and stale folders -----------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


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
    for tag in (TMP_TAG, OLD_TAG, DEEPER_TAG):
        for folder in sorted(out.parent.glob(f".{glob_escape(out.name)}.{tag}*")):
            if folder in _IN_USE:  # this run's own (expand --experts's scratch folder)
                continue
            if folder.is_symlink():  # otdus makes folders there, never links: not ours to remove
                notes.append(f"{folder} is a symbolic link named like an otdus temporary folder; kept")
                continue
            owner = _owner_of(folder, out, tag) if folder.is_dir() else None
            if owner is None:
                notes.append(f"{folder} looks like an otdus temporary folder but names no owner; kept")
                continue
            pid, host = owner
            if host == socket.gethostname() and not _pid_alive(pid):
                notes.append(_remove_dead_runs(folder, pid))
            else:
                notes.append(
                    f"{folder} belongs to otdus pid {pid} on {host}, which may still run; "
                    "remove it yourself once that run is gone"
                )
    return notes


def _remove_dead_runs(folder: Path, pid: int) -> str:
    """Remove the folder a dead run left (never following a link inside it); says what happened."""
    shutil.rmtree(folder, ignore_errors=True)
    if not os.path.lexists(folder):
        return f"removed {folder}, left by an otdus run that died (pid {pid})"
    return f"could not remove all of {folder}, left by an otdus run that died (pid {pid}); delete it yourself"


# Folders this process uses beside an output that a sweep must not take for a dead run's.
_IN_USE: set[Path] = set()


@contextlib.contextmanager
def scratch_folder(out: str | os.PathLike[str]) -> Iterator[Path]:
    """A folder beside ``out`` for an intermediate output (``expand --experts``'s deeper model),
    removed at the end; named after its owner, so after a SIGKILL the next run to ``out`` sweeps it."""
    absolute = Path(os.path.abspath(out))
    with held_signals() as arrived:  # created and registered together
        try:
            folder = Path(tempfile.mkdtemp(prefix=owner_prefix(absolute, DEEPER_TAG), dir=absolute.parent))
        except OSError as exc:
            where = absolute.parent
            raise OtdusError(f"cannot create a scratch folder in {where} ({exc.strerror})") from None
        _IN_USE.add(folder)
    try:
        if arrived() is not None:
            raise Interrupted(arrived(), f"nothing was written; {out} was not changed")
        yield folder
    finally:
        with held_signals():
            shutil.rmtree(folder, ignore_errors=True)
            _IN_USE.discard(folder)


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


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename tmp -> out (a folder or a file), failing if anything exists at out."""
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
    """Delete the listed files of an earlier otdus output and the folder if that empties it; the
    notes say what was left where (the new output is in place by now: nothing here fails the run)."""
    failed: list[str] = []
    for name in sorted(names):
        try:
            (folder / name).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed.append(f"{name}: {exc.strerror}")
    try:
        folder.rmdir()
    except OSError:
        if failed:
            return [
                f"the new output is in place, but {len(failed)} file(s) of the earlier output could not be "
                f"deleted ({failed[0]}); they are left in {folder}: delete it yourself"
            ]
        with contextlib.suppress(OSError):
            left = sorted(os.listdir(folder))
            return [f"kept {folder}: it holds {', '.join(left[:3])}, which otdus did not write"]
        return [f"kept {folder}: it could not be removed"]
    return []


def _swap(tmp: Path, out: Path, expected: str, protected: list[Path], kind: str) -> list[str]:
    """Put the finished ``tmp`` at ``out``; ``expected`` is what the claim found there."""
    if expected == "absent":
        move_into_place(tmp, out)
        return []
    found, old_names = _claimable(out, protected, True, kind)  # still what --force was allowed to replace?
    if found != expected:
        raise OtdusError(f"{out} changed while this run was writing; it was left untouched")
    if _renameat2(tmp, out, _RENAME_EXCHANGE):  # tmp now holds the earlier output
        return remove_otdus_output(tmp, old_names)
    trash = Path(tempfile.mkdtemp(prefix=owner_prefix(out, OLD_TAG), dir=out.parent))
    os.rename(out, trash / "old")
    try:
        move_into_place(tmp, out)
    except BaseException:
        os.rename(trash / "old", out)
        shutil.rmtree(trash, ignore_errors=True)
        raise
    notes = remove_otdus_output(trash / "old", old_names)
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
    out: str | os.PathLike[str],
    *,
    protected: list[Path],
    force: bool,
    report: OutputReport | None = None,
    kind: str = MODEL,
) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it becomes ``out``, on any failure it vanishes.

    ``protected``: folders that --out may neither be inside of nor contain, nor hold any file of
    (the source model). ``kind``: what the output holds (its manifest's ``output``, which the caller
    writes); --force replaces only an earlier output of that kind.
    """
    out = Path(out)
    report = report if report is not None else OutputReport()
    check_target(out, protected, force, kind)  # fail fast, before taking the lock
    output_in_place(None)
    absolute = Path(os.path.abspath(out))
    lock = OutputLock(absolute)
    expected = "absent"
    tmp: Path | None = None
    try:
        # the claim is held together: a signal in the middle would leave a lock file or a folder
        # that no variable names yet
        with held_signals() as arrived:
            lock.acquire()
            expected = check_target(out, protected, force, kind)  # again, now that no other run can race us
            report.add(sweep_stale(absolute))
            tmp = make_temporary(absolute)
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
            report.add(_swap(tmp, absolute, expected, protected, kind))
            report.replaced = expected == "otdus"
            output_in_place(f"the run had already finished: {out} is complete and in place")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            lock.release()
    if arrived() is not None:
        raise Interrupted(arrived(), f"the run had already finished: {out} is complete and in place")


def make_temporary(out: Path) -> Path:
    """The temporary folder beside ``out``, named after its owner for stale-folder sweeps."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=owner_prefix(out, TMP_TAG), dir=out.parent))
    except OSError as exc:
        raise OtdusError(f"cannot create the output folder in {out.parent} ({exc.strerror})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the result should look like any folder
    return tmp
