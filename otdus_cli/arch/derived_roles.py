"""The roles (q/k/v/o, gate/up/down, norms) of a derived template's layer kinds: matched by name, proved.

OT-DUS and LESA compute new tensors role by role. A template read off transformers' class
(arch/derived.py) names no roles, so each of its layer kinds is matched against the roles of the exact
dense templates (families.py): a kind takes a template's roles when every role's weight is in its
layers, every tensor of its attention and MLP is a role's weight or bias (tensors outside them, a
sublayer of its own, are its extras: the methods average them), and the shapes are those the config
gives as the methods read it (q rows = num_attention_heads x head_dim ...); a template's output norms
and its MLP's gate may be absent (match_template). It then inherits that template's traits and norm
offset, so each method's ``refuses`` table applies as for the template.

The match is proved on the tiny instance zero-init is proved on (arch/identity.py), one layer per kind:

* permuting the layer's attention heads (the KV heads, with the query heads of each GQA group, and
  within each group), the dimensions of its value heads, and its MLP neurons by the roles (q/k/v rows
  and o columns per head; gate/up rows and down columns per neuron) leaves its output unchanged: a
  tensor the names do not explain (a per-head parameter left in place, a head split of another size)
  changes it. Allclose in float32, not bitwise: the permutation changes the order of the sums;
* its norms scale by their weight w, or by 1 + w (Gemma's), which the kind then takes as its norm
  offset whatever the template's;
* a pre-norm template's norms read the residual stream in sequence: with o zeroed the MLP's norm reads
  the layer's input, and with o in place it does not (so attention and MLP do not run in parallel).

A kind that matches no template, or whose match is not proved, keeps no roles; the reason is recorded,
and the methods that need roles refuse its layers in one line (check_role_kinds). Mixture-of-experts
kinds get none: their experts would need an expert layout (arch/experts.py), which only exact
templates have.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

from otdus_cli.arch.families import (
    CROSS_ATTENTION,
    FAMILIES,
    PARALLEL_BLOCKS,
    POST_NORM,
    UNGATED_MLP,
    Family,
)
from otdus_cli.arch.heads import Heads
from otdus_cli.arch.tiny import PROOF_TOKENS, TinyInstance, tiny_ids
from otdus_cli.arch.wrappers import text_config
from otdus_cli.errors import OtdusError
from otdus_cli.plan.layer_map import index_ranges, layer_kinds

# float32 tolerance of the permutation check, relative to the layer output's largest magnitude
PERMUTATION_TOLERANCE = 1e-5
_HIDDEN_NORMS = ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm")
_HEAD_NORMS = ("q_norm", "k_norm")
_OUTPUT_NORMS = ("attn_out_norm", "mlp_out_norm")  # a sublayer's output normed before the residual add
# other names transformers' classes give a role's module (HunYuan's query_layernorm for q_norm, NanoChat's
# fc1 and fc2 for an ungated MLP's up and down, Apertus's attention_layernorm and feedforward_layernorm;
# OPT's and XGLM's out_proj, self_attn_layer_norm, final_layer_norm, fc1 and fc2)
_ROLE_ALIASES = {
    "attn_norm": ("attention_layernorm", "self_attn_layer_norm"),
    "mlp_norm": ("feedforward_layernorm", "final_layer_norm"),
    "o": ("self_attn.out_proj",),
    "q_norm": ("self_attn.query_layernorm",),
    "k_norm": ("self_attn.key_layernorm",),
    "up": ("mlp.fc1", "fc1"),
    "down": ("mlp.fc2", "fc2"),
}


@dataclass
class RoleProof:
    """Which layer kinds took which template's roles, and how that was shown; why the others did not."""

    template: Family | None = None  # the exact template whose roles the proved kinds took
    layers: dict[str, int] = field(default_factory=dict)  # proved kind -> the layer the proof ran on
    # proved kind -> its tensors outside the attention and MLP that are no role (extra_tensors)
    extras: dict[str, list[str]] = field(default_factory=dict)
    # kind -> its norms without weight, role -> module path (weightless_norms)
    weightless: dict[str, dict[str, str]] = field(default_factory=dict)
    unmatched: dict[str, str] = field(default_factory=dict)  # kind -> why it has no roles
    instance: str = ""
    # the roles' module paths in transformers' class, where the template's roles (as saved) differ
    modules: dict[str, str] | None = None

    def record(self) -> dict:
        """The proof as the manifest records it."""
        return {
            "check": "names: every tensor of the layer's attention and MLP is a role's weight or bias of "
            "the template (the others, its extras, are averaged), shapes as the config gives them; proof: "
            "permuting one layer's attention heads (by KV group and within it), value-head dimensions and "
            "MLP neurons by these roles leaves its output unchanged (float32, relative tolerance "
            f"{PERMUTATION_TOLERANCE:g}, {PROOF_TOKENS} random tokens); its norms scale by w (norm_offset 0) "
            "or 1 + w (1); a pre-norm layer's norms read the residual stream in sequence",
            "instance": self.instance,
            "template": self.template.name if self.template else None,
            "roles": dict(self.template.roles) if self.template else {},
            "norm_offset": self.template.norm_offset if self.template else None,
            **({"modules": dict(self.modules)} if self.modules else {}),
            "kinds": {
                kind: {
                    "layer": layer,
                    **({"extras": self.extras[kind]} if self.extras.get(kind) else {}),
                    **({"weightless_norms": self.weightless[kind]} if self.weightless.get(kind) else {}),
                }
                for kind, layer in self.layers.items()
            },
            **({"unmatched": dict(self.unmatched)} if self.unmatched else {}),
        }

    def note(self) -> str:
        """Why kinds have no roles, in one line."""
        return "; ".join(f"{kind}: {why}" for kind, why in self.unmatched.items())


