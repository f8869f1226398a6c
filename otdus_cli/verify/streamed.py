"""What the streamed evaluator's helpers read of it (verify/streaming.py: StreamedModel).

The head pass and the self-check (verify/head_pass.py, verify/self_check.py) run parts of the
evaluator's forward; the evaluator calls them, so they name it by this protocol, not by importing it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class Streamed(Protocol):
    reader: Any  # io/reader.py: CheckpointReader
    folder: Path
    device: torch.device
    dtype: torch.dtype
    attn_implementation: str | None
    stated_config: Any  # the PretrainedConfig from_pretrained must be given (None: config.json as it is)
    head_takes_embeddings: bool | None
    model: Any  # the transformers skeleton (meta tensors but the loaded layer)
    config: Any  # its PretrainedConfig
    text_config: Any
    weights: Any  # verify/checkpoint_weights.py: CheckpointWeights
    calls: Any  # verify/layer_calls.py: LayerCalls
