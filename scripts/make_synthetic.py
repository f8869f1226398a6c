"""Write a random-weight Hugging Face checkpoint shaped exactly like a named real model.

The output has the real model's config.json, tensor names, shapes and hub-style sharding
(`model-0000k-of-0000N.safetensors` + `model.safetensors.index.json`, or a single
`model.safetensors` when everything fits in one shard), so the expansion tools can be tested and
benchmarked at full size without downloading gated weights.

Memory stays bounded: every shard's safetensors header is computed from the shapes first, then
tensors are generated in chunks (at most --chunk-mb each) and streamed to disk one after the
other. A whole tensor, let alone a shard, is never held in memory.

The safetensors writing here (build_header, write_shard) is deliberately independent of
otdus_cli.io.writer: these checkpoints are the sources that benchmarks, fault injection and tests
feed to otdus, so a writer bug shared by both sides would make a broken source look valid and
hide itself in every comparison. tests/test_make_synthetic.py checks the files with the
safetensors library and transformers, not with otdus's reader.

    python -m scripts.make_synthetic llama-3.2-1b --out /tmp/l1b
    python -m scripts.make_synthetic llama-3.1-8b --out /tmp/l8b --layers 8 --dtype bf16
    python -m scripts.make_synthetic tiny --out /tmp/tiny --max-shard-size 100KB
    python -m scripts.make_synthetic --list
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import shutil
import struct
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# --------------------------------------------------------------------------------------------
# Real configs (values as published in each model's config.json on the Hugging Face hub).
# --------------------------------------------------------------------------------------------

_LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

CONFIGS: dict[str, dict] = {
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {**_LLAMA31_ROPE, "factor": 32.0},
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": dict(_LLAMA31_ROPE),
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
    # Qwen/Qwen3-8B
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # mistralai/Mistral-7B-v0.3
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32768,
    },
    # Qwen/Qwen2.5-7B
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 3584,
        "initializer_range": 0.02,
        "intermediate_size": 18944,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_mrope": False,
        "use_sliding_window": False,
        "vocab_size": 152064,
    },
    # google/gemma-2-9b (the hub repo stores float32; --dtype decides what we write)
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3584,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "model_type": "gemma2",
        "num_attention_heads": 16,
        "num_hidden_layers": 42,
        "num_key_value_heads": 8,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": 256000,
    },
    # mistralai/Mixtral-8x7B-v0.1 (on-disk per-expert names: block_sparse_moe.experts.{e}.w1/w2/w3)
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32000,
    },
}


# tiny models' vocabulary: the bundled stories260K tokenizer's (copied into them unless --tokenizer-from)
TINY_VOCAB = 512
BUNDLED_TOKENIZER = Path(__file__).resolve().parent.parent / "otdus_cli" / "data" / "stories260k"


def _tiny(base: str, **over) -> dict:
    """A few-KB model of the same family: same tensor names and config fields, tiny sizes."""
    cfg = copy.deepcopy(CONFIGS[base])
    cfg.update(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        max_position_embeddings=512,
        vocab_size=TINY_VOCAB,  # the stories260k tokenizer's, which tiny models get by default
        bos_token_id=1,
        eos_token_id=2,
    )
    if "head_dim" in cfg:
        cfg["head_dim"] = 16
    if cfg.get("rope_scaling"):
        cfg["rope_scaling"] = None
        cfg["rope_theta"] = 10000.0
    for key in ("max_window_layers",):
        if key in cfg:
            cfg[key] = cfg["num_hidden_layers"]
    if cfg["model_type"] == "gemma2":
        cfg.update(query_pre_attn_scalar=16, sliding_window=64, pad_token_id=0)
    if cfg["model_type"] == "mixtral":
        cfg.update(num_local_experts=4, num_experts_per_tok=2)
    if cfg["model_type"] == "qwen2":
        cfg["sliding_window"] = 512
    cfg.update(over)
    return cfg


CONFIGS.update(
    {
        "tiny": _tiny("llama-3.1-8b", tie_word_embeddings=False),
        "tiny-llama-tied": _tiny("llama-3.2-1b"),
        "tiny-mistral": _tiny("mistral-7b"),
        "tiny-qwen2": _tiny("qwen2.5-7b"),
        "tiny-qwen3": _tiny("qwen3-8b"),
        "tiny-gemma2": _tiny("gemma-2-9b"),
        "tiny-mixtral": _tiny("mixtral-8x7b"),
    }
)

ALIASES = {
    "llama-3.2-1B": "llama-3.2-1b",
    "llama-3.1-8B": "llama-3.1-8b",
    "qwen3-8B": "qwen3-8b",
    "mistral-7B": "mistral-7b",
    "qwen2.5-7B": "qwen2.5-7b",
    "gemma-2-9B": "gemma-2-9b",
    "mixtral-8x7B": "mixtral-8x7b",
    "tiny-llama": "tiny",
}

DTYPES = {
    "bf16": (torch.bfloat16, "BF16", "bfloat16"),
    "f16": (torch.float16, "F16", "float16"),
    "f32": (torch.float32, "F32", "float32"),
}

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


# --------------------------------------------------------------------------------------------
# Tensor inventory
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "weight" (normal, init std), "norm" (around 1, or around 0 for Gemma), "bias"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensor_specs(cfg: dict) -> list[Spec]:
    """Every tensor the model stores on disk, in the order the hub's checkpoints list them."""
    mt = cfg["model_type"]
    h = cfg["hidden_size"]
    inter = cfg["intermediate_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    vocab = cfg["vocab_size"]
    qkv_bias = mt == "qwen2" or bool(cfg.get("attention_bias"))

    specs = [Spec("model.embed_tokens.weight", (vocab, h), "weight")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs.append(Spec(p + "input_layernorm.weight", (h,), "norm"))
        for proj, rows in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            specs.append(Spec(f"{p}self_attn.{proj}.weight", (rows, h), "weight"))
            if qkv_bias:
                specs.append(Spec(f"{p}self_attn.{proj}.bias", (rows,), "bias"))
        specs.append(Spec(p + "self_attn.o_proj.weight", (h, nh * hd), "weight"))
        if cfg.get("attention_bias") and mt != "qwen2":
            specs.append(Spec(p + "self_attn.o_proj.bias", (h,), "bias"))
        if mt in ("qwen3", "gemma3_text"):
            specs.append(Spec(p + "self_attn.q_norm.weight", (hd,), "norm"))
            specs.append(Spec(p + "self_attn.k_norm.weight", (hd,), "norm"))
        specs.append(Spec(p + "post_attention_layernorm.weight", (h,), "norm"))
        if mt in ("gemma2", "gemma3_text"):
            specs.append(Spec(p + "pre_feedforward_layernorm.weight", (h,), "norm"))
            specs.append(Spec(p + "post_feedforward_layernorm.weight", (h,), "norm"))
        if mt == "mixtral":
            moe = p + "block_sparse_moe."
            specs.append(Spec(moe + "gate.weight", (cfg["num_local_experts"], h), "weight"))
            for e in range(cfg["num_local_experts"]):
                specs.append(Spec(f"{moe}experts.{e}.w1.weight", (inter, h), "weight"))
                specs.append(Spec(f"{moe}experts.{e}.w2.weight", (h, inter), "weight"))
                specs.append(Spec(f"{moe}experts.{e}.w3.weight", (inter, h), "weight"))
        else:
            specs.append(Spec(p + "mlp.gate_proj.weight", (inter, h), "weight"))
            specs.append(Spec(p + "mlp.up_proj.weight", (inter, h), "weight"))
            specs.append(Spec(p + "mlp.down_proj.weight", (h, inter), "weight"))
    specs.append(Spec("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        specs.append(Spec("lm_head.weight", (vocab, h), "weight"))
    return specs


def parse_size(text: str | int) -> int:
    """'5GB' -> 5*10**9, '500MiB' -> 500*2**20, '1000' -> 1000 (the hub's conventions)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 5GB, 500MB, 100KiB, 1000)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    scale.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
    return int(float(m.group(1)) * scale[unit])


def plan_shards(specs: list[Spec], itemsize: int, max_shard: int) -> list[list[Spec]]:
    """Greedy split in order, as transformers/huggingface_hub do: a tensor larger than the limit
    gets a shard of its own; otherwise start a new shard when the next tensor would overflow."""
    shards: list[list[Spec]] = []
    cur: list[Spec] = []
    cur_size = 0
    for s in specs:
        size = s.numel * itemsize
        if size > max_shard:
            shards.append([s])
            continue
        if cur and cur_size + size > max_shard:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(s)
        cur_size += size
    if cur:
        shards.append(cur)
    return shards


def build_header(specs: list[Spec], dtype_code: str, itemsize: int) -> bytes:
    """The safetensors header: JSON padded with spaces to a multiple of 8, after its u64 length."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        n = s.numel * itemsize
        header[s.name] = {"dtype": dtype_code, "shape": list(s.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


# --------------------------------------------------------------------------------------------
# Random data, chunked
# --------------------------------------------------------------------------------------------


class FastPool:
    """--fill fast: slices of one random block at random offsets (memcpy speed, rows still differ)."""

    def __init__(self, dtype: torch.dtype, seed: int, size: int = (1 << 24) + 8191):
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(2 * size, generator=g).to(dtype)  # doubled so any slice of `size` fits
        self.size = size
        self.rng = torch.Generator().manual_seed(seed + 1)

    def take(self, n: int) -> torch.Tensor:
        out = []
        while n > 0:
            k = min(n, self.size)
            off = int(torch.randint(0, self.size, (1,), generator=self.rng))
            out.append(self.pool[off : off + k])
            n -= k
        return out[0] if len(out) == 1 else torch.cat(out)


def tensor_chunks(
    spec: Spec,
    cfg: dict,
    dtype: torch.dtype,
    seed: int,
    chunk_elems: int,
    pool: FastPool | None,
    device: str = "cpu",
) -> Iterator[torch.Tensor]:
    """Yield the tensor's values, flattened, in chunks of whole rows (at most chunk_elems each).

    device="cuda" generates on the GPU (much faster for 16 GB checkpoints) and copies each chunk
    back; values then differ from CPU generation with the same seed (different generators)."""
    std = float(cfg.get("initializer_range", 0.02))
    gemma = cfg["model_type"].startswith("gemma")
    # Per-tensor seed: the same tensor gets the same values whatever the sharding or layer count.
    g = torch.Generator(device=device).manual_seed(
        (seed * 1_000_003 + zlib.crc32(spec.name.encode())) & (2**63 - 1)
    )
    row = spec.shape[-1] if len(spec.shape) > 1 else spec.numel
    rows_per_chunk = max(1, chunk_elems // row)
    total_rows = spec.numel // row
    for r0 in range(0, total_rows, rows_per_chunk):
        n = min(rows_per_chunk, total_rows - r0) * row
        if spec.kind == "norm":
            # Learned norms sit around 1 (Gemma stores w with scale 1 + w, so around 0).
            x = torch.randn(n, generator=g, device=device).mul_(0.05).add_(0.0 if gemma else 1.0).to(dtype)
        elif pool is not None:
            x = pool.take(n).mul(std)
        elif dtype == torch.float32:
            x = torch.empty(n, dtype=dtype, device=device).normal_(0.0, std, generator=g)
        else:
            x = torch.empty(n, dtype=torch.float32, device=device).normal_(0.0, std, generator=g).to(dtype)
        yield x.cpu()


def write_shard(
    path: str,
    specs: list[Spec],
    cfg: dict,
    dtype: torch.dtype,
    code: str,
    seed: int,
    chunk_elems: int,
    pool: FastPool | None,
    device: str = "cpu",
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    header = build_header(specs, code, itemsize)
    written = 0
    tmp = path + ".partial"
    with open(tmp, "wb", buffering=0) as f:
        f.write(header)
        for s in specs:
            for chunk in tensor_chunks(s, cfg, dtype, seed, chunk_elems, pool, device):
                buf = chunk.contiguous().view(torch.uint8).numpy()
                f.write(memoryview(buf))
                written += buf.nbytes
            # (the tensor's expected size is guaranteed by construction; check anyway)
        expected = sum(s.numel for s in specs) * itemsize
        if written != expected:
            raise RuntimeError(f"{path}: wrote {written} data bytes, header says {expected}")
    os.replace(tmp, path)
    return written


# --------------------------------------------------------------------------------------------
# Configs and extra files
# --------------------------------------------------------------------------------------------


def make_config(name: str, layers: int | None, dtype_name: str) -> dict:
    cfg = copy.deepcopy(CONFIGS[name])
    if layers is not None:
        if layers < 1:
            raise SystemExit("--layers must be >= 1")
        base = cfg["num_hidden_layers"]
        cfg["num_hidden_layers"] = layers
        # Thresholds equal to the full depth in the real configs ("all layers") follow the depth.
        if cfg.get("max_window_layers") == base:
            cfg["max_window_layers"] = layers
    cfg["torch_dtype"] = dtype_name
    cfg["transformers_version"] = _transformers_version()
    return cfg


def _transformers_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except Exception:  # transformers is optional for writing
        return "4.57.0"


def generation_config(cfg: dict) -> dict:
    out = {"_from_model_config": True, "bos_token_id": cfg.get("bos_token_id")}
    out["eos_token_id"] = cfg.get("eos_token_id")
    if cfg.get("pad_token_id") is not None:
        out["pad_token_id"] = cfg["pad_token_id"]
    out["transformers_version"] = cfg.get("transformers_version")
    return out


def copy_tokenizer(src: str, out: str) -> list[str]:
    if not os.path.isdir(src):
        raise SystemExit(f"--tokenizer-from: not a directory: {src}")
    copied = []
    for fn in TOKENIZER_FILES:
        p = os.path.join(src, fn)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(out, fn))
            copied.append(fn)
    if not copied:
        raise SystemExit(f"--tokenizer-from: no tokenizer files in {src}")
    return copied


def check_config(cfg: dict) -> None:
    """Make sure transformers accepts the config (it validates several fields on load)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    AutoConfig.for_model(**fields)


# --------------------------------------------------------------------------------------------


def write_checkpoint(
    name: str,
    out: str,
    layers: int | None = None,
    dtype: str = "bf16",
    max_shard_size: str | int = "5GB",
    seed: int = 0,
    tokenizer_from: str | None = None,
    fill: str = "randn",
    chunk_mb: int = 64,
    force: bool = False,
    quiet: bool = True,
    device: str = "cpu",
) -> dict:
    """Write the checkpoint; return a summary dict. Usable from tests and benchmarks."""
    name = ALIASES.get(name, name)
    if name not in CONFIGS:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(sorted(CONFIGS))}")
    torch_dtype, code, dtype_name = DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    cfg = make_config(name, layers, dtype_name)
    specs = tensor_specs(cfg)
    max_bytes = parse_size(max_shard_size)
    shards = plan_shards(specs, itemsize, max_bytes)
    total = sum(s.numel for s in specs) * itemsize

    if os.path.exists(out) and os.listdir(out):
        if not force:
            raise SystemExit(f"{out} exists and is not empty (use --force to overwrite)")
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)
    free = shutil.disk_usage(out).free
    if total > free:
        raise SystemExit(f"not enough disk: need {total / 1e9:.2f} GB, {free / 1e9:.2f} GB free at {out}")

    chunk_elems = max(1, chunk_mb * 2**20 // 4)  # float32 staging chunks
    pool = FastPool(torch_dtype, seed) if fill == "fast" else None
    t0 = time.perf_counter()
    n = len(shards)
    files = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    )
    weight_map: dict[str, str] = {}
    done = 0
    for fn, shard in zip(files, shards, strict=False):
        done += write_shard(
            os.path.join(out, fn), shard, cfg, torch_dtype, code, seed, chunk_elems, pool, device
        )
        for s in shard:
            weight_map[s.name] = fn
        if not quiet:
            el = time.perf_counter() - t0
            print(
                f"  {fn}: {done / 1e9:.2f}/{total / 1e9:.2f} GB, {done / 1e6 / max(el, 1e-9):.0f} MB/s",
                flush=True,
            )
    if n > 1:
        index = {
            "metadata": {"total_parameters": sum(s.numel for s in specs), "total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(generation_config(cfg), f, indent=2)
        f.write("\n")
    if tokenizer_from is None and cfg.get("vocab_size") == TINY_VOCAB:
        # a tiny model gets the bundled stories260K tokenizer (its 512 ids), so it can be verified as is
        tokenizer_from = str(BUNDLED_TOKENIZER)
    tok = copy_tokenizer(tokenizer_from, out) if tokenizer_from else []
    return {
        "model": name,
        "out": out,
        "layers": cfg["num_hidden_layers"],
        "dtype": dtype_name,
        "tensors": len(specs),
        "parameters": sum(s.numel for s in specs),
        "bytes": total,
        "shards": n,
        "tokenizer_files": tok,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="model shape to imitate (see --list)")
    ap.add_argument("--out", help="output directory")
    ap.add_argument(
        "--layers", type=int, default=None, help="number of decoder layers (default: the real model's)"
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--max-shard-size", default="5GB", help="hub-style shard limit: 5GB, 500MB, 100KiB, ...")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tokenizer-from",
        default=None,
        help="copy tokenizer files from this directory (tiny-* models: the bundled stories260K's by default)",
    )
    ap.add_argument(
        "--fill",
        choices=("randn", "fast"),
        default="randn",
        help="randn: i.i.d. normal values (default); fast: slices of one random block (much faster)",
    )
    ap.add_argument(
        "--device", default="cpu", help="generate random values here (cuda is much faster; values differ)"
    )
    ap.add_argument("--chunk-mb", type=int, default=64, help="generation chunk size (bounds memory)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    ap.add_argument("--check-config", action="store_true", help="validate the config with transformers first")
    ap.add_argument("--list", action="store_true", help="list known models with their size and exit")
    ap.add_argument("--json", action="store_true", help="print a JSON summary")
    args = ap.parse_args(argv)

    if args.list:
        for n in sorted(CONFIGS):
            c = CONFIGS[n]
            specs = tensor_specs(c)
            params = sum(s.numel for s in specs)
            print(
                f"{n:18s} {c['model_type']:8s} layers={c['num_hidden_layers']:3d} params={params / 1e9:7.3f}B"
            )
        return 0
    if not args.name or not args.out:
        ap.error("NAME and --out are required")
    name = ALIASES.get(args.name, args.name)
    if args.check_config and name in CONFIGS:
        check_config(make_config(name, args.layers, DTYPES[args.dtype][2]))
    summary = write_checkpoint(
        args.name,
        args.out,
        layers=args.layers,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        seed=args.seed,
        tokenizer_from=args.tokenizer_from,
        fill=args.fill,
        chunk_mb=args.chunk_mb,
        force=args.force,
        quiet=args.json,
        device=args.device,
    )
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"wrote {summary['model']} ({summary['layers']} layers, {summary['dtype']}, "
            f"{summary['parameters'] / 1e9:.3f}B params, {summary['bytes'] / 1e9:.2f} GB, "
            f"{summary['shards']} shard(s)) to {summary['out']} in {summary['seconds']:.1f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