def role_templates() -> list[Family]:
    """The exact dense templates, one per distinct set of roles (llama stands for mistral, qwen2 ...)."""
    seen: dict[tuple, Family] = {}
    for fam in FAMILIES:
        if fam.roles and not fam.moe and not fam.has(CROSS_ATTENTION):
            key = (
                tuple(sorted(fam.roles.items())),
                tuple(sorted(fam.fused.items())),
                fam.traits,
                fam.norm_offset,
            )
            seen.setdefault(key, fam)
    return list(seen.values())


def match_template(tensors: dict[str, list[int]]) -> tuple[Family | None, str]:
    """The template whose roles are exactly a layer's tensors (names -> shapes), or None and why not (with
    the template whose roles explain most of them). A pre-norm template's output norms are optional: a
    layer without them (VaultGemma: Gemma 2's layer without its post-norms; GLM: GLM-4's) takes its
    other roles, which the methods read as for a template that has none (llama's). So is a gated
    template's gate where the layer has up and down alone (an ungated MLP: the methods then read up and
    down, UNGATED_MLP). A role's module may
    go by another name (_ROLE_ALIASES); the permutation proof shows it plays the role. Tensors outside the
    template's attention and MLP modules may be no role (extra_tensors: a sublayer of its own, Gemma 4's
    per-layer input), and a sequential pre-norm template's norms may hold no weight (weightless_norms);
    of the templates that match, the one with the fewest extra tensors, then roles left out, is taken."""
    matched: list[tuple[tuple[int, int], Family]] = []
    closest: tuple[tuple[int, int], Family, list[str], list[str]] | None = None
    for template in role_templates():
        fam = template
        renamed = {
            role: alias
            for role, path in fam.roles.items()
            if f"{path}.weight" not in tensors
            for alias in _ROLE_ALIASES.get(role, ())
            if f"{alias}.weight" in tensors
        }
        if renamed:
            fam = replace(fam, roles={**fam.roles, **renamed})
        absent = {r for r in _OUTPUT_NORMS if r in fam.roles and f"{fam.roles[r]}.weight" not in tensors}
        absent |= set(weightless_norms(fam, tensors))
        if absent and not fam.has(POST_NORM):
            fam = replace(fam, roles={r: p for r, p in fam.roles.items() if r not in absent})
        if _ungated(fam, tensors):
            roles = {r: p for r, p in fam.roles.items() if r != "gate"}
            fam = replace(fam, roles=roles, traits=fam.traits | {UNGATED_MLP})
        missing = [path for path in fam.roles.values() if f"{path}.weight" not in tensors]
        unexplained = _unexplained(fam, tensors)
        extra = extra_tensors(fam, {name: tensors[name] for name in unexplained})
        if not missing and len(extra) == len(unexplained):
            matched.append(((len(extra), len(template.roles) - len(fam.roles)), fam))
            continue
        score = (len(unexplained), len(missing))
        if closest is None or score < closest[0]:
            closest = (score, fam, missing, unexplained)
    if matched:
        return min(matched, key=lambda m: m[0])[1], ""
    assert closest is not None
    _, fam, missing, unexplained = closest
    if not missing and (second := _second_attention(fam, unexplained)):
        return None, (
            f"it holds a second attention ({', '.join(second)}: an encoder-decoder's cross-attention), for "
            "which the role-wise methods know no roles"
        )
    if len(unexplained) == len(tensors):
        return None, f"its tensors ({_listed(list(tensors), '')}) are no exact template's roles"
    parts = [f"no {_listed(missing, '')}" if missing else "", _listed(unexplained, " not its roles")]
    return (
        None,
        f"its tensors are no exact template's roles (closest, {fam.name}: "
        f"{'; '.join(p for p in parts if p)})",
    )


