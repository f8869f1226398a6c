"""Static check of a widened MoE layer (`otdus widen`): base layer i with its experts duplicated exactly.

Expert e + jE of the widened layer must be expert e of the base layer (sampled fingerprints, as for
copied layers), every expert-indexed tensor (router weight, per-expert biases, fused expert tensors)
must be m byte-identical copies of the base's along its first dimension (read in full), and every
other tensor the base's. Such a layer computes the base layer's function up to the order of the
routing sums (widen.py explains why); noise added to the copies fails this check, as it should.
"""

from __future__ import annotations

from otdus_cli.arch.experts import expert_layout
from otdus_cli.io.fingerprint import tensor_fingerprint
from otdus_cli.io.stack import LayerStack

_CHUNK = 16 * 2**20


def _tiles_of(base: LayerStack, base_name: str, expanded: LayerStack, name: str, m: int) -> bool:
    size = base.reader.nbytes(base_name)
    if expanded.reader.nbytes(name) != m * size:
        return False
    for offset in range(0, size, _CHUNK):
        want = base.reader.read_bytes(base_name, offset, _CHUNK)
        for j in range(m):
            if expanded.reader.read_bytes(name, j * size + offset, len(want)) != want:
                return False
    return True


def is_duplicated_experts(base: LayerStack, base_index: int, expanded: LayerStack, index: int) -> bool:
    """Whether expanded layer ``index`` is base layer ``base_index`` with every expert copied m times."""
    layout = expert_layout(base.family.name)
    if layout is None or base.family.name != expanded.family.name:
        return False
    try:
        experts = layout.expert_count(base.config)
        grown = layout.expert_count(expanded.config)
    except Exception:
        return False
    if grown % experts or grown == experts:
        return False
    m = grown // experts
    b_layer, e_layer = base.layers[base_index], expanded.layers[index]
    b_suffixes = set(b_layer.suffixes())
    per_expert = layout.expert_regex()
    expected: set[str] = set()
    for suffix in b_suffixes:
        hit = per_expert.fullmatch(suffix)
        if hit:
            e = int(hit.group(1))
            expected |= {f"{layout.block}experts.{e + j * experts}.{hit.group(2)}" for j in range(m)}
        else:
            expected.add(suffix)
    if set(e_layer.suffixes()) != expected:
        return False
    for suffix in sorted(expected):
        hit = per_expert.fullmatch(suffix)
        source = f"{layout.block}experts.{int(hit.group(1)) % experts}.{hit.group(2)}" if hit else suffix
        b_name, e_name = b_layer.name(source), e_layer.name(suffix)
        if not hit and layout.is_expert_indexed(suffix):
            if not _tiles_of(base, b_name, expanded, e_name, m):
                return False
        elif tensor_fingerprint(base.reader, b_name) != tensor_fingerprint(expanded.reader, e_name):
            return False
    return True
