"""Several processes (torchrun, srun) as one run: the output and figures of one process, failures
everywhere.

The multi-process tests start real processes on the gloo backend (CPU), two ranks, on the bundled
stories260K model and a tiny Mixtral: `torchrun` for the runs users start, and two hand-launched
ranks (the variables torchrun sets) where one rank must differ from the other.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from otdus_cli.distributed import Launch, World, launch_from_env, shard
from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.options import ExpandOptions
from tests.support.ranks import (
    OTDUS,
    TORCHRUN,
    env_for,
    free_port,
    one_process,
    same_output,
    two_ranks,
)

pytestmark = [pytest.mark.distributed]

QUICK = ["--max-tokens", "1500", "--device", "cpu", "--json"]
# figures that vary run to run or with the number of processes, by design
VARYING = ("timings", "compute")


def hand_launched(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Rank r runs commands[r], with the variables torchrun would set."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_for(
                WORLD_SIZE=str(len(commands)),
                RANK=str(r),
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            ),
        )
        for r, cmd in enumerate(commands)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def figures(stdout: str) -> dict:
    report = json.loads(stdout)  # exactly one JSON object, or this fails
    return {k: v for k, v in report.items() if k not in VARYING}


# -- where a process stands -------------------------------------------------------------------------
def test_launchers_environment_gives_the_rank():
    assert launch_from_env({}) == Launch()
    torchrun = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}
    assert launch_from_env(torchrun) == Launch(3, 4, 1, "torchrun")
    step = {"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}
    assert launch_from_env(step) == Launch(5, 8, 1, "srun")
    # a batch script's own shell has the job's task count but no step: one process, not a world
    assert launch_from_env({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}) == Launch()
    with pytest.raises(OtdusError, match="rank 4 of world size 4"):
        launch_from_env({"WORLD_SIZE": "4", "RANK": "4"})
    with pytest.raises(OtdusError, match="not an integer"):
        launch_from_env({"WORLD_SIZE": "two"})


def test_shards_cover_every_item_once_in_order_and_balance_the_cost():
    costs = [5, 1, 1, 1, 1, 1, 4, 2]
    for size in (1, 2, 3, 8, 11):
        blocks = [shard(costs, World(Launch(r, size))) for r in range(size)]
        assert [i for b in blocks for i in b] == list(range(len(costs)))
        if size == 2:
            assert [sum(costs[i] for i in b) for b in blocks] == [8, 8]


def test_a_world_of_one_runs_its_work_and_keeps_its_exceptions():
    world = World()
    assert world.exchange(lambda: 7) == [7]
    assert world.sum_float64([0.1, 2.0]) == [0.1, 2.0] and world.all_true(True)
    world.barrier()

    def broken() -> None:
        raise ValueError("as it was")

    with pytest.raises(ValueError, match="as it was"):
        world.exchange(broken)


# -- verify and ppl on two ranks ----------------------------------------------------------------------
@pytest.mark.slow  # several CLI processes, each importing torch: make test-long
def test_ppl_on_two_ranks_reports_the_figures_of_one_process():
    args = ["ppl", "bundled:stories260k", *QUICK]  # lm-eval wikitext: word and byte counts too
    single, double = one_process(args), two_ranks(args)
    assert single.returncode == 0 and double.returncode == 0, double.stderr[-12000:]
    assert figures(double.stdout) == figures(single.stdout)  # float64 sums, bit for bit
    assert json.loads(double.stdout)["compute"]["ranks"] == 2
    assert json.loads(single.stdout)["compute"]["ranks"] == 1


@pytest.mark.slow  # several CLI processes, each importing torch: make test-long
def test_verify_on_two_ranks_reports_the_figures_of_one_process(tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "pro"
    expand("bundled:stories260k", out, ExpandOptions(method="llama-pro", layers=5))
    # base layer 3's copy damaged: the lockstep comparison must find the same first divergence
    shard_file = out / "model.safetensors"
    tensors = load_file(str(shard_file))
    name = next(n for n in tensors if n.startswith("model.layers.4.") and n.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, str(shard_file), metadata={"format": "pt"})
    args = ["verify", str(out), "--protocol", "token", "--seq-len", "64", *QUICK]
    single, double = one_process(args), two_ranks(args)
    assert single.returncode == 1 and double.returncode != 0, double.stderr[-12000:]
    report = figures(double.stdout)
    assert report == figures(single.stdout)
    assert report["verdict"].startswith("BROKEN") and report["first_divergence"]["max_abs_diff"] > 0
    assert not report["logits_equal"] and report["base"]["n_windows"] > 2


# -- failures ----------------------------------------------------------------------------------------
@pytest.mark.slow  # several CLI processes, each importing torch: make test-long
def test_a_failing_rank_fails_every_rank_with_its_line(stories, tmp_path):
    # rank 1's copy of the model is damaged (a node-local copy gone bad): both ranks say so, exit 2
    damaged = Path(stories)
    config = json.loads((damaged / "config.json").read_text())
    config["intermediate_size"] += 8
    (damaged / "config.json").write_text(json.dumps(config))
    args = ["--max-tokens", "500", "--device", "cpu", "--json"]
    ranks = hand_launched(
        [[*OTDUS, "ppl", "bundled:stories260k", *args], [*OTDUS, "ppl", str(damaged), *args]]
    )
    for r in ranks:
        assert r.returncode == 2 and r.stdout == "", r.stderr[-12000:]
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: rank 1: "), r.stderr[-12000:]
        assert str(damaged) in lines[0]


@pytest.mark.slow  # several CLI processes, each importing torch: make test-long
def test_a_dead_rank_does_not_leave_the_other_waiting(tmp_path):
    # rank 1 joins the group, then dies without a word: rank 0 must end with one line, not hang
    dies = "import os, torch.distributed as dist; dist.init_process_group('gloo'); os._exit(9)"
    args = ["ppl", "bundled:stories260k", "--max-tokens", "500", "--device", "cpu", "--json"]
    rank0, rank1 = hand_launched([[*OTDUS, *args], [sys.executable, "-c", dies]])
    assert rank1.returncode == 9
    assert rank0.returncode == 2 and rank0.stdout == "", rank0.stderr[-12000:]
    lines = [line for line in rank0.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: lost the other ranks"), lines


def test_expand_on_two_ranks_writes_the_bytes_of_one_process(tmp_path):
    # small shards, so both ranks own shard files; new layers built on both ranks, after LESA's
    # pre-pass on each (OT-DUS: the MoE test below)
    args = ["--method", "lesa", "--layers", "3", "--max-shard-size", "300KB", "--json", "--lesa-epochs", "2"]
    single = one_process(["expand", "bundled:stories260k", "--out", str(tmp_path / "one"), *args])
    double = two_ranks(["expand", "bundled:stories260k", "--out", str(tmp_path / "two"), *args])
    assert single.returncode == 0 and double.returncode == 0, double.stderr[-12000:]
    assert json.loads(double.stdout)["out"] == str(tmp_path / "two")  # one JSON object, rank 0's
    assert len([p for p in (tmp_path / "one").iterdir() if p.suffix == ".safetensors"]) > 2
    same_output(tmp_path / "one", tmp_path / "two")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no temporary folder left


@pytest.mark.parametrize("fault", ["truncated source", "no GPU"])
def test_a_failing_rank_fails_the_expansion_everywhere_and_leaves_nothing(stories, tmp_path, fault):
    # rank 1 fails where rank 0 does not: its copy of the source has a truncated shard (found while
    # planning, while rank 0 claims the output), or it is asked for a GPU it lacks (found
    # when it starts writing, after rank 0 made the temporary folder and shard files)
    import torch

    if fault == "no GPU" and torch.cuda.is_available():
        pytest.skip("the fault is a missing GPU")
    args = ["--method", "ot", "--layers", "3", "--max-shard-size", "300KB"]
    out = tmp_path / "deeper"
    rank0 = [*OTDUS, "expand", "bundled:stories260k", "--out", str(out), *args]
    if fault == "truncated source":
        shard_file = Path(stories) / "model.safetensors"
        shard_file.write_bytes(shard_file.read_bytes()[:-4096])
        rank1 = [*OTDUS, "expand", str(stories), "--out", str(out), *args]
    else:
        rank1 = [*rank0, "--device", "cuda"]
    expected = {"truncated source": "truncated file", "no GPU": "no CUDA GPU"}[fault]
    for r in hand_launched([rank0, rank1]):
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1, r.stderr[-12000:]
        assert lines[0].startswith("error: rank 1: ") and expected in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stories260k"]  # no output, no temporary folder


# -- a tiny MoE model, through the library -------------------------------------------------------------
VERIFY_SCRIPT = """
import json, sys
import torch
from otdus_cli.distributed import current_world, end_rank
from otdus_cli.verify.compare import verify_expansion
from otdus_cli.verify.metrics import EvalSet, Window

