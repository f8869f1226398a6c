"""What the streamed evaluator relies on in transformers beyond its public API, in one place.

Tested with transformers 4.57.6 and 5.24.0 (see the README's compatibility section). Each helper
says what it uses and how the versions differ:

* Buffers (rotary ``inv_freq`` with any rope scaling, Gemma's ``embed_scale``): every family computes
  them in its modules' constructors, in both versions. 4.57's own loader keeps those values (it builds
  models with parameters on the meta device and real buffers); 5.x's builds on meta and recomputes them
  on the CPU with ``_init_weights``, which 4.57's ``_init_weights`` does not do (after ``to_empty``,
  ``inv_freq`` stays uninitialised memory there). So the skeleton is built with real buffers and meta
  parameters, and the evaluator copies those values: no private initialiser is called at all.
* Tied weights: both versions tie at construction (``post_init`` -> ``tie_weights``), so tied
  parameters are one ``Parameter`` object; they are read from identity, not from 5.x's
  ``all_tied_weights_keys`` (absent in 4.57) or 4.57's ``_tied_weights_keys`` (a different format).
  When a checkpoint also stores the tied copy (``lm_head.weight`` beside the embeddings), 5.x loads it
  as stored (it unties the two when they differ) and 4.57 ties it back to the embeddings
  (``loads_stored_tied_copies``).
* Multimodal wrappers (Gemma 3, LLaVA, Mistral 3, Qwen2.5-VL ...): some are causal LMs to the auto
  mapping (Gemma 3), others only image-text-to-text models (LLaVA, Qwen2.5-VL); both versions build
  them with ``AutoModelForImageTextToText``, whose text-only forward is what is scored
  (``auto_model_class``). Their module names (``model.language_model.layers.N``) differ from older
  saves' (``language_model.model.layers.N``), which both versions rename when loading; the evaluator
  maps names itself (``checkpoint_weights.CheckpointWeights.disk_name``), without their private
  conversion tables.
* Decoder layer outputs: 5.x layers return the hidden states; in 4.57 most do too, but Gemma 2/3,
  OLMoE and Qwen2-MoE return a tuple and their model takes ``layer_outputs[0]``; in both, a few return
  more beside them (CPM-Ant's attention weights; GLM-MoE-DSA's top-k indices, which the model hands
  to the next layer). The convention is learned from a real layer's output (``output_items``), not
  tabled per family and version.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from otdus_cli.errors import OtdusError

BufferValues = dict[nn.Module, dict[str, torch.Tensor]]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block goes to the meta device; buffers and all other
    tensors are computed for real on the CPU, so constructors fill the buffers as they always do.
    (A parameter's own ``torch.empty`` still happens on the CPU first: address space, never touched,
    given back at once.)"""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def auto_model_class(config):
    """The class that builds ``config``'s model: the causal-LM auto class, or for a multimodal wrapper
    that is no causal LM to transformers (LLaVA, Qwen2.5-VL), the image-text-to-text one; for a config
    no auto class maps (Mllama's text model, ``mllama_text_model``, saved as ``MllamaForCausalLM``),
    the transformers class its ``architectures`` names, where that class is built from such a config."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", None)
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if model_type in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    for name in getattr(config, "architectures", None) or []:
        named = getattr(transformers, name, None)
        if isinstance(named, type) and getattr(named, "config_class", None) is type(config):
            return named
    return AutoModelForCausalLM  # which says why it cannot


def from_config(config, **kwargs):
    """``config``'s model, built by ``auto_model_class`` (no remote code)."""
    from transformers import PreTrainedModel

    cls = auto_model_class(config)
    if issubclass(cls, PreTrainedModel):  # a named class: what the auto classes call in the end
        return cls._from_config(config, **kwargs)
    return cls.from_config(config, trust_remote_code=False, **kwargs)


