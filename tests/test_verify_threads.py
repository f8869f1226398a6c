"""The thread policy of verify and ppl: never more intra-op threads than the CPUs are free for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from otdus_cli.bundled import STORIES260K, TINYSTORIES_SAMPLE
from otdus_cli.verify import threads
from otdus_cli.verify.eval_set import make_eval_set
from otdus_cli.verify.perplexity import perplexity
from otdus_cli.verify.text import text_corpus
from otdus_cli.verify.threads import SMALL_WORK_FLOP, choose_threads, intra_op_threads


@pytest.fixture()
def no_omp(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_an_explicit_count_is_taken_as_given(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(5).threads == 5 and choose_threads(5).reason == "--threads"
    assert choose_threads(None, work_flop=1.0).threads == 3  # OMP_NUM_THREADS, even for small work
    assert choose_threads(None).reason == "OMP_NUM_THREADS"


def test_small_work_gets_one_thread(no_omp):
    with intra_op_threads(2):
        choice = choose_threads(None, work_flop=SMALL_WORK_FLOP / 2)
    assert choice.threads == 1 and choice.reason.startswith("small work")


def test_torch_s_own_setting_bounds_the_choice(no_omp):
    with intra_op_threads(1):
        choice = choose_threads(None, work_flop=1e12)
    assert choice.threads == 1 and choice.reason.startswith("one thread allowed"), choice


def test_cgroup_quotas_v2_and_v1(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads._cgroup_quota_cpus(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads._cgroup_quota_cpus(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads._cgroup_quota_cpus(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads._cgroup_quota_cpus(tmp_path) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="the case of the issue: two CPUs")
def test_a_busy_cpu_is_not_given_a_thread(no_omp):
    """With another process spinning on one of two CPUs, large work gets one thread, not two."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # the burner is running
        since = threads.sample_cpus()
        time.sleep(1.0)
        with intra_op_threads(2):
            choice = choose_threads(None, work_flop=1e12, since=since)
    finally:
        burner.kill()
        burner.wait()
    if choice.busy_elsewhere is None:
        pytest.skip("/proc/stat is not readable here")
    assert choice.busy_elsewhere >= 0.5 and choice.threads == 1, choice


def test_a_run_restores_torch_s_setting_and_reports_its_choice(no_omp):
    plan = make_eval_set(
        STORIES260K,
        corpus=text_corpus(TINYSTORIES_SAMPLE, max_docs=1),
        protocol="token",
        seq_len=64,
        token_mode="documents",
        max_tokens=128,
    )
    with intra_op_threads(2):
        report = perplexity(STORIES260K, plan)
        assert torch.get_num_threads() == 2
    threads_used = report.to_dict()["compute"]["threads"]
    assert threads_used["threads"] == 1 and threads_used["reason"].startswith("small work")
    assert report.compute.batch_size >= 2  # equal-length windows share a forward pass


def _ppl_threads(extra: list[str], env: dict[str, str], cpus: set[int] | None = None) -> dict:
    """compute.threads of a real `otdus ppl --json` run (with its CPU affinity set to ``cpus``)."""
    argv = [sys.executable, "-m", "otdus_cli.cli", "ppl", "bundled:stories260k", "--json", "--quiet"]
    argv += ["--text", "bundled:tinystories-sample", "--protocol", "token", "--max-tokens", "600", *extra]
    proc = subprocess.run(
        argv,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["compute"]["threads"]


@pytest.mark.slow  # several CLI processes, each importing torch: make test-long
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_the_cli_follows_affinity_omp_num_threads_and_threads_flag():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    pinned = _ppl_threads([], env, cpus={min(os.sched_getaffinity(0))})
    assert pinned["usable_cpus"] == 1 and pinned["threads"] == 1, pinned
    assert pinned["reason"] == "one thread allowed (CPU affinity)", pinned
    # the user's word is taken as given, even beyond the CPUs: they may know better
    omp = _ppl_threads([], {**env, "OMP_NUM_THREADS": "3"})
    assert omp["threads"] == 3 and omp["reason"] == "OMP_NUM_THREADS", omp
    flagged = _ppl_threads(["--threads", "2"], {**env, "OMP_NUM_THREADS": "3"})
    assert flagged["threads"] == 2 and flagged["reason"] == "--threads", flagged
