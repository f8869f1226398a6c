"""Cheap fingerprints of tensors: is this the same tensor, byte for byte, without reading it all?

A tensor's fingerprint hashes its dtype, its shape and its bytes: all of them for a tensor of at
most ``FULL_BYTES``, else ``BLOCKS`` blocks of ``BLOCK_BYTES`` spread evenly from its first byte to its
last. Reading 68 kB per tensor fingerprints a 70B checkpoint in seconds, from disk or page cache;
it tells apart different layers, models and checkpoints (a tensor trained for one step differs in
every block), not a deliberate edit between two sampled blocks. ``otdus verify``'s perplexity run
remains the final word on what a checkpoint computes.

Fingerprints identify the source in the manifest (one per base layer, one per other tensor) and let
verify match an expanded checkpoint's layers to its base's without a manifest.
"""

from __future__ import annotations

import hashlib
import math

from otdus_cli.io.reader import CheckpointReader
from otdus_cli.io.safetensors_format import itemsize
from otdus_cli.io.stack import LayerStack, SourceLayer

SCHEME = "sampled-sha256-v1"
FULL_BYTES = 1 << 20
BLOCKS = 16
BLOCK_BYTES = 4096


def _offsets(nbytes: int) -> list[int]:
    if nbytes <= FULL_BYTES:
        return [0]
    last = nbytes - BLOCK_BYTES
    return sorted({round(k * last / (BLOCKS - 1)) for k in range(BLOCKS)})


def tensor_fingerprint(reader: CheckpointReader, name: str) -> str:
    meta = reader.meta(name)
    nbytes = reader.nbytes(name)
    h = hashlib.sha256(f"{meta.dtype}{list(meta.shape)}".encode())
    if nbytes <= FULL_BYTES:
        h.update(reader.read_bytes(name, 0, nbytes))
    else:
        for offset in _offsets(nbytes):
            h.update(reader.read_bytes(name, offset, BLOCK_BYTES))
    return h.hexdigest()[:32]


SLICE_ROWS = 64  # the rows (entries before the sliced axis) a layer's slice is sampled at


def slice_fingerprint(reader: CheckpointReader, name: str, axis: int, width: int, layer: int) -> str:
    """One layer's slice of a tensor that holds a slice per layer (``width`` entries along ``axis`` at
    ``layer * width``: arch/layer_slices.py), so that slice 3 of a base and the slice of its copy at index
    5 of an expansion agree: its bytes at up to ``SLICE_ROWS`` entries before the axis, spread evenly."""
    meta = reader.meta(name)
    shape, size = list(meta.shape), itemsize(meta.dtype)
    outer, inner = math.prod(shape[:axis]), math.prod(shape[axis + 1 :])
    depth, run = shape[axis] // width, width * inner * size  # a slice's bytes at one entry before the axis
    rows = (
        range(outer)
        if outer <= SLICE_ROWS
        else {round(k * (outer - 1) / (SLICE_ROWS - 1)) for k in range(SLICE_ROWS)}
    )
    h = hashlib.sha256(f"{meta.dtype}{width}{inner}".encode())
    for row in sorted(rows):
        start = (row * depth + layer) * run
        for offset in _offsets(run):
            h.update(
                reader.read_bytes(name, start + offset, min(run, BLOCK_BYTES if run > FULL_BYTES else run))
            )
    return h.hexdigest()[:32]


def group_fingerprint(layer: SourceLayer) -> str:
    """One fingerprint for a decoder layer: its tensors by name relative to the layer (so layer 3 of a
    base and its copy at index 5 of an expansion agree; a tensor stored outside the layer, under a name
    numbered by it, by its name within the layer)."""
    h = hashlib.sha256()
    for suffix in sorted(layer.suffixes()):
        h.update(f"{suffix}={tensor_fingerprint(layer.reader, layer.name(suffix))};".encode())
    return h.hexdigest()[:32]


def stack_fingerprints(stack: LayerStack) -> dict:
    """What the manifest records of the source: one fingerprint per layer and per other tensor."""
    reader = stack.reader
    return {
        "scheme": SCHEME,
        "layers": [group_fingerprint(lay) for lay in stack.layers],
        "other": {name: tensor_fingerprint(reader, name) for name in stack.head + stack.tail},
    }
