"""Depth and width in one command: `otdus expand ... --experts M` (expand, then widen its output).

The deeper model is written to a scratch folder beside ``out`` and widened from there into ``out``
(atomic, as each step is); the scratch folder is removed whatever happens. Each step streams with its
own bounded memory; the cost of doing it in one command is the deeper model's size on disk for the
duration (the same as running `otdus expand` then `otdus widen`, minus the folder left behind).

The manifest is widen's, seen from the original model (manifest.seen_from_first_source): its
``source`` is the model expand read, its layer map maps onto that model's layers (new layers, and
base layers widened), and ``history`` keeps the expansion's own record. So `otdus verify out`
checks against the original model by default.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from otdus_cli.expand import ExpandResult, expand, open_source
from otdus_cli.io.output_dir import check_target
from otdus_cli.options import ExpandOptions
from otdus_cli.signals import output_in_place
from otdus_cli.widen import WidenOptions, WidenResult, check_widenable, widen


@dataclass
class GrowResult:
    expanded: ExpandResult  # the depth step (its output folder no longer exists)
    widened: WidenResult  # the width step, written to ``out``


def expand_and_widen(
    model: str,
    out: str | Path,
    options: ExpandOptions,
    widen_options: WidenOptions,
    force: bool = False,
    on_step: Callable[[str], Callable[[int], None]] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> GrowResult:
    """Expand ``model``, then widen the result into ``out`` atomically. ``on_step(name)`` (name
    "expand" or "widen") returns the byte-progress callback of that step."""
    out = Path(out)
    # before the expansion: what widen would refuse must not cost a whole depth step
    check_widenable(open_source(model, options.revision, options.allow_unknown_arch))
    check_target(out, [], force)
    parent = Path(os.path.abspath(out)).parent
    scratch = Path(tempfile.mkdtemp(prefix=f".otdus-deeper-{out.name}-", dir=parent))
    try:
        deeper = scratch / "deeper"
        step = on_step or (lambda name: None)
        expanded = expand(model, deeper, options, progress=step("expand"), on_note=on_note)
        output_in_place(None)  # the scratch model is no output: a signal now is an interrupted run
        widened = widen(
            str(deeper),
            out,
            widen_options,
            force=force,
            progress=step("widen"),
            on_note=on_note,
            from_first_source=True,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return GrowResult(expanded, widened)
