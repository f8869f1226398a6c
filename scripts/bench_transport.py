"""Benchmark our Sinkhorn against the released OT-DUS code's fixed POT setting.

For each module shape of Llama-3.1-8B (rows x row length: q/o 4096x4096, k/v 1024x4096,
gate/up 14336x4096, down 4096x14336) it times, on the same cost matrix:

  ours      otdus_cli.transport.sinkhorn (stabilised, over-relaxed, stops at --tol)
  official  POT ot.sinkhorn(a, b, M, 0.06, numItermax=10000, stopThr=1e-9), float32, standard
            domain: the released code's call (it always runs all 10000 iterations in float32)

and reports iterations, seconds and the marginal error of the returned plan measured in float64
(relative L-inf, as our solver stops on, and POT's absolute L2 on the columns).

POT stops before 10000 only if its float32 L2 column error drops below 1e-9, which happens on
some problems (n a power of two, diffuse plans). So POT is run for real, in warm-started chunks,
until it stops or --budget seconds are spent; the rest of the 10000 iterations is then
extrapolated at the measured per-iteration rate (printed with "~", and the error shown is the one
after the iterations actually run). "released" also runs POT on the released code's own cost
(raw Euclidean distances; synthetic weights have std --scale, 0.02 like Llama's).

Data: A has N(0, 1) rows; B = rho * A[perm] + sqrt(1 - rho^2) * noise, so rho = 0 gives unrelated
rows (diffuse plans, like real adjacent layers) and rho = 0.9 near-permutation plans (the slow
case for Sinkhorn). --stories PATH benchmarks the real adjacent layers of a small model instead.

    python -m scripts.bench_transport --sizes 1024x4096,4096x4096 --rho 0,0.9
    python -m scripts.bench_transport --device cuda          # full Llama-3.1-8B shapes on a GPU
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings

import torch

from otdus_cli.device import resolve_device
from otdus_cli.transport.cost import paper_cost, raw_cost
from otdus_cli.transport.sinkhorn import sinkhorn
from otdus_cli.transport.stats import marginal_errors

LLAMA_8B = {
    "4096x4096": "q_proj, o_proj",
    "1024x4096": "k_proj, v_proj",
    "14336x4096": "gate_proj, up_proj",
    "4096x14336": "down_proj",
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_official(cost: torch.Tensor, reg: float, chunk: int, budget: float) -> dict:
    """The released code's POT call (float32, standard domain, 10000 iterations, stopThr 1e-9).

    Run in chunks of ``chunk`` iterations, each warm-started from the last (POT's ``warmstart``),
    so that an early stop (POT's L2 error < 1e-9) is seen where it happens; once ``budget``
    seconds are spent, the remaining iterations are extrapolated at the measured rate.
    """
    import ot

    n, m = cost.shape
    a = torch.ones(n, device=cost.device) / n
    b = torch.ones(m, device=cost.device) / m
    done, seconds, warm = 0, 0.0, None
    stopped = numerical = False
    plan = None
    while done < 10000 and seconds < budget:
        step = min(chunk, 10000 - done)
        _sync(cost.device)
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan, log = ot.sinkhorn(a, b, cost, reg, numItermax=step, stopThr=1e-9, log=True, warmstart=warm)
        _sync(cost.device)
        seconds += time.perf_counter() - start
        ran = int(log["niter"]) + 1
        done += ran
        numerical = any("numerical errors" in str(w.message) for w in caught)
        if numerical or ran < step:  # POT gave up, or its error check passed: it stops here
            stopped = not numerical
            break
        warm = (torch.log(log["u"]), torch.log(log["v"]))
    out = {
        "iterations": done,
        "seconds": seconds,
        "extrapolated": False,
        "stopped_early": stopped,
        "numerical_error": numerical,
        "nonfinite": not bool(torch.isfinite(plan).all()),
        **marginal_errors(plan),
    }
    if done < 10000 and not (stopped or numerical):
        out.update(seconds=seconds * 10000 / done, extrapolated=True, iterations=10000, probe_iterations=done)
    return out


def time_ours(cost: torch.Tensor, reg: float, tol: float, max_iter: int) -> dict:
    _sync(cost.device)
    start = time.perf_counter()
    res = sinkhorn(cost, reg=reg, tol=tol, max_iter=max_iter)
    _sync(cost.device)
    seconds = time.perf_counter() - start
    return {
        "iterations": res.iterations,
        "seconds": seconds,
        "converged": res.converged,
        "omega": res.omega,
        "absorptions": res.absorptions,
        **marginal_errors(res.plan),
    }


def _fmt_official(r: dict) -> str:
    t = ("~" if r["extrapolated"] else "") + f"{r['seconds']:.1f}s"
    note = f" (err after {r['probe_iterations']} it)" if r.get("probe_iterations") else ""
    note += " (POT's stopThr reached)" if r.get("stopped_early") else ""
    bad = " NUMERICAL-ERROR" if r["numerical_error"] else ""
    bad += " NONFINITE" if r["nonfinite"] else ""
    err = f"err {r['marginal_error']:.1e} / L2 {r['marginal_error_l2']:.1e}"
    return f"{r['iterations']:>6} it {t:>9}  {err}{note}{bad}"


def bench_pair(xa: torch.Tensor, xb: torch.Tensor, label: str, args, device: torch.device) -> dict:
    """Times ours and POT on one pair of weight matrices; prints a summary and returns the figures."""
    _sync(device)
    start = time.perf_counter()
    cost = paper_cost(xa, xb)
    _sync(device)
    cost_s = time.perf_counter() - start
    ours = time_ours(cost, args.reg, args.tol, args.max_iter)
    print(f"{label}\n  cost matrix build       {cost_s:.2f}s")
    print(
        f"  ours (paper cost)     {ours['iterations']:>6} it {ours['seconds']:>8.2f}s  "
        f"err {ours['marginal_error']:.1e} / L2 {ours['marginal_error_l2']:.1e}  "
        f"converged={ours['converged']} omega={ours['omega']:.2f}"
    )
    off_device = device if args.official_on_device else torch.device("cpu")
    off = time_official(cost.to(off_device), args.reg, args.chunk, args.budget)
    print(f"  official (paper cost) {_fmt_official(off)}")
    speedup = off["seconds"] / max(ours["seconds"], 1e-9)
    print(f"  speed-up ours vs official, same problem: {speedup:.0f}x")
    result = {
        "label": label,
        "rows": int(xa.shape[0]),
        "dim": int(xa.shape[1]),
        "cost_s": cost_s,
        "ours": ours,
        "official": off,
        "speedup_same_cost": speedup,
        "released": None,
    }
    del cost
    if args.released:
        raw = raw_cost(xa, xb).to(off_device)
        rel = time_official(raw, args.reg, args.chunk, args.budget)
        rmin, rmax = float(raw.min()), float(raw.max())
        print(f"  released (raw cost {rmin:.1f}..{rmax:.1f}) {_fmt_official(rel)}")
        result["released"] = {**rel, "raw_cost_range": [rmin, rmax]}
        result["speedup_released"] = rel["seconds"] / max(ours["seconds"], 1e-9)
    return result


def module_shapes(config: dict) -> dict[str, str]:
    """ "ROWSxDIM" -> the modules of that weight shape, from a Llama-style config.json."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    n_q = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_q)
    hd = int(config.get("head_dim") or hidden // n_q)
    shapes: dict[str, list[str]] = {}
    for rows, dim, module in (
        (n_q * hd, hidden, "q_proj"),
        (n_kv * hd, hidden, "k_proj"),
        (n_kv * hd, hidden, "v_proj"),
        (hidden, n_q * hd, "o_proj"),
        (inter, hidden, "gate_proj"),
        (inter, hidden, "up_proj"),
        (hidden, inter, "down_proj"),
    ):
        shapes.setdefault(f"{rows}x{dim}", []).append(module)
    return {size: ", ".join(mods) for size, mods in shapes.items()}


def synthetic(rows: int, dim: int, rho: float, scale: float, seed: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    xa = torch.randn(rows, dim, generator=gen) * scale
    perm = torch.randperm(rows, generator=gen)
    xb = rho * xa[perm] + math.sqrt(max(0.0, 1.0 - rho * rho)) * scale * torch.randn(rows, dim, generator=gen)
    return xa.to(device), xb.to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--sizes", default=",".join(LLAMA_8B), help="comma list of ROWSxDIM (default: Llama-3.1-8B)"
    )
    p.add_argument("--rho", default="0,0.9", help="comma list of row correlations between A and permuted B")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    p.add_argument("--reg", type=float, default=0.06)
    p.add_argument("--tol", type=float, default=1e-6)
    p.add_argument("--max-iter", type=int, default=2000)
    p.add_argument("--chunk", type=int, default=500, help="POT iterations per warm-started chunk")
    p.add_argument(
        "--budget",
        type=float,
        default=60.0,
        help="seconds of POT per solve; beyond it the rest of the 10000 iterations is extrapolated",
    )
    p.add_argument(
        "--scale", type=float, default=0.02, help="std of the synthetic weights (sets the raw cost)"
    )
    p.add_argument(
        "--official-on-device",
        action="store_true",
        help="run POT on --device too (the released code ran it on the CPU)",
    )
    p.add_argument("--no-released", dest="released", action="store_false", help="skip POT on the raw cost")
    p.add_argument(
        "--stories", default=None, help="model folder: bench its real adjacent layer pairs instead"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default=None, help="config.json: its module shapes instead of --sizes")
    p.add_argument("--json-out", default=None, help="also write every figure to this JSON file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    warm = paper_cost(torch.randn(64, 64, device=device), torch.randn(64, 64, device=device))
    time_ours(warm, args.reg, args.tol, args.max_iter)  # one-time start-up costs out of the timings
    time_official(warm.cpu(), args.reg, 100, 1.0)
    print(
        f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"reg {args.reg}, tol {args.tol}, max_iter {args.max_iter}"
    )
    results: list[dict] = []
    if args.stories:
        from pathlib import Path

        from safetensors.torch import load_file

        w = load_file(str(Path(args.stories) / "model.safetensors"))
        n_layers = 1 + max(int(k.split(".")[2]) for k in w if k.startswith("model.layers."))
        for i in range(n_layers - 1):
            for mod in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
                xa = w[f"model.layers.{i}.{mod}.weight"].float().to(device)
                xb = w[f"model.layers.{i + 1}.{mod}.weight"].float().to(device)
                r = bench_pair(xa, xb, f"[layers {i},{i + 1}] {mod} {tuple(xa.shape)}", args, device)
                results.append({**r, "modules": mod, "rho": None})
    else:
        names = LLAMA_8B
        if args.config:
            with open(args.config) as f:
                names = module_shapes(json.load(f))
        sizes = list(names) if args.config else args.sizes.split(",")
        for size in sizes:
            rows, dim = (int(x) for x in size.lower().split("x"))
            for rho in (float(r) for r in args.rho.split(",")):
                xa, xb = synthetic(rows, dim, rho, args.scale, args.seed, device)
                label = f"[{rows} rows x {dim}] {names.get(size, '')} rho={rho}"
                r = bench_pair(xa, xb, label, args, device)
                results.append({**r, "modules": names.get(size, ""), "rho": rho})
                del xa, xb
    if args.json_out:
        report = {
            "device": str(device),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "reg": args.reg,
            "tol": args.tol,
            "budget_s": args.budget,
            "scale": args.scale,
            "results": results,
        }
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
