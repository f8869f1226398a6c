"""The streamed evaluator's guard: its logits on a short input must equal transformers' own forward.

``verify`` and ``ppl`` give figures only from an evaluator that reproduces the model exactly. Once per
model and run, the first window's first ``SELF_CHECK_TOKENS`` tokens are evaluated as one extra window
of the streamed run (so the layer-by-layer side costs no extra pass over the checkpoint) and compared,
bit for bit, with a reference computed by transformers itself:

* models up to ``WHOLE_MODEL_MAX_BYTES`` (in the evaluation dtype): ``from_pretrained`` and a plain
  forward of the whole model, independent of the evaluator's loading (buffers, tied weights, expert
  layouts) and of its layer-by-layer machinery;
* larger models: the family's own forward in one call, each decoder layer loaded from the checkpoint
  when the forward reaches it (one extra pass over the layers on a short input). This checks the
  layer-by-layer machinery (recorded layer arguments, layer output conventions, the injected head
  pass) but shares the evaluator's loading, which the whole-model check covers on small models.
  ``verify`` runs it on the expanded model only (the base is the same family, built the same way), so
  a run pays at most one extra pass.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence

import torch

from otdus_cli.errors import OtdusError
from otdus_cli.verify import hf_compat
from otdus_cli.verify.streamed import Streamed

SELF_CHECK_TOKENS = 32
WHOLE_MODEL_MAX_BYTES = 512 * 2**20


def model_bytes(model: Streamed) -> int:
    """The checkpoint's size in the evaluation dtype."""
    element = torch.empty((), dtype=model.dtype).element_size()
    return sum(math.prod(model.reader.meta(name).shape) for name in model.reader.names) * element


def _whole_model_logits(model: Streamed, ids: Sequence[int]) -> torch.Tensor:
    kwargs = {"attn_implementation": model.attn_implementation} if model.attn_implementation else {}
    if model.stated_config is not None:  # read as the streamed evaluator reads it
        kwargs["config"] = copy.deepcopy(model.stated_config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            whole = hf_compat.auto_model_class(model.config).from_pretrained(
                str(model.folder), dtype=model.dtype, trust_remote_code=False, **kwargs
            )
    except Exception as exc:
        raise OtdusError(
            f"self-check: transformers cannot load {model.folder} whole to check the streamed evaluator "
            f"against it: {exc.__class__.__name__}: {exc}"
        ) from None
    whole = whole.to(model.device).eval()
    with torch.inference_mode():
        ids_t = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
        logits = whole(input_ids=ids_t, use_cache=False).logits[0].cpu()
    del whole
    return logits


@torch.inference_mode()
def forward_logits_layer_by_layer(model: Streamed, ids: Sequence[int]) -> torch.Tensor:
    """Logits [T, V] of one input by the family's own forward in one call, each decoder layer loaded
    when the forward reaches it (the stand-ins hand the call to the real layer): no recorded
    arguments, no injected states. The reference for models too large to load whole."""
    calls, weights = model.calls, model.weights

    def delegate(index: int, hidden_states: torch.Tensor, kwargs: dict):
        if index == 0 and weights.stages_split:
            weights.load_shell("head")  # the input embeddings are done with: never hold both
        layer = weights.load_layer(index)
        try:
            return layer(hidden_states, **kwargs)
        finally:
            weights.free_layer(index)

    weights.load_shell("embed")
    calls.mode, calls.delegate = "delegate", delegate
    try:
        ids_t = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
        return model.model(input_ids=ids_t, use_cache=False, **hf_compat.logits_only(model.model)).logits[0]
    finally:
        calls.mode, calls.delegate = "record", None
        weights.free_shell()


def reference_logits(
    model: Streamed, ids: Sequence[int], whole_model_only: bool = False
) -> tuple[torch.Tensor, str] | None:
    """transformers' own logits [T, V] for ``ids`` (CPU) and how they were computed; None when the model
    is too large to load whole and ``whole_model_only``."""
    if model_bytes(model) <= WHOLE_MODEL_MAX_BYTES:
        return _whole_model_logits(model, ids), "from_pretrained and forward of the whole model"
    if whole_model_only:
        return None
    how = "its forward with each decoder layer loaded in turn"
    return forward_logits_layer_by_layer(model, ids).cpu(), how


def check_logits(model: Streamed, streamed: torch.Tensor, reference: torch.Tensor, how: str) -> None:
    """Refuse (OtdusError) unless ``streamed`` equals ``reference`` bit for bit (NaN where NaN)."""
    import transformers  # heavy import

    streamed = streamed.cpu()
    if streamed.shape == reference.shape:
        same = (streamed == reference) | (streamed.isnan() & reference.isnan())
        if bool(same.all()):
            return
        diff = (streamed.double() - reference.double()).abs().nan_to_num(math.inf)
        detail = f"max |diff| {float(diff.max()):.3g}"
    else:
        detail = f"shape {tuple(streamed.shape)} vs {tuple(reference.shape)}"
    raise OtdusError(
        f"self-check failed: the streamed evaluator's logits for {model.folder.name} differ from "
        f"transformers' own ({how}; {detail} on {reference.shape[0]} tokens; transformers "
        f"{transformers.__version__}, {model.device} {str(model.dtype).replace('torch.', '')}); "
        "no figures from an evaluator that does not reproduce the model"
    )
