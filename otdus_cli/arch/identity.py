"""Which tensors make a decoder layer an exact identity, found on transformers' own class and proved.

For an architecture without an exact template (arch/derived.py) the candidates are the tensors that
write into the residual stream: every linear map whose output has the model's hidden width (attention
and MLP output projections, a Mamba mixer's out_proj, shared experts ...) and fused expert tensors
with that width; where the stream is several streams of the config's hidden size side by side
(hyper-connections: Qwen4-Exp), the maps into that hidden size too, whose output the layer mixes into
each stream. On a tiny random instance of the class, one layer of each kind is run with all
candidates zeroed; its output must equal its input bit for bit. Candidates whose zeroing is not needed
for that (a q_proj behind a zeroed o_proj) are then given back one at a time, so only the
residual-writing ones are zeroed in a new layer: they are given back in the order the layer runs them
(a gate or input projection before the output projection it feeds). The instance is the config itself
when it is small, else the config with its widths shrunk (the layer kinds and their order are the
config's), its weights drawn at the scale of trained ones and its token selections (index_topk) narrowed
below the proof's length, so a layer that hands a later one another choice shows.

Where no zeroing makes a kind an identity, a second construction is tried: a residual path scaled by the
layer's own parameters (Doge: input_residual * x + f(x); Zaya: (x + residual_bias) * residual_scale) or
by a buffer the checkpoint stores (Gemma 4: (x + f(x)) * layer_scalar, trained away from its initial 1)
is an identity when those are at their identity value. The candidates are the vectors of the hidden
width outside norms and linear maps (those the first construction zeroes); the ones transformers
initialises to all ones are scales, set to 1, the others zeroed, and what the identity does not need is
given back as before. A new layer then gets those tensors at 1 (``set_to``) besides the zeroed ones.

A layer that hands the next one other states besides the hidden states (Zaya's router states: tensors
it returns that the next layer is called with) is asked to hand those on unchanged too, the tensors
that write into their widths being candidates as well; where no construction gets that (HunYuan V4's
routing indices), the hidden states alone, and the expanded tiny model's logits (prove_plan) judge.

A kind that neither construction makes an identity (a post-norm layer: output = norm(x + f(x)); a
residual path scaled by constants of the layer's index, or mixed with other streams) is recorded with the
reason, and new layers of that kind are refused zero-init; the others keep it. The targets are also
given under the names transformers saves them (arch/saved_names.py), which is how a checkpoint it
converts when loading stores them.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field, replace

from otdus_cli.arch.causal_lm import build_causal_lm
from otdus_cli.arch.identity_values import (
    ExpertChoiceBias,
    IdentityValue,
    describe_value,
    record_value,
    value_tensor,
)
from otdus_cli.arch.layer_run import LayerRun, is_norm
from otdus_cli.arch.modules import modules_of
from otdus_cli.arch.tiny import (
    AS_GIVEN,
    PROOF_TOKENS,
    TinyInstance,
    make_tiny_instance,
    seeded_logits,
    tiny_config,
    tiny_ids,
)
from otdus_cli.quiet import quiet_transformers


@dataclass
class IdentityProof:
    """What zeroing makes each layer kind an identity, and how that was shown (None: not shown)."""

    zeroed: dict[str, list[str]] = field(default_factory=dict)  # kind -> tensor names inside a layer
    # kind -> tensor name -> the value other than 0 it is set to (a residual scale: 1; an expert-choice
    # bias), where needed
    set_to: dict[str, dict[str, IdentityValue]] = field(default_factory=dict)
    # kind -> tensor name -> patterns of the names it is stored under (in memory, and as transformers saves)
    stored: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    layers: dict[str, int] = field(default_factory=dict)  # kind -> the layer the proof ran on
    unproved: dict[str, str] = field(default_factory=dict)  # kind -> why no zeroing makes it an identity
    instance: str = ""  # "the config as given" or "the config with widths shrunk"
    failure: str | None = None  # why no kind is proved (then ``zeroed`` is empty)
    layer_list: str = ""  # the decoder layers' module list in transformers' class

    def record(self) -> dict:
        """The proof as the manifest records it."""
        check = f"layer output equals its input bit for bit on {PROOF_TOKENS} random tokens, with these "
        check += "tensors zeroed" + (" and those under set_to set to that value" if self.set_to else "")
        if any(isinstance(v, ExpertChoiceBias) for values in self.set_to.values() for v in values.values()):
            check += f" (and again with the router's weights scaled {_SATURATION:g}-fold)"
        return {
            "check": check,
            "instance": self.instance,
            "layer_list": self.layer_list,
            "kinds": {
                k: {
                    "layer": self.layers[k],
                    "zeroed": v,
                    **(
                        {"set_to": {n: record_value(v) for n, v in self.set_to[k].items()}}
                        if self.set_to.get(k)
                        else {}
                    ),
                    "stored": self.stored.get(k, {}),
                }
                for k, v in self.zeroed.items()
            },
            **({"unproved": dict(self.unproved)} if self.unproved else {}),
        }

    def patterns(self) -> tuple[str, ...]:
        """The zero-init targets as tensor-name patterns within a layer (every name they are stored under)."""
        return tuple(
            dict.fromkeys(
                form
                for kind, names in self.zeroed.items()
                for n in names
                for form in self.stored.get(kind, {}).get(n) or expert_forms(n)
            )
        )

    def value_patterns(self) -> tuple[tuple[str, IdentityValue], ...]:
        """The tensors set to a value other than zero, as (pattern within a layer, value)."""
        return tuple(
            dict.fromkeys(
                (form, value)
                for kind, values in self.set_to.items()
                for n, value in values.items()
                for form in self.stored.get(kind, {}).get(n) or expert_forms(n)
            )
        )


def expert_forms(name: str) -> list[str]:
    """Patterns a zero-init target is stored under: its name as in memory, and a fused expert tensor
    also in its per-expert form (experts.N.<name>.weight, older saves)."""
    out = [re.escape(name)]
    m = re.fullmatch(r"(.*experts)\.(\w+)", name)
    if m:
        out.append(re.escape(m.group(1)) + r"\.\d+\." + re.escape(m.group(2)) + r"\.weight")
    return out


@quiet_transformers
def prove_identity(instance: TinyInstance | Exception, layer_list: str, kinds: list[str]) -> IdentityProof:
    """Find and prove the zero-init targets of every layer kind on the tiny ``instance`` of a config's
    model (tiny_instance; the exception when it could not be built) (see module)."""

    proof = IdentityProof(layer_list=layer_list)
    if isinstance(instance, Exception):
        proof.failure = (
            f"no tiny instance to prove it on ({type(instance).__name__}: {' '.join(str(instance).split())})"
        )
        return proof
    model, proof.instance, ones = instance
    layers = modules_of(model, layer_list)
    ids = tiny_ids(model, seed=0)
    for kind in dict.fromkeys(kinds):
        index = kinds.index(kind)
        prefix = f"{layer_list}.{index}."
        scales = {n[len(prefix) :] for n in ones if n.startswith(prefix)}
        try:
            targets = _prove_kind(LayerRun(model, layers, index, ids), index, kind, scales)
            proof.stored[kind] = _stored_forms(model, prefix, index, list(targets))
            for n, value in targets.items():  # the expert tensor counted, under every name it is stored
                if isinstance(value, ExpertChoiceBias):
                    counted = value.counted_by[0]
                    forms = _stored_forms(model, prefix, index, [counted])[counted]
                    targets[n] = replace(value, counted_by=tuple(forms))
        except _NoIdentity as exc:
            proof.unproved[kind] = str(exc)
            continue
        except Exception as exc:
            why = f"layer {index} ({kind}) did not run on the tiny instance ({type(exc).__name__})"
            proof.unproved[kind] = why
            continue
        proof.zeroed[kind] = [n for n, value in targets.items() if value == 0]
        proof.set_to[kind] = {n: value for n, value in targets.items() if value != 0}
        proof.layers[kind] = index
    _drop_disagreeing_kinds(proof)
    if not proof.zeroed:
        proof.failure = "; ".join(dict.fromkeys(proof.unproved.values()))
    return proof


class _NoIdentity(Exception):
    """Why no zeroing makes a layer kind an identity (a sentence for the user)."""


def _prove_kind(run: LayerRun, index: int, kind: str, scales: set[str]) -> dict[str, IdentityValue]:
    """The tensors of the layer ``run`` runs, and the values (0, or 1 for a scale among ``scales``: the
    vectors transformers initialises to ones), that make it an identity; fewest first given back."""
    found = [n for _, n in sorted(_residual_writers(run.layer, run.widths()), key=lambda u: run.order(u[0]))]
    # a vector may be a bias into the stream, or scale the residual itself (Doge's input_residual), which
    # zeroed breaks the identity: without the vectors too, before giving up; then with the scales at 1
    found += [[n] for n in sorted(scales & set(run.buffers))]  # a scale buffer: layer_scalar
    matrices = [u for u in found if not (len(u) == 1 and run.params[u[0]].dim() == 1)]
    zeros = {name: 0.0 for unit in found for name in unit}
    tries: list[tuple[list[list[str]], dict[str, IdentityValue]]] = [(found, zeros), (matrices, zeros)]
    if any(name in scales for unit in found for name in unit):
        tries.append((found, {name: 1.0 if name in scales else 0.0 for name in zeros}))
    # a router that also chooses experts without weights, which add their input back (LongCat-Flash's
    # zero-computation experts): kept from choosing them by its expert-choice bias (arch/identity_values.py)
    biases = _expert_choice_biases(run.params)
    if biases:
        tries.append((found + [[n] for n in biases], {**zeros, **{n: v for n, (v, _) in biases.items()}}))
    # the other states it hands on (Zaya's router states) unchanged too where some try gets that; else the
    # hidden states alone, and the plan's proof on the whole tiny model judges the rest (HunYuan V4's
    # routing indices differ, yet the next layer computes the same)
    checks = [True, False] if run.carried() else [True]
    chosen = next(
        ((u, v, states) for states in checks for u, v in tries if u and run.identity(_values(u, v), states)),
        None,
    )
    if chosen is None:
        every = [name for unit in matrices for name in unit]
        named = ", ".join(every) or "none"
        raise _NoIdentity(
            f"zeroing the tensors that may write into its residual stream ({named}) does not make layer "
            f"{index} ({kind}) an identity: {run.why_not(_values(matrices, zeros))}"
        )
    units, values, states = chosen
    kept = list(units)
    for unit in units:  # give back what the identity does not need
        trial = [u for u in kept if u is not unit]
        if run.identity(_values(trial, values), states):
            kept = trial
    targets = _values(kept, values)
    routers = [router for n, (_, router) in biases.items() if n in targets]
    if routers and not _saturated_identity(run, targets, routers, states):
        raise _NoIdentity(
            f"layer {index} ({kind}) is an identity only while its router's scores stay small: with the "
            f"router's weights ({routers[0]}) scaled {_SATURATION:g}-fold it chooses experts without weights "
            "even with their expert-choice bias low, so the bias is added to unbounded scores"
        )
    return targets


# how much the router's weights are scaled to saturate its scores (softmax and sigmoid reach 0 and 1)
_SATURATION = 100.0


def _expert_choice_biases(params: dict) -> dict[str, tuple[ExpertChoiceBias, str]]:
    """The vectors among a layer's ``params`` (its parameters and stored buffers) that bias a router's
    choice among experts of which only the first have weights, each with the value that keeps the others
    unchosen and the router's matrix: a vector beside a matrix with one row per choice, longer than the
    expert tensors of the layer are deep (LongCat-Flash: e_score_correction_bias of 512 + 256 choices,
    down_proj of 512 experts)."""
    experts = {n: p.shape[0] for n, p in params.items() if p.dim() == 3 and p.shape[0] > 1}
    out: dict[str, tuple[ExpertChoiceBias, str]] = {}
    for name, vector in params.items():
        if vector.dim() != 1 or not vector.is_floating_point():
            continue
        owner = name.rpartition(".")[0]
        within = owner + "." if owner else ""
        routers = [
            n for n, p in params.items() if n.startswith(within) and p.dim() == 2 and len(p) == len(vector)
        ]
        fewer = {n: count for n, count in experts.items() if count < len(vector)}
        if routers and fewer and len(set(fewer.values())) == 1:
            out[name] = (ExpertChoiceBias(counted_by=(next(iter(fewer)),)), routers[0])
    return out


def _saturated_identity(
    run: LayerRun, targets: dict[str, IdentityValue], routers: list[str], states: bool
) -> bool:
    """Whether the layer is still an identity with ``targets`` set and its ``routers``' weights scaled
    _SATURATION-fold (put back after)."""
    import torch

    saved = {n: run.params[n].detach().clone() for n in routers}
    try:
        with torch.no_grad():
            for n in routers:
                run.params[n].mul_(_SATURATION)
        return run.identity(targets, states)
    finally:
        with torch.no_grad():
            for n, value in saved.items():
                run.params[n].copy_(value)


def _values(units: list[list[str]], values: dict[str, IdentityValue]) -> dict[str, IdentityValue]:
    return {name: values[name] for unit in units for name in unit}


def _drop_disagreeing_kinds(proof: IdentityProof) -> None:
    """A new layer's tensors are written by name whatever its kind: a kind that sets a tensor to 1 which
    another kind zeroes is refused zero-init (the one written value would break one of them)."""
    zeroed = {n for names in proof.zeroed.values() for n in names}
    for kind, values in list(proof.set_to.items()):
        both = sorted(zeroed & set(values))
        if both:
            proof.unproved[kind] = (
                f"layer {proof.layers[kind]} ({kind}) is an identity with {both[0]} set to "
                f"{describe_value(values[both[0]])}, which a layer of another kind has zeroed"
            )
            for record in (proof.zeroed, proof.set_to, proof.stored, proof.layers):
                record.pop(kind, None)


def _stored_forms(model, prefix: str, index: int, targets: list[str]) -> dict[str, list[str]]:
    """For each target tensor of the layer at ``prefix``, the patterns (within a layer) of the names it is
    stored under: as in memory, and as transformers saves it when it converts the name (saved_names)."""
    from otdus_cli.arch.saved_names import SavedTogether, layer_suffix_patterns, saved_targets

    state = {k: v for k, v in model.state_dict().items() if k.startswith(prefix)}
    try:
        saved = saved_targets(model, state, [prefix + n for n in targets])
    except SavedTogether as exc:
        raise _NoIdentity(
            f"{exc}, so a checkpoint transformers saved holds it only within a larger tensor, which otdus "
            "does not set in part"
        ) from None
    out = {}
    for name in targets:
        patterns = layer_suffix_patterns(saved[prefix + name], index)
        if patterns is None:
            raise _NoIdentity(
                f"transformers saves {name} of layer {index} as {saved[prefix + name][0]}, outside that layer"
            )
        out[name] = list(dict.fromkeys([*expert_forms(name), *patterns]))
    return out


@quiet_transformers
def prove_plan(config: dict, written: dict, family, sources: list[int], zero_init: list[bool]) -> str | None:
    """Whether the expanded model computes the base function, shown on the tiny instance: the model
    ``written`` describes, with output layer j a copy of base layer ``sources[j]`` and, where
    ``zero_init[j]``, its tensors set as expand writes them (the derived ``family``'s zero-init targets
    zeroed, its identity values set: the patterns of every kind, as the writer matches them), gives the
    base's logits bit for bit. None when it does; else why not (a layer whose index enters its
    computation computes otherwise at its new position ...)."""
    import torch

    try:
        base, instance, _ = make_tiny_instance(config)
        # shrunk exactly when the base was: the base's tensors must fit the grown model
        shrunk = instance != AS_GIVEN
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grown = build_causal_lm(tiny_config(written, shrunk)[0]).float().eval()
    except Exception as exc:
        return f"no tiny instance of the expanded model to prove it on ({type(exc).__name__})"
    prefix = family.zero_init_proof["layer_list"] + "."
    state = base.state_dict()
    out = {}
    grown_shapes = {n: tuple(v.shape) for n, v in grown.state_dict().items()}
    depth = len(modules_of(base, family.zero_init_proof["layer_list"]))
    for name, value in state.items():
        if not name.startswith(prefix):
            out[name] = _slices_for(value, grown_shapes.get(name), depth, sources)
    for j, i in enumerate(sources):
        layer = {n[len(f"{prefix}{i}.") :]: v for n, v in state.items() if n.startswith(f"{prefix}{i}.")}
        shapes = {suffix: tuple(v.shape) for suffix, v in layer.items()}
        for suffix, value in layer.items():
            target = family.zero_init_value(suffix) if zero_init[j] else None
            held = (
                value if target is None else value_tensor(target, tuple(value.shape), shapes).to(value.dtype)
            )
            out[f"{prefix}{j}.{suffix}"] = held
    ids = tiny_ids(base, seed=1)
    try:
        grown.load_state_dict(out, strict=True)
        same = torch.equal(seeded_logits(base, ids), seeded_logits(grown, ids))
    except Exception as exc:
        return f"the expanded tiny model did not run ({type(exc).__name__})"
    if not same:
        from otdus_cli.arch.plan_differences import why_logits_differ
        from otdus_cli.arch.wrappers import text_config

        kept = [None if new else i for i, new in zip(sources, zero_init, strict=True)]
        layers = modules_of(base, prefix[:-1])
        return why_logits_differ(text_config(config), text_config(written), base, layers, ids, kept)
    return None


def _slices_for(value, shape: tuple | None, base_depth: int, sources: list[int]):
    """A tensor outside the layers as the grown model holds it: as it is, or where it holds a slice per
    layer (arch/layer_slices.py), each output layer's from its source's."""
    from otdus_cli.arch.layer_slices import select_slices, slices_of

    sliced = None if shape is None else slices_of(tuple(value.shape), shape, base_depth, len(sources))
    return value if sliced is None else select_slices(value, sliced, sources)


def _residual_writers(layer, widths: set[int]) -> list[tuple[str, list[str]]]:
    """Groups of tensor names that may write into the hidden width (or that of another state the layer
    hands on: ``widths``), each with the module that holds it: a linear map into it (weight and bias), a
    fused expert tensor into it (and its bias), a matrix with an axis of its width held outside a linear
    map (experts stored flat: DBRX's w1, v1, w2, one module running them all, so they are given back in
    the order it holds them and w2 stays zeroed), and a vector of its width held by a module that is not
    a norm (a bias added to the residual stream outside a linear map: GPT-NeoX-Japanese's dense_bias,
    JetMoE's MoE bias; or a scale of it: Doge's input_residual)."""
    import torch

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers ships it
        Conv1D = ()
    units: list[tuple[str, list[str]]] = []
    for prefix, module in layer.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        dot = prefix + "." if prefix else ""
        linear = isinstance(module, torch.nn.Linear) and module.out_features in widths
        conv = isinstance(module, Conv1D) and module.nf in widths
        if linear or conv:
            units.append((prefix, [dot + n for n in own]))
            continue
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            continue
        for name, p in own.items():
            if p.dim() == 3 and p.shape[0] > 1 and widths & set(p.shape[-2:]):
                units.append(
                    (prefix, [dot + name] + ([dot + name + "_bias"] if name + "_bias" in own else []))
                )
            else:
                flat_experts = p.dim() == 2 and widths & set(p.shape)  # [experts * ffn, hidden]
                if flat_experts or (p.dim() == 1 and len(p) in widths and not is_norm(module)):
                    units.append((prefix, [dot + name]))
    return units
