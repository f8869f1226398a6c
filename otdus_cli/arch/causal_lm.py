"""transformers' causal-LM class for a model_type, including a composite model's text sub-config.

The causal-LM auto mapping is keyed by the composite's model_type (``emu3`` -> Emu3ForCausalLM), but
that class is built from the text sub-config alone (Emu3TextConfig, model_type ``emu3_text_model``), and
a checkpoint it saves says ``emu3_text_model``, which the mapping does not name. Such a model_type gets
the class of the mapping entry from its own transformers module whose class is built from exactly its
config class (what AutoModelForCausalLM does when handed the composite config); no remote code.
"""

from __future__ import annotations

from functools import cache


@cache
def causal_lm_class_name(model_type: str) -> str | None:
    """The name of transformers' causal-LM class for ``model_type``, or None where it ships none."""
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as NAMES
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    if model_type in NAMES:
        return NAMES[model_type]
    try:
        config_class = CONFIG_MAPPING[model_type]
    except KeyError:
        return None
    module = model_type_to_module_name(model_type)
    for composite, name in NAMES.items():
        if model_type_to_module_name(composite) != module:
            continue
        cls = getattr(transformers, name, None)
        if getattr(cls, "config_class", None) is config_class:
            return name
    return None


def build_causal_lm(loaded):
    """transformers' causal LM for the config object ``loaded`` (on the current default device); what
    AutoModelForCausalLM.from_config raises where neither it nor causal_lm_class_name knows one."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(loaded, "model_type", None)
    name = causal_lm_class_name(model_type) if isinstance(model_type, str) else None
    if name is None or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM.from_config(loaded, trust_remote_code=False)
    return getattr(transformers, name)._from_config(loaded)
