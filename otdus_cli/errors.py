"""User-facing errors: one clear line for the user, never a traceback. Exit codes: 2 for bad input
(OtdusError), 4 when memory ran out (OutOfMemory, memory_failure), 128 + the signal's number when
interrupted (Interrupted); README.md's "Exit codes" lists them all."""

from __future__ import annotations

import errno
import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager, suppress


class OtdusError(Exception):
    """A problem with the user's input or environment that the CLI reports in one line (exit 2)."""

    exit_code = 2


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT, SIGTERM or SIGHUP (Ctrl-C, `timeout`, Slurm's time limit).

    A KeyboardInterrupt, so code that cleans up on Ctrl-C cleans up on every signal alike; ``detail``
    says what was left where, ``exit_code`` is the shell convention 128 + signal number.
    """

    def __init__(self, signum: int = signal.SIGINT, detail: str = ""):
        super().__init__(signum, detail)
        self.signum = int(signum)
        self.detail = detail

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    def __str__(self) -> str:
        return f"interrupted by {self.signal_name}" + (f": {self.detail}" if self.detail else "")


class OutOfMemory(OtdusError):
    """Memory could not be allocated (the machine's, a limit's such as ``ulimit -v`` or a cgroup's, or
    a GPU's): exit 4, so that a script can tell "give it more memory" from "fix the command"."""

    exit_code = 4


# what torch (CPU: "DefaultCPUAllocator: can't allocate memory"; CUDA: "CUDA out of memory"), C++
# (std::bad_alloc) and the OS (ENOMEM: "Cannot allocate memory") say when an allocation fails
_NO_MEMORY = re.compile(r"out of memory|can'?t allocate memory|cannot allocate memory|bad_alloc", re.I)
_DOING = "_otdus_doing"  # the attribute doing() stamps on an exception: (what, smaller)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, what it was raised from or while handling, and so on (outermost first)."""
    chain: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in chain):
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return chain


def _is_memory_failure(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    return not isinstance(exc, OtdusError) and bool(_NO_MEMORY.search(str(exc)))


def memory_failure(exc: BaseException) -> BaseException | None:
    """The allocation failure behind ``exc``: itself, or one it was raised from or while handling (a
    library that wraps every error of a step, as the model build does, keeps it there), or None."""
    return next((e for e in reversed(_chain(exc)) if _is_memory_failure(e)), None)


@contextmanager
def doing(what: str, smaller: str | None = None) -> Iterator[None]:
    """Name what the code inside does, for the line that an allocation failure there ends with (the
    innermost name wins); ``smaller``: the option that makes this step need less memory, e.g.
    "fewer --calib-tokens"."""
    try:
        yield
    except BaseException as exc:
        if not hasattr(exc, _DOING):
            with suppress(AttributeError):  # a type that takes no attributes: an outer step names it
                setattr(exc, _DOING, (what, smaller))
        raise


def out_of_memory(exc: BaseException, command: str | None = None) -> OutOfMemory | None:
    """The one-line error for an allocation failure behind ``exc`` (None: there is none): what was
    being done, how much could not be had, and what to do."""
    failure = memory_failure(exc)
    if failure is None:
        return None
    chain = _chain(exc)
    stamped = [getattr(e, _DOING) for e in reversed(chain[: chain.index(failure) + 1]) if hasattr(e, _DOING)]
    what, smaller = stamped[0] if stamped else (None, None)
    place = " ".join(
        filter(None, [f"in otdus {command}" if command else None, f"while {what}" if what else None])
    )
    wanted = _allocation_size(str(failure))
    gpu = "cuda" in str(failure).lower() or type(failure).__name__ == "OutOfMemoryError"
    if gpu:
        remedies = ["Use a GPU with more free memory or --device cpu"]
    else:
        remedies = ["Give it more memory (raise its ulimit or cgroup limit, or use a larger machine)"]
        if os.environ.get("OMP_NUM_THREADS") != "1":
            remedies.append("fewer threads (OMP_NUM_THREADS=1: each thread keeps buffers of its own)")
    return OutOfMemory(
        f"ran out of {'GPU ' if gpu else ''}memory{' ' + place if place else ''}"
        f"{f' (an allocation of {wanted} failed)' if wanted else ''}; nothing was written. "
        f"{', or '.join(filter(None, [*remedies, smaller]))}; docs/performance.md says what each "
        "command holds"
    )


def _allocation_size(message: str) -> str | None:
    """The size a failed allocation asked for, as the message gives it."""
    found = re.search(r"allocate (\d+) bytes", message)  # torch's CPU allocator
    if found:
        n = int(found.group(1))
        return next(
            f"{n / 10**k:.1f} {unit}"
            for k, unit in ((9, "GB"), (6, "MB"), (3, "kB"), (0, "B"))
            if n >= 10**k or k == 0
        )
    found = re.search(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]i?B)", message)  # torch's CUDA allocator
    return found.group(1) if found else None
