"""Which template describes a checkpoint: an exact one (families.py) by its model_type, else one read
off transformers' own class and proved on a tiny instance (arch/derived.py, derived_roles.py,
identity.py), else the generic copy-only one where the user allows it."""

from __future__ import annotations

import functools
import json

from otdus_cli.arch.families import FAMILIES, Family
from otdus_cli.arch.wrappers import TEXT_FAMILY_ALIASES, text_config
from otdus_cli.errors import OtdusError

# Used only with --allow-unknown-arch, for methods that copy layers whole.
GENERIC = Family("generic", (), {}, zero_init=(), derives_layer_types=True, copy_only=True)


def derived_family(config: dict) -> Family:
    """The template transformers' own class gives a model_type without an exact one (arch/derived.py):
    its layer kinds, the config fields that follow them, and the zero-init targets proved on a tiny
    instance (arch/identity.py)."""
    return _derived_family(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _derived_family(config_json: str) -> Family:
    from otdus_cli.arch.derived import derive_template
    from otdus_cli.arch.derived_roles import derive_roles
    from otdus_cli.arch.identity import prove_identity
    from otdus_cli.arch.tiny import tiny_instance

    config = json.loads(config_json)
    found = derive_template(config)
    kinds = tuple(found["kinds"])
    instance = tiny_instance(config)  # both proofs run on it (each puts back what it changes)
    proof = prove_identity(instance, found["layer_list"], list(kinds))
    roles = derive_roles(config, found, instance)
    template = roles.template  # the exact template whose roles (traits, norms, fused tensors) it took
    return Family(
        f"derived:{found['model_type']}",
        (found["model_type"],),
        dict(template.roles) if template else {},
        norm_offset=template.norm_offset if template else 0.0,
        fused=dict(template.fused) if template else {},
        traits=template.traits if template else frozenset(),
        role_kinds=frozenset(roles.layers),
        roles_proof=roles.record(),
        role_modules=roles.modules,
        zero_init=() if proof.failure else proof.patterns(),
        derives_layer_types=found["derives_layer_types"],
        layer_prefix=found["layer_list"] + ".{i}.",  # on disk as in memory, or a wrapper's (io/stack.py)
        layer_kind=lambda _config, index: kinds[index],
        copy_only=True,
        per_layer_fields=tuple(found["per_layer_fields"]),
        index_fields=tuple(found["index_fields"]),
        numbered_from_one=tuple(found["numbered_from_one"]),
        zero_init_proof=None if proof.failure else proof.record(),
        zero_init_note=proof.failure or "",
        identity_values=() if proof.failure else proof.value_patterns(),
        derived=True,
        numbered_names=found["numbered_names"],
    )


_BY_MODEL_TYPE = {mt: fam for fam in FAMILIES for mt in fam.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def family_for(config: dict, allow_unknown: bool = False) -> Family:
    """Pick the template for a config's decoder stack (a wrapper's: its text config's), refusing
    quantized or unknown checkpoints."""
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise OtdusError(
            f"quantized checkpoints are not supported (quant_method={method}); use the unquantized model"
        )
    model_type = text_config(config).get("model_type", config.get("model_type"))
    if not isinstance(model_type, str):
        raise OtdusError(f"config.json: model_type must be a string, got {json.dumps(model_type)[:60]}")
    model_type = TEXT_FAMILY_ALIASES.get(model_type, model_type)
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    from otdus_cli.arch.derived import derivable

    if derivable(config.get("model_type", "")):
        return derived_family(config)
    if allow_unknown:
        return GENERIC
    raise OtdusError(
        f"unknown architecture model_type={model_type!r}: neither an exact template "
        f"({', '.join(supported_model_types())}) nor a causal LM of the installed transformers "
        "(--allow-unknown-arch copies layers generically for copy-type methods)"
    )
