"""scripts/fault_inject.py's reading of a run the signal ended before otdus code ran: Python's own
start-up reports it (the default action, or SIGINT's KeyboardInterrupt), and the harness counts it
apart, while the same outcome from inside otdus_cli stays a failure. The stderr texts are the ones
real runs printed (SIGINT sent 0-80 ms after starting `otdus --help`)."""

from __future__ import annotations

import signal

import pytest

from scripts import fault_inject

IN_SITE = """Fatal Python error: init_import_site: Failed to import the site module
Python runtime state: initialized
Traceback (most recent call last):
  File "<frozen site>", line 186, in addpackage
  File "<string>", line 1, in <module>
KeyboardInterrupt
"""
IN_STREAMS = """Fatal Python error: init_sys_streams: can't initialize sys standard streams
Python runtime state: core initialized
Traceback (most recent call last):
  File "<frozen importlib._bootstrap>", line 126, in release
KeyboardInterrupt
"""
IN_WRAPPER = """Traceback (most recent call last):
  File "/venv/bin/otdus", line 3, in <module>
    from otdus_cli.entry import main
KeyboardInterrupt
"""
IN_OTDUS = """Traceback (most recent call last):
  File "/venv/bin/otdus", line 3, in <module>
    from otdus_cli.entry import main
  File "/src/otdus_cli/entry.py", line 28, in <module>
    from otdus_cli.signals import STOP_SIGNALS, exit_on_signals
KeyboardInterrupt
"""


@pytest.mark.parametrize(
    ("code", "signum", "stderr"),
    [
        (-signal.SIGTERM, signal.SIGTERM, ""),
        (-signal.SIGHUP, signal.SIGHUP, ""),
        (1, signal.SIGINT, IN_SITE),
        (1, signal.SIGINT, IN_STREAMS),
        (-signal.SIGINT, signal.SIGINT, IN_WRAPPER),
    ],
)
def test_the_interpreters_own_start_up_is_counted_apart(code, signum, stderr):
    assert fault_inject.in_interpreter_startup(code, signum, stderr)


@pytest.mark.parametrize(
    ("code", "signum", "stderr"),
    [
        (-signal.SIGINT, signal.SIGINT, IN_OTDUS),  # a frame of otdus code: otdus's to handle
        (1, signal.SIGINT, "error: something otdus said\n"),
        (1, signal.SIGTERM, IN_SITE),  # SIGTERM raises nothing: its exit is -15
        (-signal.SIGTERM, signal.SIGTERM, "interrupted by SIGTERM\n"),
        (128 + signal.SIGTERM, signal.SIGTERM, ""),
    ],
)
def test_anything_else_is_judged_as_an_otdus_outcome(code, signum, stderr):
    assert not fault_inject.in_interpreter_startup(code, signum, stderr)
