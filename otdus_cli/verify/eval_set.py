"""The evaluation set of a run: a corpus tokenised by the model's tokenizer into one protocol's windows.

``make_eval_set`` is what ``otdus verify`` and ``otdus ppl`` score: both models of a verify run score
the very same windows (the base's tokenizer gives them).
"""

from __future__ import annotations

import os
from pathlib import Path

from otdus_cli.arch.wrappers import text_config
from otdus_cli.errors import OtdusError
from otdus_cli.io.reader import CheckpointReader
from otdus_cli.quiet import quiet_transformers
from otdus_cli.verify.lm_eval_presets import LM_EVAL_NEWEST, wikitext_tokenization
from otdus_cli.verify.metrics import (
    DEFAULT_SEQ_LEN,
    EvalSet,
    load_tokenizer,
    model_max_positions,
    rolling_eval_set,
    token_eval_set,
)
from otdus_cli.verify.text import Corpus, wikitext_corpus


def model_folder(model: str | os.PathLike[str]) -> Path:
    """A model argument as the CLI takes it: a folder, ``bundled:stories260k`` or a cached hub id."""
    from otdus_cli.source import resolve_source

    return Path(resolve_source(str(model)).folder)


@quiet_transformers
def make_eval_set(
    model_dir: str | os.PathLike[str] | CheckpointReader,
    *,
    corpus: Corpus | None = None,
    protocol: str = "wikitext",
    max_length: int | None = None,
    seq_len: int = DEFAULT_SEQ_LEN,
    token_mode: str = "joined",
    max_docs: int | None = None,
    max_tokens: int | None = None,
    lm_eval: str = LM_EVAL_NEWEST,
    tokenizer=None,
) -> EvalSet:
    """Tokenise ``corpus`` (default: bundled WikiText-2 test) for ``protocol`` with the model's tokenizer.

    protocol "wikitext": lm-eval's rolling windows as release ``lm_eval`` computes them (any version
    string; see verify/lm_eval_presets.py), of ``max_length`` tokens (lm-eval's model argument;
    default: as that release resolves it); protocol "token": GPTQ windows of ``seq_len`` (capped by
    the model's max positions).
    """
    if not isinstance(model_dir, CheckpointReader):
        model_dir = CheckpointReader(model_folder(model_dir))
    reader = model_dir
    reader_config = reader.config
    tok = tokenizer if tokenizer is not None else load_tokenizer(reader.folder)
    corpus = corpus if corpus is not None else wikitext_corpus()
    if protocol == "wikitext":
        tokenization = wikitext_tokenization(lm_eval, reader_config, tok, max_length)
        eval_set = rolling_eval_set(corpus, tok, tokenization, max_docs=max_docs, max_tokens=max_tokens)
    elif protocol == "token":
        cap = model_max_positions(reader_config)
        length = min(seq_len, cap) if cap else seq_len
        eval_set = token_eval_set(
            corpus, tok, length, mode=token_mode, max_docs=max_docs, max_tokens=max_tokens
        )
    else:
        raise OtdusError(f"unknown protocol {protocol!r} (wikitext, token)")
    _check_ids_fit(eval_set, reader)
    return eval_set


def _check_ids_fit(eval_set: EvalSet, reader: CheckpointReader) -> None:
    """A token id past the embedding's rows cannot be looked up: the tokenizer is not this model's."""
    embeddings = [n for n in reader.names if n.endswith(("embed_tokens.weight", "wte.weight"))]
    rows = reader.meta(embeddings[0]).shape[0] if embeddings else text_config(reader.config).get("vocab_size")
    if not isinstance(rows, int):
        return
    largest = max((max(w.input_ids, default=-1) for w in eval_set.windows), default=-1)
    if largest >= rows:
        raise OtdusError(
            f"the tokenizer of {reader.folder} gives token id {largest}, but the model's embedding has "
            f"{rows} rows: the tokenizer does not belong to this model"
        )