gen = torch.Generator().manual_seed(0)
ids = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (40, 40, 23, 31, 40)]
plan = EvalSet("token", "random ids", [Window(w, w[1:], 0, 0) for w in ids], [0], [0], 40)
report = verify_expansion(sys.argv[1], sys.argv[2], plan, device="cpu", batch_size=1).to_dict()
if current_world().is_main:
    print(json.dumps({k: v for k, v in report.items() if k not in ("timings", "compute")}))
end_rank()
"""


@pytest.mark.slow
def test_a_tiny_moe_model_expands_and_verifies_on_two_ranks_as_on_one(tmp_path):
    from tests.support.tiny_models import build_tiny

    base = build_tiny("mixtral", tmp_path / "moe")
    args = ["--method", "ot", "--layers", "2", "--max-shard-size", "40KB", "--json"]
    single = one_process(["expand", str(base), "--out", str(tmp_path / "one"), *args])
    double = two_ranks(["expand", str(base), "--out", str(tmp_path / "two"), *args])
    assert single.returncode == 0 and double.returncode == 0, double.stderr[-12000:]
    assert len([p for p in (tmp_path / "one").iterdir() if p.suffix == ".safetensors"]) > 2
    same_output(tmp_path / "one", tmp_path / "two")
    script = tmp_path / "verify_moe.py"
    script.write_text(VERIFY_SCRIPT)
    run = [str(script), str(base), str(tmp_path / "two")]
    alone = subprocess.run([sys.executable, *run], capture_output=True, text=True, env=env_for(), timeout=600)
    port = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    pair = subprocess.run(
        [*TORCHRUN, *port, *run], capture_output=True, text=True, env=env_for(), timeout=600
    )
    assert alone.returncode == 0 and pair.returncode == 0, pair.stderr[-12000:]
    report = json.loads(pair.stdout)
    assert report == json.loads(alone.stdout)
    assert report["parity"] and report["logits_equal"] and report["base"]["n_windows"] == 5