def skeleton_config(config):
    """The config to build the evaluated model from: a wrapper's text config where transformers' causal
    LM for the wrapper is its text model's class (Llama 4: Llama4ForCausalLM, which 4.57 cannot build
    from the wrapper's config), else the config itself."""
    from transformers.models.auto import modeling_auto

    names = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    text = config.get_text_config()
    if (
        text is not config
        and names.get(config.model_type)
        and names.get(config.model_type) == names.get(text.model_type)
    ):
        return text
    return config


def build_skeleton(
    config, dtype: torch.dtype, attn_implementation: str | None
) -> tuple[nn.Module, BufferValues]:
    """The causal LM for ``config`` with its parameters on the meta device, and the value of every
    buffer as the constructors computed it (CPU tensors, per module and buffer name). The model's own
    buffers go to the meta device too: nothing is allocated until the evaluator loads it."""
    kwargs: dict = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with _parameters_on_meta(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = skeleton_config(config)
            model = from_config(config, **kwargs)
    except Exception as exc:
        raise OtdusError(f"cannot build {config.model_type} with transformers: {exc}") from None
    values: BufferValues = {}
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_meta:
                raise OtdusError(
                    f"{type(module).__name__}.{name}: transformers did not compute this buffer when "
                    f"building {config.model_type}; streaming this model is not supported"
                )
            values.setdefault(module, {})[name] = buf.detach().clone()
            module._buffers[name] = torch.empty_like(buf, device="meta")  # keeps tied parameters tied
    return model, values


def restore_buffers(module: nn.Module, values: BufferValues, recurse: bool = True) -> None:
    """Fill the buffers of ``module`` (and its submodules), already allocated on their device, with the
    constructor's values."""
    with torch.no_grad():
        for sub in module.modules() if recurse else (module,):
            for name, value in values.get(sub, {}).items():
                sub._buffers[name].copy_(value)


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """Tied parameters: each name that shares its ``Parameter`` with an earlier one -> that earlier name
    (e.g. ``lm_head.weight`` -> ``model.embed_tokens.weight``). Call it before any ``to_empty``, which
    gives each module its own copy."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def loads_stored_tied_copies() -> bool:
    """Whether a tied parameter that the checkpoint also stores under its own name is loaded from that
    tensor (5.x) rather than tied to its source (4.57)."""
    import transformers  # heavy import

    return int(transformers.__version__.split(".")[0]) >= 5


def output_items(layer_output) -> int:
    """How a decoder layer's forward returns: 0 for the hidden states alone, else the length of the tuple
    whose first item they are (4.57's 1-tuples; CPM-Ant's attention weights, GLM-MoE-DSA's top-k indices
    beside them in both versions)."""
    return len(layer_output) if isinstance(layer_output, tuple) else 0


def hidden_states_of(layer_output) -> torch.Tensor:
    """The hidden states in a decoder layer's output (a tensor, or the first item of a tuple)."""
    return layer_output[0] if isinstance(layer_output, tuple) else layer_output


def as_layer_output(hidden_states: torch.Tensor, items: int, others: Callable[[int], object]):
    """Hidden states shaped the way the family's model forward expects a decoder layer to return them:
    alone (``items`` 0), else a tuple of ``items`` with ``others(k)`` as item k >= 1."""
    return (hidden_states, *(others(k) for k in range(1, items))) if items else hidden_states


def logits_only(module: nn.Module) -> dict[str, bool]:
    """Keyword arguments asking ``module``'s forward for no more than its logits or hidden states, where
    it could return more: a config saved with ``output_router_logits`` (or attentions, hidden states)
    would have the stand-ins' outputs collected and a load-balancing loss computed from them."""
    names = inspect.signature(module.forward).parameters
    return {
        k: False for k in ("output_router_logits", "output_attentions", "output_hidden_states") if k in names
    }


def attention_materialises_scores(config) -> bool:
    """Whether the model's attention holds the full [heads, T, T] score matrix (eager attention), as
    the model was built (``_attn_implementation``, set by both versions when building a model)."""
    return getattr(config, "_attn_implementation", None) in (None, "eager")
