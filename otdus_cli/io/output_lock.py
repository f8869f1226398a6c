"""The lock beside an output folder (``.NAME.otdus-lock``): one otdus run per ``--out`` at a time.

An advisory ``flock``, which the kernel releases when its holder dies (even by SIGKILL), on a file
that holds its owner's record (pid, host, start). The file is created exclusively
(unnamed with ``O_TMPFILE``, written, then linked to its name, which fails if the name exists; else
``O_CREAT | O_EXCL | O_NOFOLLOW``), so otdus never writes through a link or into a file it did not
make. A file already at that name is taken over only when it is a stale otdus lock: a plain file
with one name (no hard links) holding an otdus record, that no live process holds. Anything else
there (a link, a folder, someone's file) is refused in one line and left untouched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from otdus_cli.errors import OtdusError

LOCK_TAG = "otdus-lock"
_TRIES = 20
_PAUSE_S = 0.01  # between tries, when the file is being created or removed by another run
_UNSUPPORTED = object()


def _owner_record() -> bytes:
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode()


def _read_record(fd: int) -> dict | None:
    """The lock holder's record (pid, host, start), if the file holds one."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    return record if isinstance(record.get("pid"), int) and isinstance(record.get("host"), str) else None


def _write_record(fd: int) -> None:
    data = _owner_record()
    os.ftruncate(fd, 0)
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written:], written)


def _link_by_fd(fd: int, path: Path) -> None:
    """Give the unnamed file ``fd`` the name ``path`` (linkat with AT_SYMLINK_FOLLOW on its /proc
    entry; os.link takes that call, not plain link(), only when given a directory fd)."""
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=folder, follow_symlinks=True)
    finally:
        os.close(folder)


class OutputLock:
    """An exclusive advisory lock on one --out, held from the claim to the end of the run."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out.parent / f".{out.name}.{LOCK_TAG}"
        self.fd: int | None = None

    def acquire(self) -> None:
        for _ in range(_TRIES):
            fd = self._create()
            if fd is None:
                fd = self._take_over()
            if fd is not None:
                self.fd = fd
                return
            time.sleep(_PAUSE_S)
        try:
            st = os.lstat(self.path)
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == 0:
            raise self._foreign("an empty file that no otdus run holds")
        raise OtdusError(f"cannot lock {self.path}: it keeps changing (another otdus run starting?)")

    def _create(self) -> int | None:
        """A new lock file, locked and holding our record; None if something is at its name."""
        fd = self._create_whole()
        return self._create_empty() if fd is _UNSUPPORTED else fd

    def _create_whole(self) -> int | None | object:
        """The lock file made unnamed (O_TMPFILE), locked and written, then given its name (link
        fails if the name exists, and never follows a link there): it is never seen empty, and a
        SIGKILL before the link leaves nothing. _UNSUPPORTED where the filesystem cannot."""
        tmpfile = getattr(os, "O_TMPFILE", None)
        if tmpfile is None:
            return _UNSUPPORTED
        try:
            fd = os.open(self.path.parent, tmpfile | os.O_RDWR | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                return _UNSUPPORTED
            raise OtdusError(f"cannot create files in {self.path.parent} ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # unnamed: nobody else can hold it
            _write_record(fd)  # at 0 free blocks: ENOSPC, and the unnamed file just vanishes
            _link_by_fd(fd, self.path)
        except FileExistsError:
            os.close(fd)
            return None
        except OSError as exc:
            os.close(fd)
            if exc.errno == errno.ENOSPC:
                raise
            return _UNSUPPORTED  # no /proc, or the filesystem refuses the link: the plain way
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _create_empty(self) -> int | None:
        """The plain way: create the file exclusively, lock it, write the record."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except FileExistsError:
            return None
        except OSError as exc:
            raise OtdusError(f"cannot create files in {self.path.parent} ({exc.strerror})") from None
        try:
            # another run may glimpse the new, still empty file; it lets go at once (_take_over)
            for _ in range(_TRIES):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(_PAUSE_S)
                except OSError as exc:
                    raise OtdusError(f"cannot lock {self.path} ({exc.strerror})") from None
            else:
                raise OtdusError(f"cannot lock {self.path}: another process holds the file otdus just made")
            _write_record(fd)  # at 0 free blocks: ENOSPC, and the file is removed below
        except BaseException:
            self._unlink_if(fd)
            os.close(fd)
            raise
        return fd

    def _take_over(self) -> int | None:
        """The existing lock file, when it is a stale otdus lock (now ours); None to try again;
        an error for a live run's lock or anything that is not an otdus lock."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None  # its owner just removed it
        except OSError as exc:
            what = "a symbolic link" if exc.errno == errno.ELOOP else f"not an otdus lock ({exc.strerror})"
            raise self._foreign(what) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._foreign("not a plain file")
            if st.st_nlink != 1:
                raise self._foreign(f"a file with {st.st_nlink} names (hard links)")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_record(fd)
                who = f"pid {holder['pid']} on {holder['host']}" if holder else "another process"
                raise OtdusError(
                    f"another otdus run ({who}) is writing {self.out}; "
                    "wait for it to finish or choose another --out"
                ) from None
            except OSError as exc:
                raise OtdusError(f"cannot lock {self.path} ({exc.strerror})") from None
            if os.fstat(fd).st_size == 0:
                os.close(fd)  # being created by another run (or left empty): let it go, look again
                return None
            if _read_record(fd) is None:
                raise self._foreign("not an otdus lock (it holds something else)")
            if not self._names(fd):
                os.close(fd)  # unlinked or replaced meanwhile: look again
                return None
            _write_record(fd)  # a stale otdus lock: no live process holds it
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return fd

    def _foreign(self, what: str) -> OtdusError:
        return OtdusError(
            f"{self.path}, where otdus keeps its lock for {self.out.name}, is {what}; otdus never "
            "touches it: remove or rename it yourself if it is not needed"
        )

    def _names(self, fd: int) -> bool:
        """Whether the lock's path still names the open file ``fd``."""
        try:
            at_path, ours = os.lstat(self.path), os.fstat(fd)
        except OSError:
            return False
        return (at_path.st_dev, at_path.st_ino) == (ours.st_dev, ours.st_ino)

    def _unlink_if(self, fd: int) -> None:
        if self._names(fd):
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def release(self) -> None:
        if self.fd is not None:
            self._unlink_if(self.fd)
            os.close(self.fd)  # closing releases the flock
            self.fd = None
