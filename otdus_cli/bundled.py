"""Files shipped inside the package, so the demo, `verify` and the study recipes work offline."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

from otdus_cli.errors import OtdusError

DATA = Path(__file__).parent / "data"
# Karpathy's stories260K (MIT), a real pretrained 5-layer Llama with its tokenizer; see its README.md.
STORIES260K = DATA / "stories260k"
# Five TinyStories stories, in-domain text for stories260K (see TINYSTORIES_NOTICE.md).
TINYSTORIES_SAMPLE = DATA / "tinystories_sample_cs336.txt"

# Names accepted wherever a model is expected (expand, plan, inspect, verify, ppl, study, diagnose).
BUNDLED_MODELS = {"bundled:stories260k": STORIES260K}
# Names accepted wherever a text is expected (verify/ppl --text, study --train/--eval, recipes,
# diagnose --text), with the file each stands for (licences and sources: TINYSTORIES_NOTICE.md,
# WIKITEXT_LICENSE.md beside them).
BUNDLED_TEXT_FILES = {
    "bundled:tinystories-sample": TINYSTORIES_SAMPLE,
    # the first 2 MiB of the TinyStories training text (2,316 whole stories), gzip-compressed
    "bundled:tinystories-train-2mib": DATA / "tinystories_train_head_2MiB.txt.gz",
    "bundled:wikitext-test": DATA / "wikitext-2-raw-test.txt.gz",
    "bundled:wikitext-valid": DATA / "wikitext-2-raw-valid.txt.gz",
}
BUNDLED_TEXTS = tuple(BUNDLED_TEXT_FILES)
# sha256 of the uncompressed texts (the originals' as their notices give them), checked when read
BUNDLED_TEXT_SHA256 = {
    "bundled:tinystories-sample": "defaedb58bf28079f3e29c6142cb7f3568d331a577e0911c5d7925c465c50c43",
    "bundled:tinystories-train-2mib": "5352b299dcb1a32898b2d779b145b5a05f3e1265953fd21c264c9f9f9c9ae33d",
    "bundled:wikitext-test": "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
    "bundled:wikitext-valid": "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7",
}
WIKITEXT_SPLITS = {"bundled:wikitext-test": "test", "bundled:wikitext-valid": "validation"}


def read_bundled_text(name: str) -> str:
    """The text of a bundled name, decompressed."""
    if name not in BUNDLED_TEXT_FILES:
        raise OtdusError(f"unknown bundled text {name!r}; choose one of {', '.join(BUNDLED_TEXTS)}")
    path = BUNDLED_TEXT_FILES[name]
    try:
        data = path.read_bytes()
    except OSError:
        raise OtdusError(f"bundled {path.name} is missing from the installation") from None
    raw = gzip.decompress(data) if path.suffix == ".gz" else data
    if hashlib.sha256(raw).hexdigest() != BUNDLED_TEXT_SHA256[name]:
        raise OtdusError(f"bundled {path.name} is corrupt (sha256 mismatch)")
    return raw.decode("utf-8")
