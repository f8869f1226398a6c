"""Coordination of the processes of one run: rank, world size, device per rank, exchanges, failures.

A run started by ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) or by ``srun`` (a job step's
``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS``/``SLURM_LOCALID``, with ``MASTER_ADDR``/``MASTER_PORT`` set
by the job script) is one process of a world; any other run is a world of one, which goes through
the same code with no process group, no launcher and no network.

Only small results cross ranks (log-probabilities, flags, error lines), so the exchanges run over
gloo (CPU, TCP) whatever device a rank computes on: no NCCL is needed and a rank's GPU memory holds
model weights only. Every exchange is bounded by ``OTDUS_DIST_TIMEOUT`` seconds (default 3600): a rank
that died or hangs makes the others fail with one line instead of waiting forever.

Failures: work that can fail on one rank runs inside :meth:`World.exchange`, which always reaches the
exchange, so a failing rank's error line reaches every rank and every rank raises the same
:class:`OtdusError` (the first failing rank's message, naming it).
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from otdus_cli.errors import OtdusError

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 3600.0


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if not value.lstrip("-").isdigit():
        raise OtdusError(f"{name}={value!r} is not an integer")
    return int(value)


def _timeout_s() -> float:
    value = os.environ.get("OTDUS_DIST_TIMEOUT", "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise OtdusError(f"OTDUS_DIST_TIMEOUT={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise OtdusError(f"OTDUS_DIST_TIMEOUT must be positive, got {value}")
    return seconds


@dataclass(frozen=True)
class Launch:
    """Where this process stands, as its launcher's environment says (a world of one without one)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "none"  # "torchrun", "srun" or "none"


def launch_from_env(env: Mapping[str, str] | None = None) -> Launch:
    """torchrun's variables first, then a Slurm job step's; a batch script's own shell (SLURM_NTASKS
    but no step) is not a world: its ``otdus`` is a single process."""
    env = os.environ if env is None else env
    size = _env_int(env, "WORLD_SIZE")
    if size is not None:
        launch = Launch(_env_int(env, "RANK") or 0, size, _env_int(env, "LOCAL_RANK") or 0, "torchrun")
    elif _env_int(env, "SLURM_STEP_NUM_TASKS") is not None and _env_int(env, "SLURM_PROCID") is not None:
        size = _env_int(env, "SLURM_STEP_NUM_TASKS") or 1
        rank, local = _env_int(env, "SLURM_PROCID") or 0, _env_int(env, "SLURM_LOCALID") or 0
        launch = Launch(rank, size, local, "srun")
    else:
        return Launch()
    if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size or launch.local_rank < 0:
        raise OtdusError(
            f"{launch.launcher}: rank {launch.rank} of world size {launch.world_size} "
            f"(local rank {launch.local_rank}) is not a valid place in a world"
        )
    return launch


@dataclass
class World:
    """The processes of this run. A world of one exchanges nothing and needs no process group."""

    launch: Launch = field(default_factory=Launch)
    timeout_s: float = DEFAULT_TIMEOUT_S
    _group: Any = None  # the gloo process group (None in a world of one)

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def size(self) -> int:
        return self.launch.world_size

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- exchanges ----------------------------------------------------------------------------------
    def _all_gather(self, obj: object) -> list:
        if self._group is None:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self._group)
        except Exception as exc:  # a rank died, hung past the timeout, or closed its connection
            raise OtdusError(
                f"rank {self.rank}: lost the other ranks ({' '.join(str(exc).split())[:300]}; "
                f"timeout {self.timeout_s:g} s, OTDUS_DIST_TIMEOUT)"
            ) from None
        return out

    def exchange(self, work: Callable[[], T]) -> list[T]:
        """Run ``work`` here, then exchange: every rank's result, in rank order, on every rank; or, when
        any rank failed, the first failing rank's error raised on every rank. In a world of one the
        work's own exception propagates unchanged."""
        if self.size == 1:
            return [work()]
        try:
            outcome: tuple[str, object] = ("ok", work())
        except OtdusError as exc:
            outcome = ("error", (f"rank {self.rank}: {exc}", exc.exit_code))
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            outcome = ("error", (f"rank {self.rank}: unexpected {exc.__class__.__name__}: {exc}", 3))
        outcomes = self._all_gather(outcome)
        failed = next((payload for kind, payload in outcomes if kind == "error"), None)
        if failed is not None:
            message, code = failed
            error = OtdusError(message)
            error.exit_code = code
            raise error
        return [payload for _, payload in outcomes]

    def barrier(self) -> None:
        """Wait for every rank (bounded by the timeout, like every exchange)."""
        self._all_gather(None)

    def all_true(self, flag: bool) -> bool:
        return all(self._all_gather(bool(flag)))

    def sum_float64(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums across ranks, in float64, added in rank order (the same order every run)."""
        parts = self._all_gather([float(v) for v in values])
        total = [0.0] * len(values)
        for part in parts:
            total = [a + b for a, b in zip(total, part, strict=True)]
        return total

    def close(self) -> None:
        if self._group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._group = None


def shard(weights: Sequence[float], world: World) -> range:
    """This rank's contiguous block of items (items in order, ``weights`` their costs): cut where the
    running cost crosses each rank's share, so every rank gets about the same work."""
    n, size = len(weights), world.size
    if size == 1:
        return range(n)
    total = float(sum(weights)) or float(n) or 1.0
    bounds = [0]
    running, item = 0.0, 0
    for r in range(1, size):
        while item < n and running + weights[item] / 2 < total * r / size:
            running += weights[item]
            item += 1
        bounds.append(item)
    bounds.append(n)
    return range(bounds[world.rank], bounds[world.rank + 1])


_WORLD: World | None = None


def joined_world() -> World | None:
    """The world this process joined, if it has (never joins one, unlike current_world)."""
    return _WORLD


def end_rank(code: int = 0) -> None:
    """Under torchrun/srun, end this rank now with exit status ``code``: the group is closed and the
    process exits here. gloo's threads, left to C++ static destructors at interpreter exit, abort
    some runs ('terminate called without an active exception', SIGABRT) even after the group was
    destroyed. Call it last, once the rank's results are written and said; in one process it does
    nothing (the interpreter ends as usual)."""
    world = _WORLD
    if world is None or world.size == 1:
        return
    world.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def current_world() -> World:
    """This process's world, joined on first use (a world of one when no launcher started it)."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    launch = launch_from_env()
    timeout = _timeout_s()
    world = World(launch, timeout)
    if launch.world_size > 1:
        import torch.distributed as dist

        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
        if missing:
            raise OtdusError(
                f"{launch.launcher} started {launch.world_size} processes but {' and '.join(missing)} "
                "is not set (see docs/cluster.md)"
            )
        try:
            if not dist.is_initialized():
                dist.init_process_group(
                    "gloo",
                    init_method="env://",
                    rank=launch.rank,
                    world_size=launch.world_size,
                    timeout=timedelta(seconds=timeout),
                )
            world._group = dist.group.WORLD
            # gloo's worker threads must be stopped before the interpreter exits: left to static
            # destructors they end some runs with 'terminate called without an active exception'
            # (SIGABRT, seen about one run in five on two ranks)
            atexit.register(world.close)
        except Exception as exc:
            raise OtdusError(
                f"rank {launch.rank}: cannot join the other {launch.world_size - 1} rank(s) at "
                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}: {' '.join(str(exc).split())[:300]}"
            ) from None
    _WORLD = world
    return world