def weightless_norms(fam: Family, tensors) -> dict[str, str]:
    """The attention and MLP norms (role -> module path) of a sequential pre-norm template ``fam`` whose
    weight the layer lacks: OLMo's LayerNorm has no parameters. They scale by nothing the methods could
    align; the proof finds their modules in the layer and shows them read the residual stream in
    sequence (a template whose order it cannot show, parallel or post-norm, keeps them required)."""
    if fam.has(POST_NORM) or fam.has(PARALLEL_BLOCKS) or "mlp_norm" not in fam.roles:
        return {}
    return {r: fam.roles[r] for r in ("attn_norm", "mlp_norm") if f"{fam.roles[r]}.weight" not in tensors}


def _unexplained(fam: Family, names) -> list[str]:
    """The tensors of ``names`` that are no role's weight or bias."""
    paths = set(fam.roles.values())
    return [
        name
        for name in names
        if not (name.rsplit(".", 1)[0] in paths and name.rsplit(".", 1)[-1] in ("weight", "bias"))
    ]


def extra_tensors(fam: Family, tensors: dict[str, list[int]]) -> list[str]:
    """The tensors of ``tensors`` (names -> shapes) outside ``fam``'s attention and MLP modules (the first
    part of a role's path, self_attn and mlp), or of one element anywhere (Apertus's activation holds
    two scalars): no per-head or per-neuron parameter can hide in them, and the permutation proof would
    still show one. The methods average them plainly (OT: no alignment defined for them). A second
    attention (projections named as the attention's) is none: its heads would need roles of their own."""
    modules = {path.split(".")[0] for path in fam.roles.values() if "." in path}
    second = _second_attention(fam, tensors)
    return [
        name
        for name, shape in tensors.items()
        if (name.split(".")[0] not in modules or math.prod(shape) <= 1) and name.split(".")[0] not in second
    ]


def _second_attention(fam: Family, names) -> list[str]:
    """The modules among ``names``' that hold projections named as ``fam``'s attention's (q_proj, k_proj,
    v_proj: BART's encoder_attn beside its self_attn)."""
    leaves = {fam.roles[r].rsplit(".", 1)[-1] for r in ("q", "k", "v") if r in fam.roles}
    found = [name.rsplit(".", 2) for name in names if name.count(".") >= 2]
    return sorted({parts[0] for parts in found if parts[1] in leaves})


def _ungated(fam: Family, tensors: dict[str, list[int]]) -> bool:
    """Whether the layer is ``fam``'s with an MLP of up and down alone (Arcee's, Nemotron's: act(up x)
    into down): the template's own gate is not among its tensors, its up and down are. Its MLP neurons
    are still (up row, down column) pairs, which the permutation proof checks."""
    if "gate" not in fam.roles or "gate" in {p for parts in fam.fused.values() for p in parts}:
        return False
    return f"{fam.roles['gate']}.weight" not in tensors and all(
        f"{fam.roles[r]}.weight" in tensors for r in ("up", "down")
    )


def _listed(names: list[str], what: str) -> str:
    if not names:
        return ""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{', '.join(names[:3])}{more}{what}"


