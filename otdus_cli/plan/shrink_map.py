"""Shrinking layer maps: which layers a shrink removes, and how the rest of the stack is made.

The layers to remove come from scores (verify's streamed pass over calibration text, see
plan/layer_scores.py) or are named. ``drop`` leaves them out. A merge method builds one layer from
each run of consecutive removed layers together with the kept layer just before it (just after it
when the run starts at layer 0), LaCo's direction: the merged layer takes the kept layer's place,
tensor names and per-layer config entries.

    bi        ShortGPT (Men et al. 2024): the layers with the lowest Block Influence,
              BI_i = 1 - mean cosine(layer i's input, its output) over the calibration tokens; the last
              layer's output is taken before the final norm (ShortGPT's hidden states would put the
              norm into the last layer's score; otdus scores every layer alike).
    angular   Gromov et al. 2024: the block of n consecutive layers whose input and output are
              closest in angular distance, arccos(cosine) / pi, averaged over the tokens.
    laco      LaCo (Yang, Cao & Zhao 2024): its top-down loop of tentative merges kept while the last
              hidden states stay similar to the source's (otdus_cli/laco_select.py runs it; the layers
              it removed come here as a LacoTrace).
    explicit  the layers given (--remove 3,4), as mergekit's passthrough slices cut them by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from otdus_cli.errors import OtdusError
from otdus_cli.plan.layer_map import OutputLayer

# The selections, one line each: name -> what --help says of it (select_removed applies them).
SELECTIONS = {
    "bi": "lowest Block Influence (ShortGPT)",
    "angular": "the block of --layers consecutive layers whose input and output are closest (Gromov et al.)",
    "laco": "LaCo's top-down loop of merges kept while the last hidden states stay similar (--laco-*)",
    "explicit": "--remove",
}
Selection = Literal[tuple(SELECTIONS)]  # type: ignore[valid-type]


def removal_count(depth: int, layers: int | None, ratio: float | None) -> int:
    """How many layers a shrink removes (--layers N or --ratio r of the depth; default 1)."""
    if layers is not None and ratio is not None:
        raise OtdusError("give --layers or --ratio, not both")
    if ratio is not None:
        if not math.isfinite(ratio) or not 0 < ratio < 1:
            raise OtdusError(f"--ratio is the fraction of the layers removed: between 0 and 1, got {ratio}")
        count = round(depth * ratio)
    else:
        count = 1 if layers is None else layers
    if count < 1:
        raise OtdusError(f"the shrink removes {count} layers; it must remove at least one")
    if count >= depth:
        raise OtdusError(
            f"removing {count} of {depth} layers leaves none; at most {depth - 1} can be removed"
        )
    return count


@dataclass(frozen=True)
class LayerScores:
    """What the streamed pass measured, per source layer (plan/layer_scores.py)."""

    block_influence: list[float]  # BI_i, one per layer
    # angular[n][l]: distance between the input of layer l and the output of layer l + n - 1, for n = 1
    # and n = the removal count (the sizes a shrink reads)
    angular: dict[int, list[float]]
    tokens: int
    text: str

    def to_json(self) -> dict:
        return {
            "block_influence": self.block_influence,
            "angular": {str(n): v for n, v in self.angular.items()},
            "tokens": self.tokens,
            "text": self.text,
        }


@dataclass(frozen=True)
class LacoTrace:
    """What LaCo's selection loop did (otdus_cli/laco_select.py): the layers it removed and each merge
    it tried, in order (the lowest source layer, the source layers merged, the similarity, accepted)."""

    removed: list[int]
    tried: list[dict]
    settings: dict
    tokens: int
    text: str

    def to_json(self) -> dict:
        return {
            "removed": self.removed,
            "tried": self.tried,
            "settings": self.settings,
            "tokens": self.tokens,
            "text": self.text,
        }


def select_removed(
    depth: int,
    count: int | None,
    select: str,
    remove: Sequence[int] | None = None,
    scores: LayerScores | None = None,
    laco: LacoTrace | None = None,
) -> list[int]:
    """The source layers to remove, sorted."""
    if select == "explicit" or remove:
        if select != "explicit":
            raise OtdusError(
                f"--remove names the layers itself; it goes with --select explicit, not {select}"
            )
        if not remove:
            raise OtdusError("--select explicit needs --remove, e.g. --remove 3,4")
        if count is not None and count != len(set(remove)):
            named = len(set(remove))
            raise OtdusError(f"--remove names {named} layer{'s' * (named != 1)}, --layers asks for {count}")
        for i in remove:
            if not 0 <= i < depth:
                raise OtdusError(f"--remove {i}: the model has layers 0..{depth - 1}")
        chosen = sorted(set(remove))
        if len(chosen) >= depth:
            raise OtdusError(f"--remove names all {depth} layers; at least one must stay")
        return chosen
    if select not in SELECTIONS:
        raise OtdusError(f"unknown selection {select!r}; choose one of {', '.join(SELECTIONS)}")
    if select == "laco":
        if laco is None:
            raise RuntimeError("select_removed: --select laco needs the selection loop's trace")
        if not laco.removed:
            raise OtdusError(
                "--select laco kept no merge: every merge it tried left the last hidden states at or below "
                f"--laco-threshold {laco.settings['threshold']} of the source's (lower it, or merge fewer "
                "layers at a time with --laco-merge)"
            )
        return list(laco.removed)
    if scores is None or count is None:
        raise RuntimeError("select_removed: scored selections need the scores and the count")
    if select == "bi":
        ranked = sorted(range(depth), key=lambda i: (scores.block_influence[i], i))
        return sorted(ranked[:count])
    distances = scores.angular[count]
    start = min(range(len(distances)), key=lambda s: (distances[s], s))
    return list(range(start, start + count))


def merge_groups(depth: int, removed: Sequence[int]) -> list[tuple[int, ...]]:
    """The source layers each merged layer is built from: every run of consecutive removed layers
    with the kept layer before it (after it for a run starting at layer 0), kept layer first."""
    gone = set(removed)
    groups: list[tuple[int, ...]] = []
    i = 0
    while i < depth:
        if i not in gone:
            i += 1
            continue
        run = [i]
        while run[-1] + 1 in gone:
            run.append(run[-1] + 1)
        if run[0] > 0:
            groups.append((run[0] - 1, *run))
        else:
            groups.append((run[-1] + 1, *run))  # the kept layer after the run
        i = run[-1] + 1
    return groups


def shrink_layers(depth: int, removed: Sequence[int], builder: str) -> list[OutputLayer]:
    """The output stack: kept layers in order, byte copies (``builder`` "base": drop) or, where a merge
    group keeps its place, a layer built by ``builder`` from the group (source: its kept layer)."""
    gone = set(removed)
    if builder == "base":
        kept = [i for i in range(depth) if i not in gone]
        return [OutputLayer(j, i, False, (i,), "base", False) for j, i in enumerate(kept)]
    groups = {g[0]: g for g in merge_groups(depth, removed)}
    out: list[OutputLayer] = []
    for i in range(depth):
        if i in gone:
            continue
        group = groups.get(i)
        if group is None:
            out.append(OutputLayer(len(out), i, False, (i,), "base", False))
        else:
            # the kept layer first: the layer the others are merged into (LaCo's base); OT aligns the
            # group to its last layer instead (methods/merge.py)
            out.append(OutputLayer(len(out), i, True, group, builder, False))
    return out


def describe_removal(record: dict, measured: bool = True) -> str:
    """One line on what a shrink did, from its manifest's ``shrink`` record (verify's report);
    ``measured``: the report shows the change against the source (False: verify --static, which
    runs nothing)."""
    gone = record.get("removed") or []
    removed = ", ".join(map(str, gone))
    merged = record.get("merged") or []
    how = "removed" if merged else "dropped"
    line = f"shrink: source layer{'s' * (len(gone) != 1)} {removed} {how} ({record.get('select')} selection)"
    if merged:
        groups = "; ".join(", ".join(map(str, sorted(g))) for g in merged)
        line += f", merged into one layer each: {groups}"
    if measured:
        return line + "; no parity expected, the delta is the change against the source"
    return line + "; no parity expected (verify without --static measures the change against the source)"
