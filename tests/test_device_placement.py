"""Device placement on CUDA, checked on the CPU: every method and variant, MoE OT, LESA, widen, verify and
ppl run with ``--device cuda`` under emulated CUDA (tests/support/cuda_emulation.py: tensors that
report ``cuda:N``, compute on the CPU and raise where two devices meet, as on a real GPU), in float32
and bfloat16, and two ranks resolve to two GPUs.

This checks placement only: the arithmetic is the CPU's, so GPU numerics (and speed) need a GPU
(scripts/device_check.sh). Two ranks are simulated in this process: each rank's device is resolved
from its LOCAL_RANK, then its work runs on that GPU here; the gloo exchange between real ranks is
tested on the CPU by test_distributed.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from otdus_cli.bundled import STORIES260K
from otdus_cli.cli import app
from otdus_cli.device import resolve_device
from otdus_cli.distributed import Launch, World
from otdus_cli.verify.compare import verify_expansion
from otdus_cli.verify.metrics import EvalSet, Window
from otdus_cli.verify.perplexity import perplexity
from tests.support.cli_checks import one_error_line
from tests.support.cuda_emulation import emulated_cuda
from tests.support.tiny_models import build_tiny

pytestmark = pytest.mark.usefixtures("single_thread")
runner = CliRunner()
QUICK = ["--max-tokens", "600", "--json"]


def otdus(*args, gpus: int = 2) -> str:
    """Run one command under emulated CUDA; it must succeed (a placement error is exit 3)."""
    with emulated_cuda(gpus):
        result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output[-800:]
    return result.stdout


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return build_tiny("mixtral", tmp_path_factory.mktemp("moe") / "mixtral")


@pytest.mark.parametrize(
    "flags",
    [
        ["--ot-variant", "paper", "--solver", "sinkhorn"],
        ["--ot-variant", "paper", "--solver", "emd", "--dtype", "bfloat16"],
        ["--ot-variant", "structured", "--solver", "sinkhorn", "--dtype", "bfloat16"],
        ["--ot-variant", "structured", "--solver", "emd"],
        ["--ot-variant", "activation", "--calib-tokens", "512"],
    ],
    ids=lambda f: "-".join(x.lstrip("-") for x in f[1::2]),
)
def test_ot_variants_place_every_tensor_on_the_gpu(tmp_path, flags):
    out = tmp_path / "out"
    otdus("expand", STORIES260K, "--out", out, "--layers", "2", "--device", "cuda", "--no-zero-init", *flags)
    assert (out / "model.safetensors").exists()


def test_lesa_verify_and_ppl_on_the_gpu_in_float32_and_bfloat16(tmp_path):
    out = tmp_path / "lesa"
    otdus("expand", STORIES260K, "--out", out, "--method", "lesa", "--layers", "2", "--device", "cuda:1")
    # the manifest records the device kind: the same for one process and for any rank's GPU
    assert json.loads((out / "otdus.json").read_text())["lesa"]["settings"]["device"] == "cuda"
    for dtype in ("float32", "bfloat16"):
        report = json.loads(otdus("verify", out, "--device", "cuda", "--dtype", dtype, *QUICK))
        assert report["device"] == "cuda" and report["dtype"] == dtype
        ppl = json.loads(otdus("ppl", out, "--device", "cuda:1", "--dtype", dtype, *QUICK))
        assert ppl["device"] == "cuda"


def test_moe_ot_and_widen_on_the_gpu(tmp_path, tiny_moe):
    out, wide = tmp_path / "ot", tmp_path / "wide"
    otdus("expand", tiny_moe, "--out", out, "--layers", "1", "--device", "cuda", "--no-zero-init")
    otdus("widen", tiny_moe, "--out", wide)
    # the tiny MoE model has no tokenizer: random token ids through the library's verify and ppl
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 96, (24,), generator=gen).tolist() for _ in range(3)]
    plan = EvalSet("token", "random ids", [Window(w, w[1:], 0, 0) for w in ids], [0], [0], 24)
    for dtype in ("float32", "bfloat16"):
        with emulated_cuda(2):
            report = verify_expansion(tiny_moe, out, plan, device="cuda", dtype=dtype)
            assert report.device == "cuda"
            assert perplexity(wide, plan, device="cuda:1", dtype=dtype).device == "cuda"


@pytest.mark.slow
def test_two_ranks_use_two_gpus_and_make_theirs_current(tmp_path):
    """torchrun's LOCAL_RANK picks the GPU (round-robin when ranks outnumber GPUs) and it becomes the
    current device, so a bare "cuda" inside a library (POT's backend) lands on the rank's GPU."""
    for rank in (0, 1):
        world = World(Launch(rank, 2, rank, "torchrun"))
        with emulated_cuda(2) as cuda:
            device = resolve_device("auto", world)
            assert device == torch.device("cuda", rank) and cuda.current == rank
            assert resolve_device("cuda", World(Launch(rank + 2, 4, rank + 2, "torchrun"))).index == rank
        # the rank's work on its GPU: OT (paper, Sinkhorn) and ppl
        out = tmp_path / f"rank{rank}"
        otdus(
            "expand",
            STORIES260K,
            "--out",
            out,
            "--layers",
            "2",
            "--device",
            device,
            "--ot-variant",
            "official",
            "--max-iter",
            "20",
        )
        otdus("ppl", out, "--device", device, *QUICK)


def test_a_gpu_that_is_not_there_is_one_error_line_before_the_model_is_read(tmp_path):
    # a model that is there: a missing one is refused first, before torch is imported (test_cli_usage)
    for command in (
        ["expand", "bundled:stories260k", "--out", tmp_path / "o"],
        ["ppl", "bundled:stories260k"],
    ):
        with emulated_cuda(2):
            result = runner.invoke(app, [*map(str, command), "--device", "cuda:2"])
        assert "cuda:2" in one_error_line(result) and "2 GPU(s)" in result.output


def test_pot_backend_lands_on_the_ranks_gpu():
    """The official variant's POT Sinkhorn on rank 1's GPU: POT's torch backend, made fresh in the
    process, puts tensors on a bare "cuda" (its type list); set_device makes that the rank's GPU,
    not GPU 0. A few iterations on a tiny cost: placement only."""
    import ot.backend

    from otdus_cli.transport.official import official_sinkhorn

    with emulated_cuda(2):
        device = resolve_device("auto", World(Launch(1, 2, 1, "torchrun")))
        cost = torch.rand(6, 6, generator=torch.Generator().manual_seed(0)).to(device)
        plan = official_sinkhorn(cost, num_iter_max=5)
        assert plan.matrix.device == torch.device("cuda", 1)
        made_on_bare_cuda = ot.backend.get_backend(plan.matrix).__type_list__[2:]
        assert made_on_bare_cuda and {t.device for t in made_on_bare_cuda} == {torch.device("cuda", 1)}
