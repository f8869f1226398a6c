"""Files shipped inside the package, so the demo and `verify` work offline out of the box."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data"
# Karpathy's stories260K (MIT), a real pretrained 5-layer Llama with its tokenizer; see its README.md.
STORIES260K = DATA / "stories260k"
# Five TinyStories stories, in-domain text for stories260K (see TINYSTORIES_NOTICE.md).
TINYSTORIES_SAMPLE = DATA / "tinystories_sample_cs336.txt"

# Names accepted wherever a model is expected (expand, plan, inspect, verify, ppl, study, diagnose).
BUNDLED_MODELS = {"bundled:stories260k": STORIES260K}
# Names accepted wherever a text is expected (verify/ppl --text, study --train/--eval, diagnose --text).
BUNDLED_TEXTS = ("bundled:tinystories-sample", "bundled:wikitext-test")
