"""The logits of a streamed run: final norm, head and soft-capping by the family's own forward.

After the last decoder layer, the family's ``forward`` runs again on placeholder ``inputs_embeds`` (the
input embeddings are not needed) and the last layer's stand-in returns the final hidden states in
place of its input, so everything after the layers is transformers' own code. Positions are computed in
chunks of at most ``DEFAULT_MAX_LOGITS_BYTES`` of logits, so a large vocabulary never needs the logits
of a whole batch at once.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence

import torch

from otdus_cli.verify import hf_compat
from otdus_cli.verify.layer_calls import Activations, CheckBatch
from otdus_cli.verify.streamed import Streamed

# Logits of one scoring step: 64 MiB is ~128 positions of a 128k vocabulary in float32.
DEFAULT_MAX_LOGITS_BYTES = 64 * 2**20


def _head_args(model: Streamed, states: torch.Tensor) -> dict:
    """More arguments of the head pass (the final hidden states injected, the layers' inputs unused):
    a wrapper gets plain position ids, which Qwen2.5-VL's forward in transformers 4.57 cannot compute
    from embeddings alone (its multimodal rope index reads input_ids)."""
    if model.text_config is model.config:
        return {}
    positions = torch.arange(states.shape[1], device=states.device)
    return {"position_ids": positions.expand(states.shape[0], -1)}


def _unused_embeddings(model: Streamed, states: torch.Tensor) -> torch.Tensor:
    """The head pass's ``inputs_embeds``: zeros of the input embeddings' width for the positions of
    ``states``. What the forward makes of them is replaced by the injected states; they are not the
    states themselves, which some forwards scale in place (CTRL's ``inputs_embeds *= sqrt(d)``) or
    which have another shape (Hunyuan V4's hyper-connection streams, [B, T, n, H])."""
    weight = None
    with contextlib.suppress(NotImplementedError, AttributeError):  # a class without the accessor
        weight = getattr(model.model.get_input_embeddings(), "weight", None)
    width = weight.shape[-1] if isinstance(weight, torch.Tensor) else states.shape[-1]
    return states.new_zeros(*states.shape[:2], width)


def takes_embeddings(model: Streamed) -> bool:
    """Whether the head pass can give the family's forward ``inputs_embeds``: CPM-Ant's takes token ids
    only (it prepends its prompt tokens to them, so its layers see more positions than the window has);
    Qwen4-Exp's with per-layer n-gram embeddings recovers the token ids from the input embeddings, which
    the head pass does not load (found once, by a head pass on one position with the head loaded)."""
    if "inputs_embeds" not in inspect.signature(model.model.forward).parameters:
        return False
    if model.head_takes_embeddings is None:
        model.weights.load_shell("head")
        probe = torch.zeros(1, 1, int(model.text_config.hidden_size), dtype=model.dtype, device=model.device)
        try:
            head_logits(model, probe)
            model.head_takes_embeddings = True
        except Exception as exc:  # another failure (a placeholder of the wrong shape) is the real pass's
            model.head_takes_embeddings = "meta" not in str(exc)
    return model.head_takes_embeddings


def head_logits(model: Streamed, states: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, T, V] of final hidden states [B, T, H] (on the model's device), the head's stage of
    the shell loaded; a forward without ``inputs_embeds`` is given the windows' token ``ids`` [B, T]
    instead, with the final hidden states of every position its layers see."""
    calls = model.calls
    calls.mode, calls.final_hidden = "inject", states
    inputs = {"input_ids": ids} if ids is not None else {"inputs_embeds": _unused_embeddings(model, states)}
    try:
        extra = {**_head_args(model, states), **hf_compat.logits_only(model.model)}
        return model.model(**inputs, use_cache=False, logits_to_keep=0, **extra).logits
    finally:
        calls.mode, calls.final_hidden = "record", None


def _self_check(model: Streamed, check: CheckBatch) -> None:
    """The check batch's logits, in one piece as the reference computed them, against the reference
    (refuses with OtdusError when they differ)."""
    from otdus_cli.verify.self_check import check_logits

    ids = None if takes_embeddings(model) else check.ids
    logits = head_logits(model, check.hidden.to(model.device), ids)
    check_logits(model, logits[0], check.reference, check.how)


@torch.inference_mode()
def iter_logits(
    model: Streamed,
    acts: Activations,
    keep: Sequence[int] | None = None,
    max_logits_bytes: int | None = None,
) -> Iterator[tuple[list[int], int, torch.Tensor]]:
    """Logits of ``model``'s finished activations, chunk after chunk.

    Yields (window indices, first position p0, logits [B, c, V]) for positions p0 .. p0 + c - 1
    of a batch, covering the last ``keep[window]`` positions (all when not given); a chunk's logits take
    at most ``max_logits_bytes`` (default DEFAULT_MAX_LOGITS_BYTES; at least one position). The
    self-check batch, if the activations carry one, is checked before any chunk comes out. A forward
    without ``inputs_embeds`` (``takes_embeddings``) gives a batch's logits in one chunk and needs the
    input embeddings beside the head.
    """
    by_ids = not takes_embeddings(model)
    model.weights.load_shell("all" if by_ids else "head")  # from token ids, the forward embeds them
    budget = DEFAULT_MAX_LOGITS_BYTES if max_logits_bytes is None else max_logits_bytes
    head = model.model.get_output_embeddings()
    vocab = int(head.weight.shape[0]) if head is not None else int(model.text_config.vocab_size)
    element = torch.empty((), dtype=model.dtype).element_size()
    if acts.check is not None:  # before any figure comes out
        _self_check(model, acts.check)
        acts.check = None
    for g, group in enumerate(acts.groups):
        length = acts.inputs[g].shape[1]
        k = length if keep is None else max(keep[i] for i in group)
        if by_ids:
            logits = head_logits(model, acts.hidden[g].to(model.device), acts.inputs[g])
            yield group, length - k, logits[:, length - k :]
            continue
        step = max(1, budget // max(1, len(group) * vocab * element))
        for p0 in range(length - k, length, step):
            logits = head_logits(model, acts.hidden[g][:, p0 : p0 + step].to(model.device))
            yield group, p0, logits
