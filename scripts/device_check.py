"""The steps of scripts/device_check.sh: what a GPU machine is asked, each step recorded as it ends.

    python -m scripts.device_check --out DIR             # on a GPU machine (device_check.sh calls it)
    python -m scripts.device_check --out DIR --dry-run   # every step on the CPU at tiny size

Steps, in this order (the JSON file DIR/device_check.json is rewritten after each, so a run cut
off by its time limit keeps what it measured; a step that fails records its error and the next
one runs):

* ``environment``: versions of python, torch, transformers, POT, CUDA and the driver, the GPU.
* ``expand``: wall time and peak GPU memory (nvidia-smi, polled) of ``otdus expand --method ot``
  on a synthetic bf16 checkpoint of Llama-3.1-8B's width (``--big-layers`` of its 32 layers,
  +50%: 32 -> 48 with all of them), on the GPU.
* ``verify_speed``: tokens/s of ``otdus verify`` on that base and expansion, against a plain
  transformers forward of the same two models over the same number of tokens, on the same GPU
  and dtype.
* ``agreement``: every method (``--methods``) built on the GPU and on the CPU from the bundled
  stories260K and from a two-layer checkpoint of Llama-3.2-1B's width (one new layer): the
  largest relative difference per tensor (max |gpu - cpu| / max |cpu|), and the verdict of
  ``otdus verify`` on the GPU output, on the GPU.
* ``ranks``: ``expand --method ot`` on stories260K as one process and as two torchrun ranks on
  the one GPU: wall times, and whether the shards are the same bytes.

``--dry-run`` runs the same code with the CPU in the GPU's place and tiny synthetic models in
place of the 8B and 1B shapes, so the script is exercised in the test suite while no GPU is lent
(tests/test_device_check.py); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OTDUS = [sys.executable, "-m", "otdus_cli.cli"]
BUNDLED = "bundled:stories260k"
# method name -> extra expand flags; every method and OT variant/solver
METHODS: dict[str, list[str]] = {
    "ot-paper": ["--method", "ot"],
    "ot-emd": ["--method", "ot", "--solver", "emd"],
    "ot-official": ["--method", "ot", "--ot-variant", "official"],
    "ot-structured": ["--method", "ot", "--ot-variant", "structured"],
    "ot-activation": ["--method", "ot", "--ot-variant", "activation", "--calib-tokens", "512"],
    "lesa": ["--method", "lesa", "--lesa-epochs", "2"],
    "average": ["--method", "average"],
    "copy": ["--method", "copy"],
    "interpose": ["--method", "interpose"],
    "random": ["--method", "random"],
    "llama-pro": ["--method", "llama-pro"],
    "solar": ["--method", "solar"],
    "stack": ["--method", "stack"],
}


class Record:
    """The JSON report, written again after every step."""

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"settings": settings, "steps": {}}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)

    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        start = time.perf_counter()
        print(f"[device_check {time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        try:
            result: dict[str, Any] = {"ok": True, **fn()}
        except Exception as exc:  # a failed step is recorded; the next step still runs
            result = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc()[-3000:],
            }
        result["step_seconds"] = round(time.perf_counter() - start, 2)
        self.data["steps"][name] = result
        self.write()
        print(f"[device_check] {name}: {'ok' if result['ok'] else result['error']}", flush=True)
        return result if result["ok"] else None


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {' '.join(cmd[2:6])} ...: {done.stderr.strip()[-800:]}")
    return done


class GpuMemoryPoll:
    """Peak memory used on the GPUs (nvidia-smi every 0.2 s) while a command runs; None without it."""

    def __init__(self) -> None:
        self.smi = shutil.which("nvidia-smi")
        self.peak_mib: int | None = None
        self.before_mib: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _used(self) -> int | None:
        if self.smi is None:
            return None
        try:
            out = subprocess.run(
                [self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout
            return sum(int(x) for x in out.split())
        except (OSError, subprocess.SubprocessError, ValueError):
            return None

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            used = self._used()
            if used is not None:
                self.peak_mib = max(self.peak_mib or 0, used)

    def __enter__(self) -> GpuMemoryPoll:
        self.before_mib = self._used()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def figures(self) -> dict[str, Any]:
        return {"gpu_mem_before_mib": self.before_mib, "gpu_mem_peak_mib": self.peak_mib}


def environment(device: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for name, module in (("transformers", "transformers"), ("pot", "ot"), ("safetensors", "safetensors")):
        try:
            out[name] = __import__(module).__version__
        except ImportError:
            out[name] = None
    out["cuda_build"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    smi = shutil.which("nvidia-smi")
    if smi:
        q = "--query-gpu=name,memory.total,driver_version"
        out["nvidia_smi"] = subprocess.run(
            [smi, q, "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    out["cpus"] = os.cpu_count()
    out["device"] = device
    return out


def synthetic(name: str, folder: Path, layers: int | None, device: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "scripts.make_synthetic", name, "--out", str(folder), "--fill", "fast"]
    cmd += ["--device", device if device.startswith("cuda") else "cpu", "--dtype", "bf16", "--force"]
    if layers is not None:
        cmd += ["--layers", str(layers)]
    start = time.perf_counter()
    run(cmd, timeout)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return {"shape": name, "layers": layers, "bytes": size, "write_s": round(time.perf_counter() - start, 2)}


def expand_cli(
    src: str, out: Path, device: str, extra: list[str], timeout: float, launcher: list[str] | None = None
):
    """`otdus expand` in a subprocess: (report, wall seconds, GPU memory figures)."""
    cmd = [*(launcher or [sys.executable]), "-m", "otdus_cli.cli", "expand", src, "-o", str(out)]
    cmd += ["--device", device, "--json", *extra]
    with GpuMemoryPoll() as poll:
        start = time.perf_counter()
        done = run(cmd, timeout)
        wall = time.perf_counter() - start
    return json.loads(done.stdout), round(wall, 2), poll.figures()


def step_expand(work: Path, device: str, shape: str, layers: int | None, timeout: float) -> dict[str, Any]:
    made = synthetic(shape, work / "big-base", layers, device, timeout)
    report, wall, mem = expand_cli(
        str(work / "big-base"), work / "big-expanded", device, ["--method", "ot"], timeout
    )
    return {
        "source": made,
        "wall_s": wall,
        **mem,
        "report_timings": report.get("timings"),
        "layers_out": _layers(work / "big-expanded"),
    }


def _layers(folder: Path) -> int | None:
    config = json.loads((folder / "config.json").read_text())
    return config.get("num_hidden_layers") or config.get("text_config", {}).get("num_hidden_layers")


def plain_forward(folder: Path, device: str, dtype: str, tokens: int, window: int) -> dict[str, Any]:
    """Tokens/s of a transformers forward over ``tokens`` random tokens in windows of ``window``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    n_windows = max(1, tokens // window)
    ids = torch.randint(0, vocab, (n_windows, window), generator=gen).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.inference_mode():
        model(ids[:1])  # warm-up: kernels chosen, memory pools filled
        sync()
        start = time.perf_counter()
        for row in ids:
            model(row[None]).logits.float().log_softmax(-1)
        sync()
        seconds = time.perf_counter() - start
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "tokens": n_windows * window,
        "seconds": round(seconds, 3),
        "tokens_per_s": n_windows * window / seconds,
    }


