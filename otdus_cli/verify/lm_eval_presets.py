"""lm-eval versions: how each release's HF model tokenises the ``wikitext`` task's documents.

Every lm-eval 0.4 release scores a document the same way once it has its token list (rolling windows,
``get_rolling_token_windows(context_len=1)`` + ``make_disjoint_window``; per-document log-likelihood
sums; ``weighted_perplexity`` and ``bits_per_byte`` over words and bytes of the page before
detokenisation; the detokeniser has not changed since 0.4.0). What changed is the token list and
the window's first token, read from ``lm_eval/models/huggingface.py`` of each release
(``tok_encode``, ``loglikelihood_rolling``, ``prefix_token_id``, ``max_length``, ``__init__``):

* prefix: up to 0.4.2 the first window starts with ``eot_token_id`` (the tokenizer's EOS); from
  0.4.3, ``prefix_token_id``: BOS, or EOS when the tokenizer has no BOS;
* special tokens: up to 0.4.9.1 a causal model's text is encoded with
  ``add_special_tokens=False or add_bos_token`` (``add_bos_token`` defaults to False but is forced
  on for Gemma: model_type ``gemma`` exactly in 0.4.2-0.4.3, any model_type containing ``gemma`` in
  0.4.4-0.4.9.1); from 0.4.9.2 nothing is passed, so the tokenizer adds its own special tokens (a
  Llama tokenizer's ``<s>``), except when the text already starts with the decoded prefix token;
* max length (when no ``max_length`` model argument is given): the config's ``n_positions``,
  ``max_position_embeddings`` or ``n_ctx``, else the tokenizer's ``model_max_length`` (unless
  "unlimited"), else 2048; from 0.4.13 a nested ``text_config`` is read first.

The table below is that history as data; :func:`wikitext_tokenization` applies a release's row to
one model's config and tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from otdus_cli.errors import OtdusError

LM_EVAL_NEWEST = "0.4.13"  # the newest release checked; the CLI's and the API's default
LM_EVAL_PAPER = "0.4.2"  # what the OT-DUS paper's Wiki-PPL tables were computed with
LM_EVAL_DEFAULT_MAX_LENGTH = 2048
TOKENIZER_INFINITY = 1000000000000000019884624838656  # transformers' "no limit" model_max_length


@dataclass(frozen=True)
class LmEvalReleases:
    """One run of lm-eval releases whose ``wikitext`` tokenisation is the same."""

    first: str
    last: str | None  # None: up to the newest release (and later ones, until found otherwise)
    prefix: str  # "eos": the EOS token; "bos": BOS, else EOS
    tokenizer_specials: bool  # True: the tokenizer's own special tokens are added
    bos_model_type: tuple[str, str] | None  # ("is" | "contains", name): add_bos_token forced on
    text_config_first: bool  # max length read from a nested text_config first

    @property
    def label(self) -> str:
        if self.last is None:
            return f"{self.first} onward"
        return self.first if self.first == self.last else f"{self.first}-{self.last}"

    def forces_bos(self, model_type: str | None) -> bool:
        if self.bos_model_type is None or not model_type:
            return False
        how, name = self.bos_model_type
        return model_type == name if how == "is" else name in model_type


RELEASES = (
    LmEvalReleases("0.4.0", "0.4.1", "eos", False, None, False),
    LmEvalReleases("0.4.2", "0.4.2", "eos", False, ("is", "gemma"), False),
    LmEvalReleases("0.4.3", "0.4.3", "bos", False, ("is", "gemma"), False),
    LmEvalReleases("0.4.4", "0.4.9.1", "bos", False, ("contains", "gemma"), False),
    LmEvalReleases("0.4.9.2", "0.4.12", "bos", True, None, False),
    LmEvalReleases("0.4.13", None, "bos", True, None, True),
)


def parse_version(text: str) -> tuple[int, ...]:
    """The release numbers of an lm-eval version string (``0.4.2``, ``v0.4.9.2``, ``0.4.10.dev0``)."""
    from packaging.version import InvalidVersion, Version  # transformers' dependency

    try:
        release = Version(text.strip()).release
    except InvalidVersion:
        raise OtdusError(f"lm-eval version {text!r} is not a version number (e.g. 0.4.2)") from None
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]
    return release


def lm_eval_releases(version: str) -> LmEvalReleases:
    """The row of :data:`RELEASES` that ``version`` falls in (later versions: the newest row)."""
    release = parse_version(version)
    if release < parse_version(RELEASES[0].first):
        raise OtdusError(
            f"lm-eval {version} is not covered: the presets reproduce lm-eval 0.4.0 and later "
            "(0.3's wikitext task is a different protocol)"
        )
    return [r for r in RELEASES if parse_version(r.first) <= release][-1]


def lm_eval_max_length(config: dict, tokenizer=None, *, text_config_first: bool = True) -> int:
    """Context length the way lm-eval's HF model resolves it when no ``max_length`` is given."""
    cfg = (config.get("text_config") or config) if text_config_first else config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        if cfg.get(attr) is not None:
            return int(cfg[attr])
    mml = getattr(tokenizer, "model_max_length", None)
    if mml is not None and mml != TOKENIZER_INFINITY:
        return int(mml)
    return LM_EVAL_DEFAULT_MAX_LENGTH


