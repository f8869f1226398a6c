"""Depth and width in one command: `otdus expand ... --experts M` (expand, then widen its output).

The deeper model is written to a scratch folder beside ``out`` and widened from there into ``out``
(atomic, as each step is); the scratch folder is removed whatever happens, and one a SIGKILL left
is swept by the next run to ``out`` (io/output_dir.py). Both steps protect the original model:
``out`` may not be it, nor hold any of its files. Each step streams with its
own bounded memory; the cost of doing it in one command is the deeper model's size on disk for the
duration (the same as running `otdus expand` then `otdus widen`, minus the folder left behind).

The manifest is widen's, seen from the original model (manifest.seen_from_first_source): its
``source`` is the model expand read, its layer map maps onto that model's layers (new layers, and
base layers widened), and ``history`` keeps the expansion's own record. So `otdus verify out`
checks against the original model by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from otdus_cli.expand import ExpandResult, expand
from otdus_cli.io.output_dir import check_target, scratch_folder
from otdus_cli.options import ExpandOptions
from otdus_cli.signals import output_in_place
from otdus_cli.source import open_source
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
    on_stage: Callable[[str], None] | None = None,
) -> GrowResult:
    """Expand ``model``, then widen the result into ``out`` atomically. ``on_step(name)`` (name
    "expand" or "widen") returns the byte-progress callback of that step; ``on_stage`` hears what
    each step is doing (progress lines in a log)."""
    out = Path(out)
    # before the expansion: what widen would refuse must not cost a whole depth step
    source = open_source(model, options.revision, options.allow_unknown_arch)
    check_widenable(source)
    first = source.resolved.folder
    check_target(out, [first], force)
    with scratch_folder(out) as scratch:
        deeper = scratch / "deeper"
        step = on_step or (lambda name: None)
        expanded = expand(model, deeper, options, progress=step("expand"), on_note=on_note, on_stage=on_stage)
        output_in_place(None)  # the scratch model is no output: a signal now is an interrupted run
        widened = widen(
            str(deeper),
            out,
            widen_options,
            force=force,
            progress=step("widen"),
            on_note=on_note,
            from_first_source=True,
            protected=(first,),
            on_stage=on_stage,
        )
    return GrowResult(expanded, widened)
