"""otdus against mergekit on the same expansions (`python -m scripts.bench --against mergekit`).

mergekit's `passthrough` merge stacks slices of layers; every copy-type otdus method is such a stack:
SOLAR, stack, interpose, copy and LLaMA-Pro. New layers that otdus zero-initialises (o_proj and
down_proj, so the layer adds nothing to the residual stream) are expressed with passthrough's
`scale` parameter, 0.0 on those two tensors (filters `o_proj`, `down_proj`) and 1.0 elsewhere, as
mergekit users write LLaMA-Pro-style configs. The slices come from otdus's own layer map (`otdus plan
--json`), so both tools are asked for the same output layer by layer.

mergekit lives in its own virtual environment (default bench-out/mergekit-venv, git-ignored),
created with pip on first use: it is never a dependency of otdus, and its pins may differ.

For each checkpoint and method both tools write into a fresh folder from a warm page cache (the
source read just before), measured alike (wall time, time until on disk, peak RSS of the process
tree, CPU); then every tensor of the two outputs is compared byte for byte, and each difference is
explained where it can be (e.g. -0.0 against 0.0, which compare equal as numbers).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable

from scripts import measuring

EXPRESSIBLE = ("solar", "stack", "interpose", "llama-pro", "copy")
MERGEKIT_REQUIREMENT = "mergekit==0.1.5"
TORCH_REQUIREMENT = "torch==2.13.0"  # the wheel the Makefile installs: no second download
ZERO_FILTERS = ("o_proj", "down_proj")


# -- the environment -------------------------------------------------------------------------------
def ensure_venv(venv: str, log: Callable[[str], None] = print) -> str:
    """The path of mergekit-yaml in ``venv``, installing mergekit there first if needed."""
    exe = os.path.join(venv, "bin", "mergekit-yaml")
    done = os.path.join(venv, ".mergekit-installed")  # written only once pip has finished
    if os.path.exists(done) and os.path.exists(exe):
        return exe
    log(f"installing {MERGEKIT_REQUIREMENT} into {venv} (its own virtual environment)")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_REQUIREMENT, MERGEKIT_REQUIREMENT], check=True)
    if not os.path.exists(exe):
        raise RuntimeError(f"{MERGEKIT_REQUIREMENT} installed no mergekit-yaml in {venv}")
    with open(done, "w") as f:
        f.write(MERGEKIT_REQUIREMENT + "\n")
    return exe


# -- the same expansion, as a passthrough merge ---------------------------------------------------
def method_flags(method: str, depth: int) -> list[str]:
    """otdus flags for a method at a given depth (SOLAR with m = L/4 as in the paper, LLaMA-Pro
    with one new layer per two base layers)."""
    if method == "solar":
        return ["--method", "solar", "--layers", str(depth - 2 * max(1, depth // 4))]
    if method == "llama-pro":
        return ["--method", "llama-pro", "--layers", str(depth // 2 if depth % 2 == 0 else depth)]
    if method == "stack":
        return ["--method", "stack", "--layers", str(depth)]
    return ["--method", method]


def otdus_layer_map(otdus: list[str], src: str, flags: list[str]) -> list[dict]:
    done = subprocess.run([*otdus, "plan", src, *flags, "--json"], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["layers"]


def slices(layers: list[dict]) -> list[tuple[int, int, bool]]:
    """Runs of consecutive source layers with the same zero-init flag: (start, stop, zero_init)."""
    runs: list[list] = []
    for lay in layers:
        src, zero = lay["source"], bool(lay.get("zero_init")) and bool(lay.get("new"))
        if runs and runs[-1][1] == src and runs[-1][2] == zero:
            runs[-1][1] = src + 1
        else:
            runs.append([src, src + 1, zero])
    return [tuple(r) for r in runs]


def mergekit_yaml(src: str, layers: list[dict], dtype: str) -> str:
    lines = ["merge_method: passthrough", f"dtype: {dtype}", "slices:"]
    for start, stop, zero in slices(layers):
        lines += [
            "  - sources:",
            f"      - model: {json.dumps(src)}",
            f"        layer_range: [{start}, {stop}]",
        ]
        if zero:
            lines += ["        parameters:", "          scale:"]
            for name in ZERO_FILTERS:
                lines += [f"            - filter: {name}", "              value: 0.0"]
            lines += ["            - value: 1.0"]
    return "\n".join(lines) + "\n"


def source_dtype(src: str) -> str:
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("torch_dtype") or cfg.get("dtype") or "float32"


def run_mergekit(exe: str, config_path: str, out: str) -> list[str]:
    """The mergekit command line (CPU, default shard size, tokenizer copied from the base)."""
    return [exe, config_path, out]


# -- comparing outputs ------------------------------------------------------------------------------
def _tensors(folder: str) -> dict[str, tuple[str, str, list[int], int, int]]:
    """name -> (file, dtype, shape, begin, end) of every tensor in a safetensors checkpoint folder."""
    out = {}
    for fn in sorted(os.listdir(folder)):
        if not fn.endswith(".safetensors"):
            continue
        path = os.path.join(folder, fn)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, meta in header.items():
            b, e = meta["data_offsets"]
            out[name] = (path, meta["dtype"], meta["shape"], 8 + n + b, 8 + n + e)
    return out


def _read(path: str, begin: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(begin)
        return f.read(end - begin)


def _why(a: bytes, b: bytes, dtype: str) -> tuple[str, str]:
    """What differs between two tensors' bytes: (kind, detail), in words."""
    import torch  # the otdus environment has it

    dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(dtype)
    if dt is None or len(a) != len(b):
        return "bytes differ", ""
    x, y = torch.frombuffer(bytearray(a), dtype=dt), torch.frombuffer(bytearray(b), dtype=dt)
    bits = x.view(torch.uint8).reshape(len(x), -1).ne(y.view(torch.uint8).reshape(len(y), -1)).any(1)
    n = int(bits.sum())
    if bool(torch.equal(x, y)):  # equal as numbers, different bits: only signs of zeros differ
        if int((bits & torch.signbit(y)).sum()):
            # scale 0.0 multiplies each weight: a negative weight times 0.0 is -0.0; otdus writes +0.0
            why = "-0.0 in mergekit's, which multiplies the weights by its scale 0.0 (negative x 0.0 = -0.0)"
        else:
            why = "-0.0 in otdus's"
        return f"zeros of opposite sign ({why}; equal as numbers)", f"{n} of {len(x)} values"
    diff = float((x.float() - y.float()).abs().max())
    return "values differ", f"{n} of {len(x)} values, max |diff| {diff:.3g}"


