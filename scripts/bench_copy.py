"""Copy-type `otdus expand` against `cp -r && sync`, warm and cold page cache, paired runs (for bench.py).

Each repetition runs `cp -r` of the source and then every copy-type expansion under the same cache
state, so a disk or a neighbour that slows down slows both; the reported figure is the median over
the repetitions of the time until the output is on disk (the command, then `sync`), per output byte,
divided by cp's. warm: the source was just read (a model just downloaded or expanded); cold: the
page cache was dropped, with Python and otdus's code cached again by an unmeasured small run.

The machine's load (1-minute load average) is recorded with every run: on a shared machine the
figures are only as good as the quiet they were taken in.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

from scripts import measuring

TARGET = 1.5  # at most this many times cp's time per output byte
STARTUP_TARGET_S = 1.0


def run_copy_bench(
    src: str,
    commands: list[tuple[str, str, list[str]]],
    *,
    modes: list[str],
    reps: int,
    workdir: str,
    run_measured: Callable,
    prepare_cache: Callable[[str, str], None],
    timeout: float,
    poll_s: float,
    log: Callable[[str], None],
    rmtree: Callable[[str], None],
) -> dict:
    """``commands``: (label, method, argv with "{out}") for each otdus expansion; cp is added."""
    runs = []
    everything = [("cp -r", "cp", ["cp", "-r", src, "{out}"]), *commands]
    for mode in modes:
        for rep in range(reps):
            for label, method, argv_t in everything:
                out = os.path.join(workdir, f"copy-bench-{method}")
                rmtree(out)
                prepare_cache(mode, src)
                load_before = measuring.load_average()[0]
                argv = [a.replace("{out}", out) for a in argv_t]
                kind = "cp" if method == "cp" else "expand"
                r = run_measured(label, kind, method, argv, timeout, poll_s, out)
                rmtree(out)
                row = {
                    "mode": mode,
                    "rep": rep,
                    "label": label,
                    "method": method,
                    "status": r.status,
                    "reason": r.reason,
                    "wall_s": r.wall_s,
                    "sync_s": r.sync_s,
                    "durable_s": r.durable_s,
                    "output_bytes": r.output_bytes,
                    "cpu_s": None if r.utime_s is None else r.utime_s + r.stime_s,
                    "utime_s": r.utime_s,
                    "stime_s": r.stime_s,
                    "peak_tree_rss_bytes": r.peak_tree_rss_bytes,
                    "others_cpu_s": r.other_cpu_s,
                    "load": [load_before, measuring.load_average()[0]],
                    "timings": (r.otdus_json or {}).get("timings"),
                }
                runs.append(row)
                log(
                    f"  {mode} {rep + 1}/{reps} {label}: {r.status} {r.wall_s or 0:.1f} s + sync "
                    f"{r.sync_s or 0:.1f} s, load {load_before}"
                )
    return {"modes": modes, "reps": reps, "runs": runs, "summary": summarize(runs)}


def summarize(runs: list[dict]) -> dict:
    """Per mode and command: median durable seconds, seconds per output GB, ratio to cp per byte."""
    out: dict[str, dict] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        rows = [r for r in runs if r["mode"] == mode and r["status"] == "ok" and r["output_bytes"]]
        by_label: dict[str, list[dict]] = {}
        for r in rows:
            by_label.setdefault(r["label"], []).append(r)
        cp = by_label.get("cp -r")
        cp_per_byte = statistics.median(r["durable_s"] / r["output_bytes"] for r in cp) if cp else None
        summary = {}
        for label, rs in by_label.items():
            per_byte = statistics.median(r["durable_s"] / r["output_bytes"] for r in rs)
            startups = [r["timings"]["startup_s"] for r in rs if (r.get("timings") or {}).get("startup_s")]
            startup_cpu = [
                r["timings"]["startup_cpu_s"] for r in rs if (r.get("timings") or {}).get("startup_cpu_s")
            ]
            checks = {r["timings"].get("config_check") for r in rs if r.get("timings")}
            summary[label] = {
                "runs": len(rs),
                "durable_s": [round(r["durable_s"], 2) for r in rs],
                "median_durable_s": round(statistics.median(r["durable_s"] for r in rs), 2),
                "output_bytes": rs[0]["output_bytes"],
                "s_per_gb": round(per_byte * 1e9, 2),
                "ratio_per_byte": round(per_byte / cp_per_byte, 2) if cp_per_byte else None,
                "median_peak_rss_gb": round(
                    statistics.median(r["peak_tree_rss_bytes"] or 0 for r in rs) / 1e9, 2
                ),
                "median_cpu_s": round(statistics.median(r["cpu_s"] for r in rs if r["cpu_s"] is not None), 1),
                "median_startup_s": round(statistics.median(startups), 2) if startups else None,
                "median_startup_cpu_s": round(statistics.median(startup_cpu), 2) if startup_cpu else None,
                "config_check": ", ".join(sorted(c for c in checks if c)) or None,
                "load": [min(r["load"][0] for r in rs), max(r["load"][1] for r in rs)],
            }
        out[mode] = summary
    return out


def render_copy(section: dict, conditions: str = "") -> list[str]:
    section = {**section, "summary": summarize(section["runs"])}  # from the raw runs, always current
    lines = [
        "",
        f"**Copy-type methods against `cp -r && sync`**, paired runs (`scripts/bench_copy.py`): each of "
        f"{section['reps']} repetitions runs cp and every expansion below under the same page-cache state; "
        "time = the command plus the `sync` after it (until the output is on disk); figures are medians. "
        "warm: the source was read just before (a model just downloaded or expanded); cold: `echo 3 > "
        "/proc/sys/vm/drop_caches` before each command, then an unmeasured small run caches Python and "
        "otdus's code. start-up: process start to the first tensor byte moving (otdus's --json timings), "
        "and in brackets the CPU seconds spent by then, which a busy machine does not stretch. load: the "
        "1-minute load average at the runs' start and end (2 cores: above ~1.5 the machine was loaded, "
        "other jobs shared the CPUs).",
    ]
    if conditions:
        lines += ["", conditions]
    lines += [
        "",
        "| cache | command | runs: s (command + sync) | median s | out GB | s / GB | x cp per byte | target "
        f"<= {TARGET}x | start-up s (CPU s) | CPU s | peak RSS GB | config check | load |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|",
    ]
    for mode, summary in section["summary"].items():
        for label, s in summary.items():
            ratio = s["ratio_per_byte"]
            target = "" if label == "cp -r" or ratio is None else ("met" if ratio <= TARGET else "MISSED")
            startup = "" if s["median_startup_s"] is None else f"{s['median_startup_s']:.2f}"
            if s.get("median_startup_cpu_s") is not None:
                startup += f" ({s['median_startup_cpu_s']:.2f})"
            cells = [
                mode,
                f"`{label}`",
                ", ".join(f"{x:.1f}" for x in s["durable_s"]),
                f"{s['median_durable_s']:.1f}",
                f"{s['output_bytes'] / 1e9:.2f}",
                f"{s['s_per_gb']:.2f}",
                "" if ratio is None else f"{ratio:.2f}x",
                target,
                startup,
                f"{s['median_cpu_s']:.1f}",
                f"{s.get('median_peak_rss_gb', 0):.2f}",
                s.get("config_check") or "",
                f"{s['load'][0]:.1f}-{s['load'][1]:.1f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Copy targets:", ""]
    for mode, summary in section["summary"].items():
        ratios = {k: v["ratio_per_byte"] for k, v in summary.items() if k != "cp -r" and v["ratio_per_byte"]}
        loads = [v["load"] for v in summary.values()]
        load = f"load {min(x[0] for x in loads):.1f}-{max(x[1] for x in loads):.1f}"
        if ratios:
            worst = max(ratios, key=ratios.get)
            verdict = "met" if ratios[worst] <= TARGET else "MISSED"
            lines.append(
                f"- {mode} page cache, per output byte against cp: {min(ratios.values()):.2f}x-"
                f"{ratios[worst]:.2f}x (target <= {TARGET}x: {verdict}; slowest `{worst}`; {load})."
            )
        startups = {k: v for k, v in summary.items() if v["median_startup_s"] is not None}
        if startups:
            worst = max(startups, key=lambda k: startups[k]["median_startup_s"])
            wall, cpu = startups[worst]["median_startup_s"], startups[worst].get("median_startup_cpu_s")
            verdict = "met" if wall < STARTUP_TARGET_S else "MISSED"
            lines.append(
                f"- {mode} start-up: {wall:.2f} s at most (target < {STARTUP_TARGET_S:g} s: {verdict}; "
                + (f"{cpu:.2f} s of CPU, " if cpu is not None else "")
                + f"{load})."
            )
    return lines
