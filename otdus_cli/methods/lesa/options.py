"""The options of `--method lesa` (its flags and recipe keys), apart from the builder that reads them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from otdus_cli.methods.base import Flag

LesaVariant = Literal["pair", "published"]


class LesaOptions(BaseModel):
    """Options of `--method lesa` (builder.py). The predictor's defaults are the published ones
    (the LESA authors' notebook: MLP 2d -> 256 -> 256 -> d, AdamW lr 1e-3, 10 epochs, batch 64,
    norm-term weight 0.0005)."""

    model_config = ConfigDict(extra="forbid")

    variant: Annotated[
        LesaVariant,
        Flag(
            "--lesa-variant",
            "LESA variant. pair (ours): the tensors LESA does not predict (norms, biases) from the pair; "
            "with zero-init, its default, the output is function-preserving. published: the LESA notebook's "
            "output: those tensors are base layer 0's and nothing is zeroed, so the new layers change the "
            "model's function (verify reports the change instead of expecting parity; add --zero-init to "
            "preserve it). docs/methods.md: LESA.",
            plan=True,
        ),
    ] = "pair"
    hidden: int = Field(256, ge=1, description="hidden width of the predictor MLP")
    epochs: Annotated[int, Flag("--lesa-epochs", "LESA predictor training epochs.")] = Field(10, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0, description="AdamW's (torch's default)")
    norm_weight: float = Field(0.0005, ge=0, le=1, description="lambda of the norm term in the loss")
    rank: Annotated[
        int | None,
        Flag(
            "--lesa-rank",
            "Keep only the top-k singular directions per projection type (less memory and time; "
            "new weights of rank <= k).",
            default="all, as published",
        ),
    ] = Field(None, ge=1, description="keep the top-k singular directions (default all)")
    loo: Annotated[
        int,
        Flag(
            "--lesa-loo",
            "Layers held out (one at a time, one extra training each) for LESA's leave-one-out "
            "check; 0 skips it.",
        ),
    ] = Field(1, ge=0, description="layers held out, one at a time, for the leave-one-out check")