def compare_outputs(ours: str, theirs: str) -> dict:
    a, b = _tensors(ours), _tensors(theirs)
    only_ours, only_theirs = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    differ = []
    equal = 0
    for name in sorted(set(a) & set(b)):
        pa, da, sa, ba, ea = a[name]
        pb, db, sb, bb, eb = b[name]
        if (da, sa) != (db, sb):
            differ.append({"name": name, "kind": "dtype or shape", "detail": f"{da} {sa} against {db} {sb}"})
            continue
        x, y = _read(pa, ba, ea), _read(pb, bb, eb)
        if x == y:
            equal += 1
        else:
            kind, detail = _why(x, y, da)
            differ.append({"name": name, "kind": kind, "detail": detail})
    with open(os.path.join(ours, "config.json")) as f:
        ca = json.load(f)
    with open(os.path.join(theirs, "config.json")) as f:
        cb = json.load(f)
    config_diff = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
    return {
        "tensors": len(set(a) | set(b)),
        "equal": equal,
        "differ": differ,
        "only_otdus": only_ours,
        "only_mergekit": only_theirs,
        "config_fields_differ": {k: [ca.get(k), cb.get(k)] for k in config_diff},
        "depth": [ca.get("num_hidden_layers"), cb.get("num_hidden_layers")],
    }


def _warm(src: str) -> None:
    buf = bytearray(16 << 20)
    for fn in os.listdir(src):
        path = os.path.join(src, fn)
        if os.path.isfile(path):
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


