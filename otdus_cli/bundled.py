"""Files shipped inside the package, so the demo, `verify` and the study recipes work offline."""

from __future__ import annotations

import gzip
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
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")