def shape_error(fam: Family, tensors: dict[str, list[int]], config: dict) -> str | None:
    """Why the layer's role tensors do not have the shapes ``config`` gives them as the methods read it
    (arch/heads.py: Heads.from_config), or None."""
    try:
        heads = Heads.from_config(config)
    except (OtdusError, KeyError, TypeError, ValueError) as exc:
        return f"its config gives no attention geometry the methods can read ({exc})"
    q, kv = heads.n_q * heads.head_dim, heads.n_kv * heads.head_dim

    def shape(role: str) -> list[int]:
        return tensors[f"{fam.roles[role]}.weight"]

    hidden, inter = shape("o")[0], shape("down")[-1]
    rows = {"q": q, "k": kv, "v": kv, "gate": inter, "up": inter}
    want = {role: [rows[role], hidden] for role in rows if role in fam.roles}
    want |= {fused: [sum(rows[p] for p in parts), hidden] for fused, parts in fam.fused.items()}
    want |= {"o": [hidden, q], "down": [hidden, inter]}
    want |= {n: [hidden] for n in _HIDDEN_NORMS if n in fam.roles}
    want |= {n: [heads.head_dim] for n in _HEAD_NORMS if n in fam.roles}
    for role, expected in want.items():
        path = fam.roles[role]
        got = {"weight": tensors[f"{path}.weight"], "bias": tensors.get(f"{path}.bias")}
        for kind, need in (("weight", expected), ("bias", expected[:1])):
            if got[kind] is not None and list(got[kind]) != need:
                return (
                    f"{path}.{kind} has shape {list(got[kind])}, not the {need} its config gives "
                    f"(num_attention_heads={heads.n_q}, num_key_value_heads={heads.n_kv}, "
                    f"head_dim={heads.head_dim}) as {fam.name}'s roles read it"
                )
    return None


def derive_roles(config: dict, found: dict, instance: TinyInstance | Exception) -> RoleProof:
    """Match every layer kind of the derived template ``found`` (arch/derived.py: derive_template) against
    the exact templates' roles and prove the matches on the tiny ``instance`` (arch/tiny.py: tiny_instance).
    Roles are optional (copy-type methods and zero-init need none): a derivation that fails leaves every
    kind without."""
    try:
        return _derive_roles(config, found, instance)
    except Exception as exc:
        why = f"deriving its roles failed ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
        return RoleProof(unmatched=dict.fromkeys(found["kinds"], why))


def _derive_roles(config: dict, found: dict, instance: TinyInstance | Exception) -> RoleProof:
    from otdus_cli.arch.modules import modules_of

    proof = RoleProof()
    text = text_config(config)
    matched: dict[str, Family] = {}
    for kind, tensors in found["tensors"].items():
        if any(".experts." in name or name.startswith("experts.") for name in tensors):
            proof.unmatched[kind] = (
                "a mixture-of-experts layer: its experts would need an expert layout (arch/experts.py), "
                "which only exact templates have"
            )
            continue
        fam, why = match_template(tensors)
        why = why or shape_error(fam, tensors, text)
        if why:
            proof.unmatched[kind] = why
        else:
            matched[kind] = fam
    if not matched:
        return proof
    templates = [fam.name for fam in matched.values()]
    chosen = max(dict.fromkeys(templates), key=templates.count)
    for kind, fam in list(matched.items()):
        if fam.name != chosen:
            proof.unmatched[kind] = (
                f"its roles are {fam.name}'s, other kinds' {chosen}'s (one template per model)"
            )
            del matched[kind]
    template = next(iter(matched.values()))
    if isinstance(instance, Exception):
        why = f"no tiny instance to prove them on ({type(instance).__name__})"
        proof.unmatched |= dict.fromkeys(matched, why)
        return proof
    model, proof.instance, _ = instance

    tiny_text = model.config.get_text_config().to_dict()
    original = next(t for t in role_templates() if t.name == template.name)  # as families.py writes it
    layers = modules_of(model, found["layer_list"])
    ids = tiny_ids(model, seed=2)
    offsets: dict[str, float] = {}
    for kind in matched:
        index = found["kinds"].index(kind)
        layer = layers[index]
        tensors = {name: list(p.shape) for name, p in layer.named_parameters()}
        try:
            why = shape_error(template, tensors, tiny_text)
            offset = None if why else _norm_offset(layer, template)
            if isinstance(offset, str):
                why = offset
            elif offset is not None:
                offsets[kind] = offset
                weightless = {
                    r: original.roles[r]
                    for r in ("attn_norm", "mlp_norm")
                    if r in original.roles and r not in matched[kind].roles
                }
                why = _prove(model, layer, replace(template, norm_offset=offset), tiny_text, ids, weightless)
                proof.weightless[kind] = weightless
        except Exception as exc:
            why = f"layer {index} did not run on the tiny instance ({type(exc).__name__})"
        if why:
            proof.unmatched[kind] = f"{template.name}'s roles by name, but on the tiny instance {why}"
        else:
            proof.layers[kind] = index
            proof.extras[kind] = _unexplained(matched[kind], found["tensors"][kind])
    if not proof.layers:
        return proof
    # norms that scale by w or by 1 + w (Gemma's): the kinds that take roles share one
    offset = offsets[next(iter(proof.layers))]
    for kind in [k for k in proof.layers if offsets[k] != offset]:
        proof.unmatched[kind] = (
            "its norms scale by another gain (w or 1 + w) than the other kinds' with roles"
        )
        del proof.layers[kind]
    if offset != template.norm_offset:
        template = replace(template, norm_offset=offset)
    first = min(proof.layers.values())
    stored = _stored_roles(model, f"{found['layer_list']}.{first}.", first, template.roles)
    if isinstance(stored, str):
        proof.unmatched |= dict.fromkeys(proof.layers, stored)
        proof.layers = {}
        return proof
    if stored != template.roles:
        proof.template, proof.modules = replace(template, roles=stored), dict(template.roles)
    else:
        proof.template = template
    return proof