# -- the benchmark ------------------------------------------------------------------------------------
def run_mergekit_bench(
    sources: list[tuple[str, str]],
    *,
    methods: list[str],
    otdus: list[str],
    venv: str,
    workdir: str,
    run_measured: Callable,
    poll_s: float,
    timeout: float,
    log: Callable[[str], None],
) -> dict:
    try:
        exe = ensure_venv(venv, log)
    except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
        log(f"mergekit unavailable: {exc}")
        return {"error": f"mergekit could not be installed: {exc}", "rows": []}
    version = subprocess.run(
        [
            os.path.join(venv, "bin", "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('mergekit'))",
        ],
        capture_output=True,
        text=True,
    ).stdout.strip()
    env_note = "HF_HUB_OFFLINE=1 (local folders only)"
    os.environ["HF_HUB_OFFLINE"] = "1"
    rows = []
    for label, src in sources:
        with open(os.path.join(src, "config.json")) as f:
            depth = json.load(f)["num_hidden_layers"]
        dtype = source_dtype(src)
        for method in methods:
            flags = method_flags(method, depth)
            try:
                layers = otdus_layer_map(otdus, src, flags)
            except subprocess.CalledProcessError as exc:
                rows.append(
                    {"source": label, "method": method, "flags": flags, "error": exc.stderr.strip()[-300:]}
                )
                continue
            ours, theirs = (os.path.join(workdir, f"mk-{t}") for t in ("otdus", "mergekit"))
            config_path = os.path.join(workdir, f"mergekit-{method}.yml")
            with open(config_path, "w") as f:
                f.write(mergekit_yaml(src, layers, dtype))
            row = {
                "source": label,
                "method": method,
                "flags": flags,
                "depth": [depth, len(layers)],
                "slices": [list(s) for s in slices(layers)],
            }
            for tool, argv, out in (
                ("otdus", [*otdus, "expand", src, "--out", ours, *flags, "--json"], ours),
                ("mergekit", run_mergekit(exe, config_path, theirs), theirs),
            ):
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                _warm(src)
                log(f"  {label} {method}: {tool}")
                r = run_measured(f"{tool} {method}", "mergekit", method, argv, timeout, poll_s, out)
                row[tool] = {
                    "status": r.status,
                    "reason": r.reason,
                    "wall_s": r.wall_s,
                    "durable_s": r.durable_s,
                    "peak_tree_rss_bytes": r.peak_tree_rss_bytes,
                    "cpu_s": None if r.utime_s is None else r.utime_s + r.stime_s,
                    "output_bytes": r.output_bytes,
                    "load": measuring.load_average()[0],
                }
            if row["otdus"]["status"] == "ok" and row["mergekit"]["status"] == "ok":
                row["compare"] = compare_outputs(ours, theirs)
            for out in (ours, theirs):
                shutil.rmtree(out, ignore_errors=True)
            rows.append(row)
    return {"mergekit_version": version, "env": env_note, "rows": rows}


def _explain(c: dict) -> str:
    if not c:
        return ""
    parts = []
    if c["equal"] == c["tensors"]:
        parts.append(f"bitwise equal: all {c['tensors']} tensors")
    else:
        parts.append(f"{c['equal']} of {c['tensors']} tensors bitwise equal")
        kinds: dict[str, list[str]] = {}
        for d in c["differ"]:
            kinds.setdefault(d["kind"], []).append(d["name"])
        for kind, names in kinds.items():
            what = sorted({n.rsplit(".", 2)[-2] for n in names})  # o_proj, down_proj ...
            parts.append(f"{len(names)} differ: {kind} ({', '.join(what)}; e.g. `{names[0]}`)")
        if c["only_otdus"]:
            parts.append(f"only in otdus's: {', '.join(c['only_otdus'][:3])}")
        if c["only_mergekit"]:
            parts.append(f"only in mergekit's: {', '.join(c['only_mergekit'][:3])}")
    if c["config_fields_differ"]:
        parts.append("config.json: " + explain_config(c["config_fields_differ"]))
    return "; ".join(parts)


def explain_config(differ: dict[str, list]) -> str:
    """Why the two config.json files differ, field by field ({field: [otdus's, mergekit's]}).

    otdus writes the source's config with only its depth fields changed; mergekit re-serialises it
    through the transformers of its own environment, whose field names may differ (5.x writes
    `dtype` for `torch_dtype` and gathers rope settings under `rope_parameters`)."""
    left = dict(differ)
    said = []
    if "torch_dtype" in left and "dtype" in left and left["torch_dtype"][0] == left["dtype"][1]:
        said.append(f"mergekit writes `dtype` for `torch_dtype` (both {left['dtype'][1]})")
        del left["torch_dtype"], left["dtype"]
    rope = (left.get("rope_parameters") or [None, None])[1]
    moved = []
    if isinstance(rope, dict):
        theta = left.get("rope_theta")
        if theta and theta[1] is None and rope.get("rope_theta") == theta[0]:
            moved.append("rope_theta")
        scaling = left.get("rope_scaling")
        same = (
            scaling and isinstance(scaling[0], dict) and all(rope.get(k) == v for k, v in scaling[0].items())
        )
        if same and scaling[1] is None:
            moved.append("rope_scaling")
        if moved and left["rope_parameters"][0] is None:
            said.append(
                "moves " + " and ".join(f"`{k}`" for k in moved) + " into `rope_parameters` (same values)"
            )
            for k in [*moved, "rope_parameters"]:
                del left[k]
    theta = left.get("rope_theta")
    if theta and theta[1] is None and theta[0] == 10000.0 and "rope_parameters" not in left:
        said.append("drops `rope_theta` (10000.0, which transformers then assumes: the same value)")
        del left["rope_theta"]
    if left:
        said.append("differs in " + ", ".join(f"`{k}` ({v[0]!r} against {v[1]!r})" for k, v in left.items()))
    return "; ".join(said)


def render_mergekit(section: dict, conditions: str = "") -> list[str]:
    if section.get("error"):
        return ["", f"mergekit side by side: not run ({section['error']})."]
    lines = [
        "",
        f"Side by side with mergekit {section.get('mergekit_version') or '?'} "
        "(`python -m scripts.bench --against mergekit`; `scripts/bench_mergekit.py`): its passthrough "
        "merge of the same layer map (slices "
        "from `otdus plan --json`; zero-initialised new layers as `scale` 0.0 on o_proj and down_proj), "
        "each tool run once from a warm page cache into a fresh folder, "
        f"{section.get('env', '')}. time: wall, and wall + the `sync` after it; RSS: peak of the process "
        "tree; load: 1-minute load average after the run (2 cores).",
        *(["", conditions] if conditions else []),
        "",
        "| checkpoint | method (otdus flags) | slices | otdus s (+sync) | mergekit s (+sync) "
        "| otdus peak RSS GB | mergekit peak RSS GB | otdus CPU s | mergekit CPU s | load | outputs |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in section["rows"]:
        if "error" in row:
            lines.append(f"| {row['source']} | {row['method']} | plan failed: {row['error']} |" + " |" * 8)
            continue
        o, m = row["otdus"], row["mergekit"]

        def t(x: dict) -> str:
            if x["status"] != "ok":
                return f"{x['status']}: {x['reason']}".replace("|", "/")
            return f"{x['wall_s']:.1f} ({x['durable_s']:.1f})"

        def gb(x: dict) -> str:
            return "" if not x.get("peak_tree_rss_bytes") else f"{x['peak_tree_rss_bytes'] / 1e9:.2f}"

        def cpu(x: dict) -> str:
            return "" if x.get("cpu_s") is None else f"{x['cpu_s']:.1f}"

        cells = [
            row["source"],
            f"{row['method']} (`{' '.join(row['flags'][2:])}`)" if len(row["flags"]) > 2 else row["method"],
            f"{row['depth'][0]} -> {row['depth'][1]}: "
            + ", ".join(f"[{a},{b})" + ("x0" if z else "") for a, b, z in row["slices"]),
            t(o),
            t(m),
            gb(o),
            gb(m),
            cpu(o),
            cpu(m),
            f"{m.get('load', '')}",
            _explain(row.get("compare") or {}),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "slices: passthrough slices, [start, stop) of base layers; x0: o_proj and down_proj scaled by 0.0.",
    ]
    return lines