def step_verify_speed(work: Path, device: str, max_tokens: int, timeout: float) -> dict[str, Any]:
    base, expanded = work / "big-base", work / "big-expanded"
    cmd = [*OTDUS, "verify", str(expanded), "--base", str(base), "--device", device, "--dtype", "bfloat16"]
    cmd += ["--max-tokens", str(max_tokens), "--json"]
    start = time.perf_counter()
    report = json.loads(run(cmd, timeout).stdout)
    wall = time.perf_counter() - start
    tokens = report["base"]["n_tokens"]
    timings = report["timings"]
    compute_s = timings.get("layers_s", 0.0) + timings.get("scoring_s", 0.0)
    window = report["base"].get("context") or 512
    plain_base = plain_forward(base, device, "bfloat16", tokens, window)
    plain_expanded = plain_forward(expanded, device, "bfloat16", tokens, window)
    plain_s = plain_base["seconds"] + plain_expanded["seconds"]
    return {
        "tokens": tokens,
        "window": window,
        "verify_wall_s": round(wall, 2),
        "verify_timings": timings,
        "verify_tokens_per_s_both_models": tokens / compute_s if compute_s else None,
        "plain_base": plain_base,
        "plain_expanded": plain_expanded,
        "plain_tokens_per_s_both_models": plain_base["tokens"] / plain_s if plain_s else None,
        "note": "verify streams both models layer by layer and scores the wikitext protocol; the plain "
        "forward holds each whole model on the device and scores random tokens (log-softmax included)",
    }


def _tensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def relative_differences(cpu: Path, gpu: Path) -> dict[str, float]:
    """max |gpu - cpu| / max |cpu| per tensor (0.0 where both are all zeros)."""
    a, b = _tensors(cpu), _tensors(gpu)
    if a.keys() != b.keys():
        raise RuntimeError(
            f"the CPU and GPU outputs hold different tensors: {sorted(a.keys() ^ b.keys())[:5]}"
        )
    out: dict[str, float] = {}
    for name, ta in a.items():
        ta64, tb64 = ta.double(), b[name].double()
        scale = float(ta64.abs().max()) if ta64.numel() else 0.0
        diff = float((ta64 - tb64).abs().max()) if ta64.numel() else 0.0
        out[name] = diff / scale if scale > 0 else diff
    return out


