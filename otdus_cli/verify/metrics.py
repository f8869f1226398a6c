"""Perplexity protocols: lm-eval's ``wikitext`` (rolling windows) and GPTQ-style token perplexity.

Both turn a corpus into a list of :class:`Window` s (token ids to feed, tokens to score) before any
model runs (an :class:`EvalSet`), so one set can be scored by two models (base and expanded)
window for window.

lm-eval ``wikitext`` (``loglikelihood_rolling``), as lm-eval 0.4.x's HF model computes it:
  * each document is detokenised and tokenised as the chosen lm-eval release does
    (verify/lm_eval_presets.py: with or without the tokenizer's special tokens, which prefix token,
    which max length);
  * windows of ``max_length`` tokens: the first is ``[prefix] + tokens[:L-1]`` scoring ``tokens[:L]``;
    each later window scores the next <= L tokens, fed with the L tokens that precede each target
    (so every token is scored exactly once, with as much left context as fits);
  * word_perplexity = exp(-sum ll / words), byte_perplexity = exp(-sum ll / bytes),
    bits_per_byte = -sum ll / bytes / ln 2, words and bytes counted on the document before
    detokenisation.

Token perplexity (GPTQ): the text joined with ``\\n\\n``, tokenised once with the tokenizer's special
tokens, cut into disjoint ``seq_len`` windows (the tail that does not fill a window is dropped),
exp(mean NLL) over every token but the first of each window. ``mode="documents"`` instead tokenises
each document with one BOS and scores every token after it (windows overlap by one token).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from otdus_cli.errors import OtdusError
from otdus_cli.verify.head_pass import iter_logits
from otdus_cli.verify.lm_eval_presets import WikitextTokenization
from otdus_cli.verify.progress import Progress, Tick
from otdus_cli.verify.text import Corpus, count_bytes, count_words, wikitext_detokenize

DEFAULT_SEQ_LEN = 2048


@dataclass(frozen=True)
class Window:
    """One forward pass: ``logits[offset + t]`` predicts ``targets[t]``."""

    input_ids: list[int]
    targets: list[int]
    offset: int
    doc: int


@dataclass
class EvalSet:
    """A corpus cut into the windows one protocol scores, with the counts its formulas divide by."""

    protocol: str  # "wikitext" (lm-eval rolling) | "token"
    corpus: str
    windows: list[Window]
    words: list[int]  # per document (rolling protocol)
    bytes: list[int]
    context: int  # max_length (rolling) or seq_len (token)
    settings: dict = field(default_factory=dict)
    reproduces: str | None = None  # e.g. "lm-eval 0.4.2": whose wikitext figures these are

    @property
    def n_docs(self) -> int:
        return len(self.words)

    @property
    def n_tokens(self) -> int:
        return sum(len(w.targets) for w in self.windows)


@dataclass
class PerplexityMetrics:
    protocol: str
    corpus: str
    context: int
    n_docs: int
    n_windows: int
    n_tokens: int
    loglikelihood: float  # sum over scored tokens, nats
    token_perplexity: float
    n_words: int | None = None
    n_bytes: int | None = None
    word_perplexity: float | None = None
    byte_perplexity: float | None = None
    bits_per_byte: float | None = None
    settings: dict = field(default_factory=dict)
    reproduces: str | None = None  # e.g. "lm-eval 0.4.2": whose wikitext figures these are

    def headline(self) -> tuple[str, float]:
        """The protocol's main figure: word perplexity for the lm-eval protocol, else token perplexity."""
        if self.protocol == "wikitext" and self.word_perplexity is not None:
            return "word_perplexity", self.word_perplexity
        return "token_perplexity", self.token_perplexity

    def values(self) -> dict[str, float]:
        keys = ("token_perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "loglikelihood")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def to_dict(self) -> dict:
        return asdict(self)


# -- tokenizer and model positions ----------------------------------------------------------------
def load_tokenizer(folder: str | os.PathLike[str]):
    from transformers import AutoTokenizer  # heavy import

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:  # missing files, unknown class, ...
        names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
        if not any((Path(folder) / name).is_file() for name in names):
            raise OtdusError(
                f"{folder} has no tokenizer files (tokenizer.json, tokenizer.model, ...): copy the model's "
                "tokenizer files into it (scripts/make_synthetic.py: --tokenizer-from)"
            ) from None
        raise OtdusError(f"cannot load a tokenizer from {folder}: {exc.__class__.__name__}: {exc}") from None


def model_max_positions(config: dict) -> int | None:
    cfg = config.get("text_config") or config
    for attr in ("max_position_embeddings", "n_positions", "n_ctx"):
        if cfg.get(attr) is not None:
            return int(cfg[attr])
    return None


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


# -- lm-eval rolling windows ----------------------------------------------------------------------
# More characters than any tokenizer puts in one token on average over a text: a document longer than
# this many characters per token still wanted is cut before tokenising (--max-tokens bounds the work)
CHARS_PER_TOKEN_BOUND = 64


def _prefix_at_space(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, at the last whitespace when there is one."""
    head = text[:limit]
    space = max(head.rfind(" "), head.rfind("\n"))
    return head[:space] if space > 0 else head


def rolling_windows(
    tokens: Sequence[int], prefix_token: int, max_length: int
) -> list[tuple[list[int], list[int]]]:
    """(input ids, scored targets) pairs; the targets are predicted by the LAST len(targets) positions.

    Same windows as lm-eval's ``get_rolling_token_windows(context_len=1)`` followed by
    ``make_disjoint_window`` and its input assembly: every token is scored exactly once.
    """
    if max_length < 1:
        raise OtdusError(f"max length must be positive, got {max_length}")
    tokens = list(tokens)
    n = len(tokens)
    if n == 0:
        return []
    first = min(max_length, n)
    out = [([prefix_token] + tokens[: first - 1], tokens[:first])]
    done = first
    while done < n:
        end = min(n, done + max_length)
        out.append((tokens[end - max_length - 1 : end - 1], tokens[done:end]))
        done = end
    return out


def rolling_eval_set(
    corpus: Corpus,
    tokenizer,
    tokenization: WikitextTokenization,
    *,
    detokenize: bool | None = None,
    max_docs: int | None = None,
    max_tokens: int | None = None,
) -> EvalSet:
    """lm-eval ``wikitext``-style evaluation set over whole documents, tokenised as ``tokenization`` says.

    ``detokenize`` defaults to True for WikiText. ``max_tokens`` keeps whole documents until at least
    that many tokens are scored (word/byte counts stay exact), so the set's ``n_tokens`` can exceed
    it; the request is kept in ``settings["max_tokens"]`` beside the count.
    """
    if detokenize is None:
        detokenize = corpus.kind == "wikitext"
    max_length = tokenization.max_length
    docs = corpus.documents if max_docs is None else corpus.documents[: max(0, max_docs)]
    windows: list[Window] = []
    words: list[int] = []
    nbytes: list[int] = []
    scored = 0
    cut = None
    for d, page in enumerate(docs):
        if max_tokens is not None and scored >= max_tokens:
            break
        if max_tokens is not None and len(page) > (max_tokens - scored) * CHARS_PER_TOKEN_BOUND:
            # one huge document would be tokenised whole: keep a prefix that surely holds the tokens
            # still wanted (its words and bytes are what is counted)
            page = _prefix_at_space(page, (max_tokens - scored) * CHARS_PER_TOKEN_BOUND)
            cut = d
        text = wikitext_detokenize(page) if detokenize else page
        tokens = tokenization.encode(tokenizer, text)
        for inp, tgt in rolling_windows(tokens, tokenization.prefix_token_id, max_length):
            windows.append(Window(inp, tgt, len(inp) - len(tgt), d))
        scored += len(tokens)
        words.append(count_words(page))
        nbytes.append(count_bytes(page))
    settings = {**tokenization.settings(), "detokenize": detokenize, "max_tokens": max_tokens}
    if cut is not None:
        settings["cut_document"] = cut  # scored in part: a prefix of it
    return EvalSet(
        "wikitext", corpus.name, windows, words, nbytes, max_length, settings, tokenization.reproduces
    )


# -- token perplexity -------------------------------------------------------------------------------
def token_eval_set(
    corpus: Corpus,
    tokenizer,
    seq_len: int = DEFAULT_SEQ_LEN,
    *,
    mode: str = "joined",
    max_docs: int | None = None,
    max_tokens: int | None = None,
) -> EvalSet:
    """GPTQ-style evaluation set (``mode="joined"``) or one BOS per document (``mode="documents"``).

    ``max_tokens`` caps the tokens scored: "documents" scores exactly that many (or all there are);
    "joined" keeps that many tokens of the text and scores the whole ``seq_len`` windows among them
    (each window's first token is context only), so a little fewer.
    """
    if seq_len < 2:
        raise OtdusError(f"sequence length must be at least 2, got {seq_len}")
    docs = corpus.documents if max_docs is None else corpus.documents[: max(0, max_docs)]
    windows: list[Window] = []
    if mode == "joined":
        if corpus.raw_lines is not None and max_docs is None:
            text = "\n\n".join(corpus.raw_lines)  # GPTQ: the HF dataset's rows joined with blank lines
        else:
            text = "\n\n".join(docs)
        if max_tokens is not None and len(text) > max(2, max_tokens) * CHARS_PER_TOKEN_BOUND:
            # the tokens kept are the text's first ones: tokenise a start that surely holds them
            text = _prefix_at_space(text, max(2, max_tokens) * CHARS_PER_TOKEN_BOUND)
        ids = _encode(tokenizer, text, True)
        if max_tokens is not None:
            ids = ids[: max(2, max_tokens)]
        if len(ids) < 2:
            raise OtdusError("the text is too short to score")
        if len(ids) < seq_len:
            chunks = [ids]
        else:
            chunks = [ids[s : s + seq_len] for s in range(0, len(ids) - seq_len + 1, seq_len)]
        windows = [Window(c, c[1:], 0, 0) for c in chunks]
        n_docs = 1
    elif mode == "documents":
        bos = tokenizer.bos_token_id
        budget = math.inf if max_tokens is None else max_tokens
        for d, doc in enumerate(docs):
            ids = _encode(tokenizer, doc, False)
            if bos is not None:
                ids = [int(bos)] + ids
            start = 0
            while start < len(ids) - 1 and budget > 0:
                chunk = ids[start : start + seq_len]
                targets = chunk[1:][: int(min(len(chunk) - 1, budget))]
                windows.append(Window(chunk[: len(targets) + 1], targets, 0, d))
                budget -= len(targets)
                start += seq_len - 1
        n_docs = len({w.doc for w in windows})
    else:
        raise OtdusError(f"unknown token perplexity mode {mode!r} (joined, documents)")
    if not windows:
        raise OtdusError("nothing to score")
    settings = {"seq_len": seq_len, "mode": mode, "max_tokens": max_tokens}
    return EvalSet("token", corpus.name, windows, [0] * n_docs, [0] * n_docs, seq_len, settings)


# -- scoring ------------------------------------------------------------------------------------------
def _scored_span(window: Window, first: int, positions: int) -> tuple[int, int]:
    """Targets lo .. hi - 1 of ``window`` are predicted by a chunk of ``positions`` positions from
    ``first`` (target i is predicted at position ``window.offset + i``); hi <= lo when none are."""
    lo = max(0, first - window.offset)
    hi = min(len(window.targets), first + positions - window.offset)
    return lo, hi


def batch_target_logprobs(
    logits: torch.Tensor, windows: Sequence[Window], first: int, softmax_dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Log-probabilities (float64, CPU) of each window's targets predicted at positions ``first`` ..
    ``first + c - 1`` (logits [B, c, V], row b for ``windows[b]``), one log-softmax over the whole chunk
    in ``softmax_dtype``; an empty tensor for a window the chunk predicts none of."""
    batch, positions = logits.shape[0], logits.shape[1]
    spans = [_scored_span(w, first, positions) for w in windows]
    # target id at each position (0 where the position predicts nothing of its window: gathered, unused)
    ids = torch.zeros((batch, positions), dtype=torch.long)
    for row, (window, (lo, hi)) in enumerate(zip(windows, spans, strict=True)):
        if hi > lo:
            start = window.offset + lo - first
            ids[row, start : start + hi - lo] = torch.as_tensor(window.targets[lo:hi], dtype=torch.long)
    logprobs = torch.log_softmax(logits.to(softmax_dtype), dim=-1)
    picked = logprobs.gather(-1, ids.to(logits.device)[..., None])[..., 0]
    picked = picked.double().cpu()
    out = []
    for row, (window, (lo, hi)) in enumerate(zip(windows, spans, strict=True)):
        start = window.offset + lo - first
        out.append(picked[row, start : start + hi - lo] if hi > lo else torch.empty(0, dtype=torch.float64))
    return out


def target_logprobs(logits: torch.Tensor, window: Window, first: int) -> torch.Tensor:
    """Log-probabilities (float64, CPU) of the window's targets predicted at positions ``first`` ..
    ``first + len(logits) - 1`` (logits [c, V] of those positions; target i is predicted at position
    ``window.offset + i``); log-softmax in float32. Empty when the chunk predicts none of them."""
    return batch_target_logprobs(logits[None], [window], first)[0]


def logits_to_keep(window: Window) -> int:
    return len(window.input_ids) - window.offset


def score_activations(
    model,
    acts,
    windows: Sequence[Window],
    on_chunk: Callable[[torch.Tensor], None] | None = None,
    progress: Progress | None = None,
    label: str = "",
    softmax_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Target log-probs for every window from a :class:`StreamedModel`'s finished activations.

    The logits come chunk by chunk (``head_pass.iter_logits``); ``on_chunk`` sees each chunk
    before it is dropped (verify digests them); ``progress`` gets a "scoring" tick per chunk (``label``
    names the model). The log-softmax is taken in ``softmax_dtype``. The model's head is freed afterwards.
    """
    keep = [logits_to_keep(w) for w in windows]
    pieces: list[list[torch.Tensor]] = [[] for _ in windows]
    total = sum(len(w.targets) for w in windows)
    done = 0
    phase = f"scoring {label}".strip()
    if progress is not None:
        progress(Tick(phase, 0, total, "tokens", 0))
    for group, first, logits in iter_logits(model, acts, keep):
        if on_chunk is not None:
            on_chunk(logits)
        parts = batch_target_logprobs(logits, [windows[i] for i in group], first, softmax_dtype)
        for i, part in zip(group, parts, strict=True):
            pieces[i].append(part)
            done += part.numel()
        if progress is not None:
            progress(Tick(phase, done, total, "tokens", done))
    model.weights.free_shell()
    out = []
    for window, parts in zip(windows, pieces, strict=True):
        lp = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64)
        if lp.numel() != len(window.targets):
            raise OtdusError("internal: scored positions do not match the window's targets")
        out.append(lp)
    return out


def window_loglikelihood(logprobs: torch.Tensor, sum_dtype: torch.dtype | None = None) -> float:
    """One window's log-likelihood: its log-probs summed in float64, or by torch in ``sum_dtype`` (one
    rounding to that dtype: lm-eval sums each window's log-softmax output in the dtype it has)."""
    if sum_dtype is None:
        return float(logprobs.sum())
    return float(logprobs.to(sum_dtype).sum())


def metrics_from_logprobs(
    eval_set: EvalSet, logprobs: Sequence[torch.Tensor], sum_dtype: torch.dtype | None = None
) -> PerplexityMetrics:
    """The protocol's figures from every window's target log-probs; each window's sum in float64 or,
    with ``sum_dtype``, in that dtype (:func:`window_loglikelihood`), and the windows' sums in float64."""
    if len(logprobs) != len(eval_set.windows):
        raise OtdusError("internal: one log-prob vector per window expected")
    ll = float(sum(window_loglikelihood(lp, sum_dtype) for lp in logprobs))
    n_tokens = eval_set.n_tokens
    token_ppl = math.exp(-ll / n_tokens) if n_tokens else math.nan
    m = PerplexityMetrics(
        protocol=eval_set.protocol,
        corpus=eval_set.corpus,
        context=eval_set.context,
        n_docs=eval_set.n_docs,
        n_windows=len(eval_set.windows),
        n_tokens=n_tokens,
        loglikelihood=ll,
        token_perplexity=token_ppl,
        # how the log-probs were taken and summed: "float32" (log-softmax; sums in float64) or a dtype
        settings=dict(eval_set.settings) | {"softmax_dtype": str(sum_dtype or torch.float32).split(".")[-1]},
        reproduces=eval_set.reproduces,
    )
    if eval_set.protocol == "wikitext":
        words, nbytes = sum(eval_set.words), sum(eval_set.bytes)
        m.n_words, m.n_bytes = words, nbytes
        m.word_perplexity = math.exp(-ll / words)
        m.byte_perplexity = math.exp(-ll / nbytes)
        m.bits_per_byte = -ll / nbytes / math.log(2)
    return m
