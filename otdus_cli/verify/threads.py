"""How many intra-op threads torch may use for an evaluation: never more than the CPUs are free for.

torch's default intra-op pool has one thread per CPU the machine reports. That oversubscribes as soon
as the process may use fewer (CPU affinity, a container's CPU quota) or other processes keep some CPUs
busy: every parallel operator ends at a barrier, and a thread that shares its CPU with another process
holds all the others up for a time slice (one small linear of stories260K took 15.6 ms with 2 threads on
a 2-CPU machine with one CPU busy, 0.26 ms with 1). Small work gains nothing from a second thread
either: the synchronisation costs more than the arithmetic.

The choice, in order: ``--threads`` when given, else ``OMP_NUM_THREADS`` when set (both taken as they
are: the user's word); else one thread for small work (see ``SMALL_WORK_FLOP``); else the CPUs this
process may use (affinity, cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``; at most torch's own
setting, one thread per physical core unless the caller lowered it) less those other processes kept
busy while the run was being prepared (``/proc/stat`` over this process's CPUs, less this process's own
CPU time).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

# Below this many floating-point operations per decoder-layer call, one thread: the call lasts well under
# a millisecond, about what waking a second thread and meeting it at a barrier costs.
SMALL_WORK_FLOP = 100e6
# A CPU counts as free when at least this much of it was idle while the run was being prepared.
FREE_CPU_SHARE = 0.7
# When nothing was sampled yet, sample the CPUs for this long (seconds) before choosing.
DEFAULT_SAMPLE_S = 0.25


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count of a run and why (reported in --json as ``threads``)."""

    threads: int
    usable_cpus: int  # CPUs this process may use: affinity, bounded by a cgroup quota
    busy_elsewhere: float | None  # CPUs' worth kept busy by other processes meanwhile (None: not sampled)
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def _cgroup_quota_cpus(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup quota allows (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``);
    None when there is no quota."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    with contextlib.suppress(OSError, ValueError):
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def usable_cpus() -> tuple[int, str]:
    """How many CPUs this process may keep busy, and what bounds that."""
    cpus = len(_affinity())
    quota = _cgroup_quota_cpus()
    if quota is not None and math.ceil(quota) < cpus:
        return max(1, math.ceil(quota)), f"a cgroup CPU quota of {quota:g} CPUs"
    return max(1, cpus), "CPU affinity" if cpus < (os.cpu_count() or cpus) else "the machine's CPUs"


@dataclass(frozen=True)
class CpuSample:
    """A reading of the CPUs this process may use: their busy time, this process's time, the clock."""

    busy_s: float | None  # None where /proc/stat cannot be read
    own_s: float
    wall_s: float


def sample_cpus() -> CpuSample:
    busy = None
    with contextlib.suppress(OSError, ValueError):
        ticks = os.sysconf("SC_CLK_TCK")
        mine = {f"cpu{i}" for i in _affinity()}
        busy = 0.0
        for line in Path("/proc/stat").read_text().splitlines():
            fields = line.split()
            if fields and fields[0] in mine:
                # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
                values = [int(v) for v in fields[1:9]]
                busy += (sum(values) - values[3] - values[4]) / ticks
    t = os.times()
    return CpuSample(busy, t.user + t.system, time.monotonic())


def busy_elsewhere(since: CpuSample | None = None, sample_s: float = DEFAULT_SAMPLE_S) -> float | None:
    """CPUs' worth of time other processes used since ``since`` (sampled for ``sample_s`` seconds when
    not given, or when too little time has passed); None where /proc/stat is not readable."""
    if since is None or time.monotonic() - since.wall_s < sample_s / 2:
        since = sample_cpus()
        time.sleep(sample_s)
    now = sample_cpus()
    if since.busy_s is None or now.busy_s is None:
        return None
    others = (now.busy_s - since.busy_s) - (now.own_s - since.own_s)
    return max(0.0, others / max(1e-9, now.wall_s - since.wall_s))


def choose_threads(
    requested: int | None = None, work_flop: float | None = None, since: CpuSample | None = None
) -> ThreadChoice:
    """The thread count for a run whose decoder-layer calls do ``work_flop`` operations each."""
    import torch  # the CLI reads the CPUs before anything heavy is imported

    cpus, bound = usable_cpus()
    if requested is not None:
        return ThreadChoice(int(requested), cpus, None, "--threads")
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return ThreadChoice(int(env), cpus, None, "OMP_NUM_THREADS")
    # torch's own setting bounds the choice: one thread per physical core by default (a second
    # hyperthread adds nothing to matrix products), or less where the caller lowered it
    limit, set_in_torch = cpus, torch.get_num_threads()
    if set_in_torch < cpus:
        limit, bound = set_in_torch, f"torch set to {set_in_torch} threads"
    if limit == 1:
        return ThreadChoice(1, cpus, None, f"one thread allowed ({bound})")
    if work_flop is not None and work_flop < SMALL_WORK_FLOP:
        return ThreadChoice(1, cpus, None, f"small work ({work_flop / 1e6:.3g} MFLOP per layer call)")
    busy = busy_elsewhere(since)
    if busy is None:
        return ThreadChoice(limit, cpus, None, f"{limit} threads allowed ({bound})")
    free = max(1, min(limit, int(cpus - busy + (1 - FREE_CPU_SHARE))))
    reason = f"{limit} threads allowed ({bound}), {busy:.1f} CPUs kept busy by other processes"
    return ThreadChoice(free, cpus, round(busy, 2), reason)


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's intra-op pool at ``threads`` inside the block, as it was afterwards."""
    import torch  # the CLI reads the CPUs before anything heavy is imported

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        yield
    finally:
        torch.set_num_threads(before)