def agreement(
    src: str,
    label: str,
    work: Path,
    device: str,
    methods: list[str],
    extra: list[str],
    left: Callable[[], float],
) -> dict[str, Any]:
    """Each method built on the CPU and on ``device``; ``left()`` gives each command's time limit."""
    results: dict[str, Any] = {}
    for method in methods:
        try:
            flags = [*METHODS[method], *extra]
            cpu_out, gpu_out = work / f"{label}-{method}-cpu", work / f"{label}-{method}-gpu"
            expand_cli(src, cpu_out, "cpu", flags, left())
            _, gpu_wall, _ = expand_cli(src, gpu_out, device, flags, left())
            rel = relative_differences(cpu_out, gpu_out)
            worst = max(rel, key=rel.get)
            cmd = [
                *OTDUS,
                "verify",
                str(gpu_out),
                "--base",
                src,
                "--device",
                device,
                "--max-tokens",
                "2000",
                "--json",
            ]
            verify = subprocess.run(cmd, capture_output=True, text=True, timeout=left(), cwd=ROOT)
            verdict = (
                json.loads(verify.stdout)["verdict"]
                if verify.stdout.strip()
                else verify.stderr.strip()[-300:]
            )
            results[method] = {
                "tensors": len(rel),
                "tensors_differing": sum(v > 0 for v in rel.values()),
                "max_rel_diff": rel[worst],
                "worst_tensor": worst,
                "per_tensor": {k: v for k, v in rel.items() if v > 0},
                "gpu_expand_wall_s": gpu_wall,
                "verify_exit": verify.returncode,
                "verify_verdict": verdict,
            }
            shutil.rmtree(cpu_out, ignore_errors=True)
            shutil.rmtree(gpu_out, ignore_errors=True)
        except Exception as exc:  # one method failing leaves the others' figures
            results[method] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


def _shard_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.safetensors"))}


def step_ranks(work: Path, device: str, timeout: float) -> dict[str, Any]:
    flags = ["--method", "ot", "--max-shard-size", "300KB"]
    _, one_wall, one_mem = expand_cli(BUNDLED, work / "ranks-one", device, flags, timeout)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    report, two_wall, two_mem = expand_cli(
        BUNDLED, work / "ranks-two", device, flags, timeout, launcher=torchrun
    )
    same = _shard_hashes(work / "ranks-one") == _shard_hashes(work / "ranks-two")
    return {
        "one_process": {"wall_s": one_wall, **one_mem},
        "two_ranks": {"wall_s": two_wall, **two_mem, "device": report.get("device")},
        "same_shard_bytes": same,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for device_check.json")
    ap.add_argument("--work", type=Path, help="folder for checkpoints (default: a temporary one, removed)")
    ap.add_argument("--dry-run", action="store_true", help="every step on the CPU, tiny models")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--big-layers", type=int, default=32, help="layers of the 8B-wide source (32: the real depth)"
    )
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated, for the agreement step")
    ap.add_argument("--verify-tokens", type=int, default=16384, help="tokens verify scores (dry run: 600)")
    ap.add_argument("--step-timeout", type=float, default=300, help="seconds per command")
    ap.add_argument("--budget", type=float, default=420, help="seconds for every step together")
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run else args.device
    big, wide = ("tiny", "tiny") if args.dry_run else ("llama-3.1-8b", "llama-3.2-1b")
    big_layers = None if args.dry_run else args.big_layers
    verify_tokens = 600 if args.dry_run else args.verify_tokens
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {
        "dry_run": args.dry_run,
        "device": device,
        "big_shape": big,
        "big_layers": big_layers,
        "wide_shape": wide,
        "methods": methods,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    record = Record(args.out / "device_check.json", settings)
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"otdus-device-check-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget

    def left() -> float:
        """Seconds a command may run: the per-command limit, within what is left of the budget."""
        remaining = deadline - time.monotonic()
        if remaining < 10:
            raise TimeoutError(f"the {args.budget:.0f} s budget is spent")
        return min(args.step_timeout, remaining)

    try:
        # cheap steps first: a run cut off in the big expansion keeps them
        record.step("environment", lambda: environment(device))
        record.step(
            "agreement_tiny", lambda: {"methods": agreement(BUNDLED, "tiny", work, device, methods, [], left)}
        )
        record.step("ranks", lambda: step_ranks(work, device, left()))
        if record.step("expand", lambda: step_expand(work, device, big, big_layers, left())):
            record.step("verify_speed", lambda: step_verify_speed(work, device, verify_tokens, left()))
        shutil.rmtree(work / "big-expanded", ignore_errors=True)
        if not args.dry_run:  # the dry run's wide model is the same tiny one
            shutil.rmtree(work / "big-base", ignore_errors=True)

        def wide_layer() -> dict[str, Any]:
            if args.dry_run and (work / "big-base").is_dir():
                made: dict[str, Any] = {"shape": wide, "reused": "the expand step's source"}
                (work / "big-base").rename(work / "wide")
            else:
                made = synthetic(wide, work / "wide", None if args.dry_run else 2, device, left())
            wide_methods = [m for m in ("ot-paper", "average") if m in methods] or methods[:1]
            extra = ["--layers", "1"]
            return {
                "source": made,
                "methods": agreement(str(work / "wide"), "wide", work, device, wide_methods, extra, left),
            }

        record.step("agreement_wide_layer", wide_layer)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        record.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record.write()
    failed = [name for name, step in record.data["steps"].items() if not step["ok"]]
    print(f"[device_check] done; failed steps: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
