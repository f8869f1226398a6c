"""The tiny random instance a derived template's proofs run on (arch/identity.py's zero-init and plan
proofs, arch/derived_roles.py's role proof, arch/layer_slices.py's slice proof): transformers' class
built from the config, its widths shrunk when the model is large, and the token ids the proofs feed it.
"""

from __future__ import annotations

import warnings

from otdus_cli.arch.causal_lm import build_causal_lm
from otdus_cli.arch.hf_config import transformers_config
from otdus_cli.arch.layer_run import stored_buffers
from otdus_cli.quiet import quiet_transformers

# a model at most this large is proved on as it is; a larger one on a copy with these widths
MAX_PROOF_PARAMETERS = 20_000_000
_SHRUNK_WIDTHS = {
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 96,
    "ffn_hidden_size": 96,
    "n_inner": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "vocab_size": 256,
    # per-layer inputs (Gemma 3n, Gemma 4: a second table of vocab x depth x width, 2.3G entries in E2B)
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 16,
}
PROOF_TOKENS = 8
# token selections (DeepSeek sparse attention's indexer keeps the index_topk best keys per query; a later
# layer may reuse an earlier one's choice) are narrowed below PROOF_TOKENS on every proof instance: with
# all tokens selected, a new layer that changes the choice handed on would still look like an identity
_NARROW_SELECTION = {"index_topk": 3, "index_topk_blocks": 1}
# a tiny instance: the model, how it was made, the names of its vectors transformers initialises to ones
TinyInstance = tuple[object, str, set[str]]
AS_GIVEN = "the config as given"  # how a proof's instance is described when nothing was shrunk


def seeded_logits(model, ids, seed: int = 0):
    """The model's logits on ``ids``, run with torch's global random generator seeded with ``seed`` (and
    left as it was): a model that draws random numbers in its forward (Reformer's LSH hashing without a
    hash_seed) gives the same logits for the same draws, which is all its expansion can keep."""
    import torch

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        return model(input_ids=ids, use_cache=False).logits


def tiny_ids(model, seed: int):
    """The token ids a proof runs ``model`` (a tiny instance) on: PROOF_TOKENS of them, seeded, below 90
    (ids of the first tokens exist in every vocabulary)."""
    import torch

    vocab = model.get_input_embeddings().weight.shape[0]
    return torch.randint(0, min(vocab, 90), (1, PROOF_TOKENS), generator=torch.Generator().manual_seed(seed))


def _narrowed(config: dict) -> dict:
    """``config`` (and a wrapper's text config) with its token selections narrowed (_NARROW_SELECTION)."""
    out = {k: _NARROW_SELECTION.get(k, v) if isinstance(v, int) else v for k, v in config.items()}
    for key, value in out.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = _narrowed(value)
    return out


def tiny_config(config: dict, shrink: bool | None = None) -> tuple[object, bool]:
    """transformers' config for ``config`` if its model is small (or ``shrink`` is False), else with its
    widths shrunk; and whether it was shrunk."""
    import torch

    config = _narrowed(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if shrink is None:
            with torch.device("meta"):
                model = build_causal_lm(transformers_config(config))
            shrink = sum(p.numel() for p in model.parameters()) > MAX_PROOF_PARAMETERS
        if shrink:
            return transformers_config({k: _SHRUNK_WIDTHS.get(k, v) for k, v in config.items()}), True
        return transformers_config(config), False


def make_tiny_instance(config: dict) -> TinyInstance:
    """The tiny model, what it is (as given, or shrunk), and the names of its vectors transformers
    initialises to all ones (scales: their identity value is 1)."""
    import torch

    loaded, shrunk = tiny_config(config)
    instance = "the config with its widths shrunk" if shrunk else AS_GIVEN
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = build_causal_lm(loaded).float().eval()
    vectors = {n: p for n, p in model.named_parameters() if p.dim() == 1 and p.is_floating_point()}
    # a scale held as a buffer the checkpoint stores (Gemma 4's layer_scalar: trained, ones at init)
    vectors |= {n: b for n, b in stored_buffers(model).items() if bool((b == 1).all())}
    ones = {n for n, p in vectors.items() if bool((p == 1).all())}
    with torch.no_grad():  # norms start at exactly 1 or 0; perturb them so a lucky identity shows
        for p in vectors.values():
            p.add_(torch.randn_like(p) * 0.1)
        # and matrices at the scale of trained ones: transformers' small initial weights leave the hidden
        # states nearly as the embeddings made them, so a layer reading another layer's choices (a token
        # selection handed on) would choose alike and a new layer that changes them would pass
        for p in model.parameters():
            if p.dim() > 1 and p.is_floating_point():
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model, instance, ones


@quiet_transformers
def tiny_instance(config: dict) -> TinyInstance | Exception:
    """The tiny random instance the proofs of a derived template run on (the zero-init proof here, the
    role proof of arch/derived_roles.py: built once for both, each puts back what it changes); the
    exception when transformers cannot build it."""
    try:
        return make_tiny_instance(config)
    except Exception as exc:
        return exc