@dataclass(frozen=True)
class WikitextTokenization:
    """How one lm-eval release feeds one model's documents to it (see :func:`wikitext_tokenization`)."""

    version: str  # as asked for
    releases: str  # the run of releases with this behaviour
    prefix_token_id: int
    add_special_tokens: bool  # passed to the tokenizer (lm-eval 0.4.9.2+ passes nothing: encode's True)
    bos_text: str | None  # 0.4.9.2+: a text starting with this is encoded without special tokens
    max_length: int

    def encode(self, tokenizer, text: str) -> list[int]:
        specials = self.add_special_tokens and not (
            self.bos_text is not None and text.startswith(self.bos_text)
        )
        return list(tokenizer(text, add_special_tokens=specials)["input_ids"])

    @property
    def reproduces(self) -> str:
        return f"lm-eval {self.version}"

    def settings(self) -> dict:
        return {
            "lm_eval": self.version,
            "lm_eval_releases": self.releases,
            "max_length": self.max_length,
            "prefix_token_id": self.prefix_token_id,
            "add_special_tokens": self.add_special_tokens,
        }


def _token_name(tokenizer, token_id: int | None) -> str:
    return "none" if token_id is None else repr(tokenizer.convert_ids_to_tokens(int(token_id)))


def wikitext_tokenization(
    version: str | None, config: dict, tokenizer, max_length: int | None = None
) -> WikitextTokenization:
    """lm-eval ``version``'s prefix token, special tokens and max length for this model (``config``:
    its config.json) and tokenizer. ``max_length`` is lm-eval's ``max_length`` model argument."""
    version = (version or LM_EVAL_NEWEST).strip().removeprefix("v")
    row = lm_eval_releases(version)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prefix = eos if row.prefix == "eos" else (bos if bos is not None else eos)
    if prefix is None:
        need = "an EOS token" if row.prefix == "eos" else "a BOS or an EOS token"
        raise OtdusError(
            f"lm-eval {version} starts each document with {need} and this tokenizer has none "
            f"(BOS {_token_name(tokenizer, bos)}, EOS {_token_name(tokenizer, eos)}); lm-eval itself "
            "cannot score it without a prefix_token_id model argument"
        )
    if max_length is not None and max_length < 1:
        raise OtdusError(f"max length must be positive, got {max_length}")
    model_type = config.get("model_type")  # lm-eval reads the top-level config's
    if row.tokenizer_specials:
        specials, bos_text = True, tokenizer.decode(int(prefix))
    else:
        specials, bos_text = row.forces_bos(model_type), None
    if max_length is None:
        max_length = lm_eval_max_length(config, tokenizer, text_config_first=row.text_config_first)
    return WikitextTokenization(
        version=version,
        releases=row.label,
        prefix_token_id=int(prefix),
        add_special_tokens=specials,
        bos_text=bos_text,
        max_length=max_length,
    )
