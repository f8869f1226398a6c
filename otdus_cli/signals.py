"""The CLI's signal handling: SIGINT, SIGTERM and SIGHUP end a run like Ctrl-C, at a safe point.

A Python signal handler that raises runs between two bytecodes of whatever the main thread is doing.
In the middle of an import that is fatal: torch, numpy and scipy run Python code while their C
extensions are half initialised, and an exception there leaves a broken module behind (a
RecursionError or AttributeError later, pybind11's ``terminate``, a segfault at exit). So while the
main thread imports, the handler only records the signal; the outermost import raises it as soon as
it returns. A signal during a 3-second import of torch thus ends the run when that import ends.
"""

from __future__ import annotations

import builtins
import importlib
import signal
import sys
import threading
from types import ModuleType
from typing import Any

from otdus_cli.errors import Interrupted

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_MAIN = threading.main_thread().ident
_depth = 0  # nesting of the main thread's imports in progress
_pending: list[int] = []  # the signal that arrived during them
_done: list[str] = []  # what a signal after an output's swap must say (the output is whole and in place)
_original_import = builtins.__import__
_original_import_module = importlib.import_module


def raise_interrupted(signum: int, frame: object) -> None:
    """Signal handler: turn the signal into an exception, so clean-up runs as for Ctrl-C; during an
    import, only note it (the import raises it when it returns)."""
    if _depth > 0:
        if not _pending:
            _pending.append(signum)
        return
    raise Interrupted(signum, _done[-1] if _done else "")


def output_in_place(detail: str | None) -> None:
    """From now on a signal reports ``detail`` (the output is complete and in place; None: no longer)."""
    _done.clear()
    if detail is not None:
        _done.append(detail)


def _enter() -> bool:
    global _depth
    if threading.get_ident() != _MAIN:
        return False
    _depth += 1
    return True


def _leave() -> None:
    global _depth
    _depth -= 1
    if _depth == 0 and _pending:
        raise Interrupted(_pending.pop())


def _guarded_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0):
    if level == 0 and not fromlist and name in sys.modules and _depth == 0:
        return _original_import(name, globals, locals, fromlist, level)  # nothing to load: no guard
    if not _enter():
        return _original_import(name, globals, locals, fromlist, level)
    try:
        return _original_import(name, globals, locals, fromlist, level)
    finally:
        _leave()


def _guarded_import_module(name: str, package: str | None = None) -> ModuleType:
    if not _enter():
        return _original_import_module(name, package)
    try:
        return _original_import_module(name, package)
    finally:
        _leave()


def exit_on_signals() -> None:
    """Install raise_interrupted for SIGINT, SIGTERM and SIGHUP, and hold signals back during imports
    (main thread only; the CLI calls it first thing).

    A signal the process was started with ignored stays ignored: `nohup otdus expand ... &` must
    survive the log-out's SIGHUP, and a shell's background job its terminal's Ctrl-C.
    """
    builtins.__import__ = _guarded_import
    importlib.import_module = _guarded_import_module
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, raise_interrupted)
