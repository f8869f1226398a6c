"""Evaluation sets for tiny models, which have no tokenizer."""

from __future__ import annotations

import torch

from otdus_cli.verify.metrics import EvalSet, Window

LENGTHS = (40, 40, 23)  # longer than the tiny models' sliding windows (16); two equal lengths batch together


def random_eval_set(vocab: int = 96, seed: int = 0) -> EvalSet:
    """Token perplexity over random token ids."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]
    windows = [Window(w, w[1:], 0, 0) for w in ids]
    return EvalSet("token", "random ids", windows, [0], [0], max(LENGTHS))
