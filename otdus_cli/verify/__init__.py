"""Perplexity and function-preservation checks, evaluated layer by layer from the checkpoint.

- ``text``: evaluation corpora (bundled WikiText-2 test split, text files, optional HF datasets);
- ``metrics``: the lm-eval ``wikitext`` and GPTQ token-perplexity protocols (plans and formulas);
- ``streaming``: ``StreamedModel``, a transformers model run one decoder layer at a time;
- ``hf_compat``: every transformers detail beyond the public API that ``streaming`` relies on, per version;
- ``self_check``: the evaluator's logits on a short input against transformers' own forward;
- ``compare``: ``make_plan``, ``perplexity`` (``otdus ppl``) and ``verify_expansion`` (``otdus verify``).

Submodules import torch/transformers; import them where needed.
"""
