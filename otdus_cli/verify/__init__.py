"""Perplexity and function-preservation checks, evaluated layer by layer from the checkpoint.

- ``text``: evaluation corpora (bundled WikiText-2 test split, text files, optional HF datasets);
- ``metrics``: the lm-eval ``wikitext`` and GPTQ token-perplexity protocols (windows and formulas);
- ``streaming``: ``StreamedModel``, a transformers model run one decoder layer at a time, with
  ``checkpoint_weights`` (layers and the rest put on the device from the checkpoint), ``layer_calls``
  (the stand-ins inside the family's forward), ``batching`` (windows per forward pass) and
  ``head_pass`` (the logits);
- ``hf_compat``: every transformers detail beyond the public API that ``streaming`` relies on, per version;
- ``self_check``: the evaluator's logits on a short input against transformers' own forward;
- ``eval_set``: ``make_eval_set``, a corpus tokenised into one protocol's windows;
- ``perplexity``: ``perplexity`` (``otdus ppl``); ``compare``: ``verify_expansion`` (``otdus verify``),
  built from ``layer_map`` (which layers must agree), ``lockstep`` (both models side by side),
  ``parity`` (the rule and the verdict), ``compute`` (threads, batches, ranks, timings).

Submodules import torch/transformers; import them where needed.
"""
