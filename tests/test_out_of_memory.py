"""Running out of memory ends in one `error:` line that says so, what was being done and what to do,
exit code 4, and nothing left behind: run for real, under a memory limit, and with allocations no
machine can make."""

from __future__ import annotations

import os

import pytest
import torch

from otdus_cli.errors import OtdusError, OutOfMemory, doing, memory_failure, out_of_memory
from tests.support.cli_checks import no_output_left

# far beyond any machine's memory and address space: the allocation itself fails, at once
IMPOSSIBLE = 1 << 62


def test_torch_s_and_python_s_allocation_failures_are_recognised_and_named_by_the_innermost_step():
    with pytest.raises(RuntimeError) as torch_failure, doing("building a layer"), doing("solving a plan"):
        torch.empty(IMPOSSIBLE, dtype=torch.uint8)
    error = out_of_memory(torch_failure.value, "expand")
    assert isinstance(error, OutOfMemory) and error.exit_code == 4
    assert str(error).startswith("ran out of memory in otdus expand while solving a plan (an allocation of ")
    with pytest.raises(MemoryError) as python_failure, doing("reading", smaller="fewer --calib-tokens"):
        bytearray(IMPOSSIBLE)
    assert "fewer --calib-tokens" in str(out_of_memory(python_failure.value))
    assert out_of_memory(ValueError("a bad value")) is None
    assert out_of_memory(OtdusError("the model is out of memory-mapped files")) is None


def test_a_library_step_that_wraps_its_errors_keeps_the_allocation_failure_behind_them():
    """A step that turns every error into an OtdusError (as building a model does) still ends as
    out of memory: the failure is what it was raised from, or while handling."""
    with pytest.raises(OtdusError) as raised_from:
        try:
            with doing("building the model"):
                bytearray(IMPOSSIBLE)
        except MemoryError as exc:
            raise OtdusError("could not build the model") from exc
    with pytest.raises(OtdusError) as raised_while:
        try:
            with doing("building the model"):
                bytearray(IMPOSSIBLE)
        except MemoryError:
            raise OtdusError("could not build the model") from None  # the context stays
    for wrapped in (raised_from.value, raised_while.value):
        assert isinstance(memory_failure(wrapped), MemoryError)
        assert "in otdus verify while building the model" in str(out_of_memory(wrapped, "verify"))


@pytest.mark.parametrize("command", ["expand", "shrink"])
def test_a_run_over_its_memory_limit_ends_in_one_line_exit_4_and_leaves_nothing(tmp_path, command):
    """OT's transport plan of a 16384-neuron MLP is 16384^2 float32 (1.07 GB), in a checkpoint of
    25 MB: under a 0.6 GB data limit the imports fit and the plan cannot be allocated (before the
    change: `error: unexpected RuntimeError`, exit 3)."""
    from tests.support.memory_limits import run_limited, write_random_checkpoint

    write_random_checkpoint(tmp_path / "src", layers=2, hidden=64, inter=16384)
    picks = ["--layers", "1"] if command == "expand" else ["--method", "ot", "--remove", "0"]
    env_threads = os.environ.get("OMP_NUM_THREADS")
    args = ["-m", "otdus_cli.cli", command, str(tmp_path / "src"), "--out", str(tmp_path / "out")]
    done = run_limited([*args, *picks, "--device", "cpu"], 600_000_000)
    assert done.returncode == 4, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    layer = 1 if command == "expand" else 0
    assert lines[0].startswith(
        f"error: ran out of memory in otdus {command} while building output layer {layer} with ot "
        "(an allocation of 1.1 GB failed); nothing was written. Give it more memory"
    ), lines[0]
    assert ("OMP_NUM_THREADS=1" in lines[0]) == (env_threads != "1"), lines[0]
    no_output_left(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