def _stored_roles(model, prefix: str, index: int, roles: dict[str, str]) -> dict[str, str] | str:
    """The roles under the names transformers saves them (arch/saved_names.py: EXAONE's
    ``attn.attention.q_proj``), which is how a checkpoint it saved holds them; or why they are not
    saved one tensor each."""
    from otdus_cli.arch.saved_names import saved_names

    state = model.state_dict()
    names = [f"{prefix}{path}.{kind}" for path in roles.values() for kind in ("weight", "bias")]
    renamed = saved_names(model, {n: state[n] for n in names if n in state})
    out = {}
    for role, path in roles.items():
        saved = renamed.get(f"{prefix}{path}.weight", [f"{prefix}{path}.weight"])
        parts = saved[0].split(".")
        numbered = [i for i, part in enumerate(parts) if part == str(index)]
        if len(saved) != 1 or not numbered or not saved[0].endswith(".weight"):
            return f"transformers saves {path}.weight as {', '.join(saved)}, not one tensor of the layer"
        out[role] = ".".join(parts[numbered[0] + 1 : -1])
    return out


def _prove(model, layer, fam: Family, config: dict, ids, weightless: dict[str, str]) -> str | None:
    """Why ``layer`` does not compute as ``fam``'s roles say (see module), or None; ``weightless``: its
    norms without weight, role -> module path (weightless_norms)."""
    for role, path in weightless.items():
        try:
            norm = layer.get_submodule(path)
        except AttributeError:
            return f"it has no {path} (the {role} of {fam.name}'s roles, here without weight)"
        if any(True for _ in norm.parameters()):
            return f"{path} holds parameters but no weight"
    return _sequence_error(model, layer, fam, ids, weightless) or _permutation_error(
        model, layer, fam, config, ids
    )


