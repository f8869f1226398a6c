"""Shared test fixtures: the real bundled stories260K model and tiny random models of every family.

The tiny models are built in-process with transformers' own classes and saved with save_pretrained,
so they have exactly the tensor names, config fields and on-disk layout of real checkpoints.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

from otdus_cli.bundled import STORIES260K

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

# model_type -> extra config fields (small, but exercising each family's particular features)
TINY_CONFIGS: dict[str, dict] = {
    "llama": {"tie_word_embeddings": False},
    "mistral": {"sliding_window": 16},
    "qwen2": {
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 2,
        "tie_word_embeddings": True,
    },
    "qwen3": {"head_dim": 8},
    "gemma2": {"head_dim": 8, "sliding_window": 16, "query_pre_attn_scalar": 8},
    "gemma3_text": {"head_dim": 8, "sliding_window": 16, "query_pre_attn_scalar": 8, "num_hidden_layers": 6},
    "phi3": {"pad_token_id": 0},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
    },
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    **{
        # architecture breadth (issue 17): tests/test_arch_breadth.py
        "olmo2": {},
        "olmo3": {"sliding_window": 16},
        "exaone4": {"head_dim": 8, "sliding_window": 16},
        "granite": {"residual_multiplier": 0.5, "embedding_multiplier": 2.0, "logits_scaling": 2.0},
        "smollm3": {"pad_token_id": 0},
        "ministral": {"head_dim": 8, "sliding_window": 16},
        "cohere": {"use_qk_norm": True},
        "cohere2": {"sliding_window": 16},
        "glm4": {"pad_token_id": 0, "head_dim": 8},
        "starcoder2": {"sliding_window": 16},
        "gpt_oss": {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
        # dense and MoE layers interleaved, NoPE layers every second, chunked attention on the others
        "llama4_text": {
            "head_dim": 8,
            "num_local_experts": 4,
            "intermediate_size_mlp": 40,
            "interleave_moe_layer_step": 2,
            "no_rope_layer_interval": 2,
            "attention_chunk_size": 8,
        },
        "deepseek_v3": {
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 16,
            "n_group": 1,
            "topk_group": 1,
        },
    },
}
DENSE_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]
MOE_TYPES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
BREADTH_DENSE_TYPES = [
    "olmo2",
    "olmo3",
    "exaone4",
    "granite",
    "smollm3",
    "ministral",
    "cohere",
    "cohere2",
    "glm4",
    "starcoder2",
]
BREADTH_MOE_TYPES = ["gpt_oss", "deepseek_v3", "llama4_text"]


def build_tiny(model_type: str, folder: Path, max_shard_size: str | None = None, seed: int = 0) -> Path:
    """Save a tiny random model of `model_type` (weights drawn so no tensor is trivially zero)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type, **{**COMMON, **TINY_CONFIGS[model_type]})
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at exactly 1 (or 0 for Gemma); perturb them so mistakes show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for modules that run many passes of tiny models: a second thread only adds
    synchronisation there (several times the CPU time, far worse on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {mt: build_tiny(mt, root / mt) for mt in TINY_CONFIGS}


@pytest.fixture(scope="session")
def sharded_llama(tmp_path_factory) -> Path:
    return build_tiny("llama", tmp_path_factory.mktemp("sharded") / "llama", max_shard_size="20KB")


@pytest.fixture()
def stories(tmp_path) -> Path:
    """A private copy of the real stories260K model (tests may damage it)."""
    return Path(shutil.copytree(STORIES260K, tmp_path / "stories260k"))


def load_causal_lm(folder: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


def logits(model, seed: int = 0, vocab: int | None = None, length: int = 24) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab or model.config.vocab_size, (2, length), generator=gen)
    with torch.no_grad():
        return model(input_ids=ids).logits


def one_error_line(result, code: int = 2, message: str | None = None) -> str:
    """A CLI result that failed as promised: exit ``code``, one `error:` line on stderr (holding
    ``message`` when given), no traceback. Returns the line."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output
    if message is not None:
        assert message in lines[0], lines[0]
    return lines[0]


def no_output_left(parent: Path, out_name: str = "out") -> None:
    """Neither the output nor anything of otdus's life cycle (temporary folders, lock) beside it."""
    assert not (parent / out_name).exists()
    assert not [p.name for p in parent.iterdir() if "otdus-" in p.name]


def study_from_window_losses(per_window: dict[str, list[list[float]]], reference: str = "ref"):
    """A StudyResult made from given per-seed, per-window final losses (no training), compared with
    ``reference`` as study() compares."""
    import math  # noqa: PLC0415

    from otdus_cli.study import MethodSummary, RunResult, StudyResult  # noqa: PLC0415

    seeds = list(range(len(next(iter(per_window.values())))))
    runs, methods = [], []
    for label, table in per_window.items():
        for seed, losses in zip(seeds, table, strict=True):
            final = math.fsum(losses) / len(losses)
            runs.append(
                RunResult(label, seed, [0], [final], [], final, final, True, True, 1, 1, 0.0, list(losses))
            )
        finals = [math.fsum(t) / len(t) for t in table]
        methods.append(
            MethodSummary(label, {}, seeds, True, 0.0, True, math.fsum(finals) / len(finals), 0.0, 1.0, 1, 1)
        )
    result = StudyResult("b", "", {"seeds": seeds, "steps": 1}, {}, 0.0, methods, runs, 0.0)
    return result.recompute(reference)
