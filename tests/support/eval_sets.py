"""Evaluation sets for tiny models, which have no tokenizer."""

from __future__ import annotations

import torch

from otdus_cli.verify.metrics import EvalSet, Window

LENGTHS = (40, 40, 23)  # longer than the tiny models' sliding windows (16); two equal lengths batch together


def random_eval_set(
    vocab: int = 96, seed: int = 0, lengths: tuple[int, ...] = LENGTHS, low: int = 0
) -> EvalSet:
    """Token perplexity over random token ids in [``low``, ``vocab``) (``low`` > 0 leaves out special
    tokens such as a pad id a model masks), one window per length."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(low, vocab, (n,), generator=gen).tolist() for n in lengths]
    windows = [Window(w, w[1:], 0, 0) for w in ids]
    return EvalSet("token", "random ids", windows, [0], [0], max(lengths))
