"""Writing an output model: the one staged sequence of every otdus command that writes a checkpoint
(expand, widen, expand --experts).

1. **plan** (every rank): what the command will write (an :class:`OutputPlan`); a failure on any
   rank fails every rank before anything exists.
2. **claim** (rank 0): the source's side files are checked readable, the output is claimed and a
   temporary folder made beside it (io/output_dir.py: lock, checks, stale-folder sweep), and the shard
   files are created there, headers included.
3. **write** (every rank): the command writes its rank's tensors into the shard files (all of them
   in a world of one); each rank flushes what it wrote, rank 0 writes the shard index.
4. **finish** (rank 0, once every rank's tensors are on disk): config.json, the side files, the
   config check, the manifest (the typed :class:`~otdus_cli.manifest.Manifest` the command builds),
   the model card, then the manifest with the size and hash of every file (what ``--force`` checks),
   and the atomic swap into place. Any failure or signal before the swap removes the temporary folder.

A command provides only what differs: the plan, how a rank writes its tensors, how the written
config is checked, and the manifest. Ranks share the work as distributed.py's ``World`` says; the
default world is one process.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from otdus_cli.card import write_output_card
from otdus_cli.distributed import World
from otdus_cli.errors import Interrupted
from otdus_cli.io.output_dir import OutputReport, held_signals, staged_output
from otdus_cli.io.writer import PlannedTensor, ShardedWriter, parse_size
from otdus_cli.manifest import Manifest, write_manifest
from otdus_cli.source import copy_side_files, readable_side_files

if TYPE_CHECKING:
    from otdus_cli.source import SourceModel


class OutputPlan(Protocol):
    """What a command plans to write: every tensor of the output, and its config.json."""

    @property
    def source(self) -> SourceModel: ...  # the model read: protected, its side files carried over

    @property
    def config(self) -> dict: ...

    @property
    def tensors(self) -> list[PlannedTensor]: ...


PlanT = TypeVar("PlanT", bound=OutputPlan)
RankT = TypeVar("RankT")  # what a rank's writing reports, for the manifest (expand: transport statistics)


@dataclass(frozen=True)
class RankWrite(Generic[RankT]):
    """What one rank wrote: the names of its tensors (None: all of them), and its report."""

    tensors: set[str] | None
    report: RankT


@dataclass(frozen=True)
class ConfigCheck:
    """How the written config.json was checked."""

    by: str  # "transformers" (it loads the config) or "otdus depth rules"
    skipped: str | None = None  # why transformers could not check it (a warning), or None


@dataclass(frozen=True)
class Finished(Generic[RankT]):
    """What the manifest of an output records besides the plan: known once the tensors are written."""

    reports: list[RankT]  # each rank's RankWrite.report, in rank order
    copied_files: list[str]  # the side files carried over from the source
    config_check: ConfigCheck


@dataclass
class WrittenOutput(Generic[PlanT, RankT]):
    out: Path
    plan: PlanT
    manifest: dict  # as written, with the size and hash of every file
    reports: list[RankT]  # each rank's RankWrite.report, in rank order
    # what the user should know: the manifest's warnings, stale temporary folders removed or found
    warnings: list[str]
    replaced: bool  # --force replaced an earlier (unchanged) otdus output at ``out``
    # seconds: "copy_s" (this rank's tensors), "config_check_s", "manifest_s"; "config_check": how
    timings: dict = field(default_factory=dict)


def write_output(
    out: str | Path,
    plan: Callable[[], PlanT],
    write: Callable[[PlanT, ShardedWriter], RankWrite[RankT]],
    check_config: Callable[[PlanT, Path], ConfigCheck],
    manifest: Callable[[PlanT, Finished[RankT]], Manifest],
    *,
    max_shard_size: str,
    force: bool = False,
    protected: Sequence[Path] = (),
    world: World | None = None,
    on_note: Callable[[str], None] | None = None,
) -> WrittenOutput[PlanT, RankT]:
    """Write the output ``plan()`` describes into ``out`` atomically (module docstring); every rank
    returns the result, and a failure on any rank fails every rank with nothing left behind.

    ``write(plan, writer)`` writes this rank's tensors with ``writer`` (the shard files, open);
    ``check_config(plan, folder)`` checks the config.json written in ``folder``; ``manifest(plan,
    finished)`` builds the manifest. ``protected``: folders besides the source's that ``out`` may
    not touch."""
    world = World() if world is None else world
    out = Path(out)
    report = OutputReport(notify=on_note)
    timings: dict = {}
    planned: list[PlanT] = []
    writers: list[ShardedWriter] = []
    with contextlib.ExitStack() as claimed:

        def claim() -> Path | None:
            """Every rank: the plan. Rank 0: the claim and the temporary folder, held open until
            the swap, and the shard files."""
            the_plan = plan()
            planned.append(the_plan)
            if not world.is_main:
                return None
            source_folder = the_plan.source.resolved.folder
            readable_side_files(source_folder)
            staged = staged_output(out, protected=[source_folder, *protected], force=force, report=report)
            # held: a signal after the folder is made but before the stack has its exit would leave the
            # folder to the garbage collector; raised once the stack's exit can remove it
            with held_signals() as arrived:
                tmp = claimed.enter_context(staged)
            if arrived() is not None:
                raise Interrupted(arrived())
            # rank 0 creates the shard files (headers included) before any other rank opens them
            writers.append(ShardedWriter(tmp, the_plan.tensors, parse_size(max_shard_size)))
            return tmp

        tmp = world.exchange(claim)[0]
        the_plan = planned[0]

        def write_mine() -> RankT:
            """This rank's tensors, flushed to disk."""
            writer = writers[0] if writers else _open_shards(tmp, the_plan, max_shard_size)
            try:
                t = time.perf_counter()
                mine = write(the_plan, writer)
                writer.finish(mine.tensors, index=world.is_main)
                timings["copy_s"] = time.perf_counter() - t
            finally:
                writer.close()
            return mine.report

        reports = world.exchange(write_mine)

        def finish() -> dict | None:
            """Rank 0, once every rank's tensors are on disk: config, side files, manifest, swap."""
            if not world.is_main:
                return None
            source_folder = the_plan.source.resolved.folder
            (tmp / "config.json").write_text(json.dumps(the_plan.config, indent=2) + "\n")
            copied = copy_side_files(source_folder, tmp)
            t = time.perf_counter()
            check = check_config(the_plan, tmp)
            timings["config_check_s"] = time.perf_counter() - t
            timings["config_check"] = check.by
            t = time.perf_counter()
            record = manifest(the_plan, Finished(reports, copied, check))
            timings["manifest_s"] = time.perf_counter() - t  # mostly the source's tensor fingerprints
            record.card = write_output_card(tmp, record.to_json(), source_folder)  # before the manifest
            written = write_manifest(tmp, record)  # with the size and hash of every file written
            claimed.close()  # the swap into place (or, on any failure before, the clean-up)
            return written

        written = world.exchange(finish)[0]
    warnings = list(written["warnings"]) + report.notes
    return WrittenOutput(out, the_plan, written, reports, warnings, report.replaced, timings)


def _open_shards(folder: Path, plan: OutputPlan, max_shard_size: str) -> ShardedWriter:
    """The shard files rank 0 created, opened by another rank."""
    return ShardedWriter(folder, plan.tensors, parse_size(max_shard_size), create=False)