def _permutation_error(model, layer, fam: Family, config: dict, ids) -> str | None:
    import torch

    heads = Heads.from_config(config)
    params = dict(layer.named_parameters())
    inter = params[f"{fam.roles['down']}.weight"].shape[-1]
    kv = torch.arange(heads.n_kv).flip(0)
    within = torch.arange(heads.group).roll(1)
    query = torch.tensor(
        [int(kv[p // heads.group]) * heads.group + int(within[p % heads.group]) for p in range(heads.n_q)]
    )
    neurons = torch.randperm(inter, generator=torch.Generator().manual_seed(0))
    by_role = {"q": query, "k": kv, "v": kv, "gate": neurons, "up": neurons}
    size = {"q": heads.head_dim, "k": heads.head_dim, "v": heads.head_dim, "gate": 1, "up": 1}

    # the dimensions of a value head, which only o's columns read (OT's structured variant aligns them)
    value_dims = torch.arange(heads.head_dim).flip(0)

    def rows(role: str, t):  # whole heads (or neurons) of rows, reordered
        units = t.reshape(len(by_role[role]), size[role], *t.shape[1:])[by_role[role]]
        return (units[:, value_dims] if role == "v" else units).reshape(t.shape)

    def permuted(role: str, kind: str, t):
        if role in fam.fused:
            parts = fam.fused[role]
            sizes = [len(by_role[p]) * size[p] for p in parts]
            return torch.cat([rows(p, piece) for p, piece in zip(parts, t.split(sizes), strict=True)])
        if role in by_role:
            return rows(role, t)
        if kind == "weight" and role == "o":
            cols = t.reshape(t.shape[0], heads.n_q, heads.head_dim)[:, query][:, :, value_dims]
            return cols.reshape(t.shape)
        if kind == "weight" and role == "down":
            return t[:, neurons]
        return t

    reference = _layer_output(model, layer, ids)
    saved = {name: p.detach().clone() for name, p in params.items()}
    changed = []
    try:
        with torch.no_grad():
            for role, path in fam.roles.items():
                for kind in ("weight", "bias"):
                    if f"{path}.{kind}" in params:
                        p = params[f"{path}.{kind}"]
                        p.copy_(permuted(role, kind, p.detach().clone()))
                        changed += [f"{path}.{kind}"] if not torch.equal(p, saved[f"{path}.{kind}"]) else []
        output = _layer_output(model, layer, ids)
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)
    if not changed:
        return "permuting its heads and neurons changes none of its tensors (nothing to prove it on)"
    diff = float((output - reference).abs().max())
    bound = PERMUTATION_TOLERANCE * max(1.0, float(reference.abs().max()))
    if diff > bound:
        return (
            f"permuting its attention heads and MLP neurons by them changes the layer's output (by up to "
            f"{diff:.2g}): other tensors or another head split take part"
        )
    return None


def _layer_output(model, layer, ids):
    import torch

    seen = {}

    def keep(_module, _args, output) -> None:
        seen["out"] = (output[0] if isinstance(output, tuple | list) else output).detach().clone()

    hook = layer.register_forward_hook(keep)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
    return seen["out"]


def _norm_offset(layer, fam: Family) -> float | str:
    """The gain of the layer's norms: 0.0 where a norm multiplies by its weight w (a zero weight gives
    zeros), 1.0 where by 1 + w (Gemma's: a zero weight gives half what a weight of ones does); else why
    neither. Every norm role of ``fam`` must agree."""
    import torch

    found: set[float] = set()
    for role in _HIDDEN_NORMS:
        if role not in fam.roles:
            continue
        norm = layer.get_submodule(fam.roles[role])
        own = dict(norm.named_parameters(recurse=False))
        saved = {name: p.detach().clone() for name, p in own.items()}
        x = torch.randn(1, 3, saved["weight"].shape[0], generator=torch.Generator().manual_seed(3))
        try:
            with torch.no_grad():
                for p in own.values():
                    p.zero_()
                at_zero = norm(x)
                own["weight"].fill_(1.0)
                at_one = norm(x)
        finally:
            with torch.no_grad():
                for name, value in saved.items():
                    own[name].copy_(value)
        if not at_zero.any():
            found.add(0.0)
        elif torch.allclose(at_one, 2 * at_zero, rtol=1e-5, atol=1e-6):
            found.add(1.0)
        else:
            return f"{fam.roles[role]} scales its output by neither its weight w nor 1 + w"
    if len(found) > 1:
        return "its norms scale some by w, some by 1 + w"
    return found.pop() if found else fam.norm_offset


def _sequence_error(model, layer, fam: Family, ids, weightless: dict[str, str]) -> str | None:
    """A pre-norm sequential template's: the attention norm reads the layer's input; the MLP norm reads
    it plus the attention's output (so the layer's input itself once o is zeroed). Its norms are the
    roles', or the modules ``weightless`` names where they hold no weight."""
    import torch

    norms = {**weightless, **{r: fam.roles[r] for r in ("attn_norm", "mlp_norm") if r in fam.roles}}
    if fam.has(POST_NORM) or fam.has(PARALLEL_BLOCKS) or "mlp_norm" not in norms:
        return None
    zeroed = [p for name, p in layer.named_parameters() if name.startswith(fam.roles["o"] + ".")]

    def inputs(zero: bool) -> dict:
        seen: dict = {}

        def keep(name: str):
            def hook(_module, args, kwargs) -> None:
                first = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("hidden_states"))
                seen.setdefault(name, first.detach().clone())

            return hook

        modules = {
            "layer": layer,
            **{r: layer.get_submodule(norms[r]) for r in ("attn_norm", "mlp_norm")},
        }
        hooks = [m.register_forward_pre_hook(keep(r), with_kwargs=True) for r, m in modules.items()]
        saved = [p.detach().clone() for p in zeroed]
        try:
            with torch.no_grad():
                for p in zeroed if zero else []:
                    p.zero_()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model(input_ids=ids, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
            with torch.no_grad():
                for p, value in zip(zeroed, saved, strict=True):
                    p.copy_(value)
        return seen

    # the same entries in the same order: OPT's layer flattens the stream to (tokens, hidden) for its MLP
    plain, without = (
        {name: t.reshape(-1) for name, t in seen.items()} for seen in (inputs(False), inputs(True))
    )
    x = plain["layer"]
    if not torch.equal(plain["attn_norm"], x):
        return f"{norms['attn_norm']} does not read the layer's input (not a pre-norm layer)"
    if not torch.equal(without["mlp_norm"], x) or torch.equal(plain["mlp_norm"], x):
        return (
            f"{norms['mlp_norm']} does not read the residual stream after the attention (its input "
            "is not the layer's input plus the attention's output)"
        )
    return None


def check_role_kinds(source, layer_map: list, method: str, every_layer: bool = False) -> None:
    """The new layers ``method`` builds from roles come from parents whose kinds have them (a derived
    template's proved kinds; an exact template's roles describe every layer), stored under the roles'
    names; a method that learns from ``every_layer`` (LESA) needs them in all. OtdusError naming the
    first that does not, and what would work."""
    family, depth = source.family, source.depth
    if family.role_kinds is None:
        return
    kinds = layer_kinds(family, source.text_config, depth)
    unmatched = (family.roles_proof or {}).get("unmatched", {})
    if every_layer:
        lacking = [i for i, kind in enumerate(kinds) if kind not in family.role_kinds]
        if lacking:
            kind = kinds[lacking[0]]
            why = unmatched.get(kind, "none")
            raise OtdusError(
                f"--method {method} learns from the projections of every base layer, and base layers "
                f"{index_ranges(lacking)} of {family.name} ({kind}) have no roles ({why}); "
                "use ot between layers with roles, or copy, interpose, llama-pro, solar or stack"
            )
        parents = list(range(depth))
    else:
        for lay in layer_map:
            if not lay.new or len(lay.parents) < 2:
                continue
            kind = next((kinds[i] for i in lay.parents if kinds[i] not in family.role_kinds), None)
            if kind is None:
                continue
            fine = [i for i in range(depth - 1) if kinds[i] == kinds[i + 1] and kinds[i] in family.role_kinds]
            where = f"--after with any of {index_ranges(fine)}" if fine else "no layer pair here has them"
            raise OtdusError(
                f"--method {method}: new layer {lay.index} would be built from base layers "
                f"{', '.join(map(str, lay.parents))}, and {kind} layers have no roles "
                f"({unmatched.get(kind, 'none')}); place it between layers with roles ({where}), or use "
                "copy, interpose, llama-pro, solar or stack"
            )
        parents = sorted({i for lay in layer_map if lay.new for i in lay.parents})
    for i in parents:
        stored = set(source.layers[i].suffixes())
        absent = next((p for p in family.roles.values() if f"{p}.weight" not in stored), None)
        if absent is not None:
            raise OtdusError(
                f"--method {method}: layer {i} of the checkpoint holds no {absent}.weight, the name under "
                f"which the installed transformers saves that role of {family.name} layers (save the model "
                "again with this transformers), or use copy, interpose, llama-pro, solar or stack"
            )
