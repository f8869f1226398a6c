"""The options of `--method ot` (the option group ``ot``; see docs/ot.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from otdus_cli.methods.base import Flag

OTVariant = Literal["paper", "official", "structured", "activation"]
OTSolver = Literal["sinkhorn", "emd"]

# The bundled text that no study run evaluates on (study-table6: held-out TinyStories stories of
# the 2 MiB training head, WikiText-2 test): five TinyStories stories, in-domain for stories260K.
DEFAULT_CALIB = "bundled:tinystories-sample"
DEFAULT_CALIB_TOKENS = 4096  # an upper bound: the text's whole windows up to this many tokens
MIN_CALIB_TOKENS = 512  # fewer samples than this make the correlations mostly noise (sd ~ 1/sqrt(n))


class OTOptions(BaseModel):
    """Options of `--method ot` (see docs/ot.md)."""

    model_config = ConfigDict(extra="forbid")

    variant: Annotated[
        OTVariant,
        Flag(
            "--ot-variant",
            "OT-DUS variant. paper: the paper's layer flow with Imfeld et al.'s conventions (plans "
            "scaled by n, max-normalised cost); official: the released script's computation (unscaled "
            "plans, raw cost, POT); structured: ours; activation: structured's flow with neurons and heads "
            "matched by their activations on --calib text. Sources: docs/ot.md.",
            plan=True,
        ),
    ] = "paper"
    solver: Annotated[OTSolver, Flag("--solver", "Transport solver; emd: exact assignment.")] = "sinkhorn"
    reg: Annotated[
        float,
        Flag(
            "--reg",
            "Sinkhorn entropic regularisation, relative to the largest cost (absolute on "
            "official's raw cost).",
        ),
    ] = Field(0.06, gt=0)
    tol: Annotated[
        float,
        Flag(
            "--tol",
            "Sinkhorn stopping tolerance (otdus's rule): largest relative row/column mass error "
            "(the official variant pins the released code's 1e-9).",
            default="1e-6",
        ),
    ] = Field(1e-6, gt=0)
    max_iter: Annotated[int, Flag("--max-iter", "Sinkhorn iteration cap (official pins 10000).")] = Field(
        2000, gt=0
    )
    # activation variant: calibration text (a file or bundled:NAME) and at most this many tokens of it
    calib: Annotated[
        str,
        Flag(
            "--calib",
            "Calibration text of --ot-variant activation: a UTF-8 file or bundled:NAME "
            "(bundled:tinystories-sample, bundled:wikitext-test).",
        ),
    ] = DEFAULT_CALIB
    calib_tokens: Annotated[
        int,
        Flag(
            "--calib-tokens",
            "At most this many calibration tokens (whole windows of 256); the text must give at least 512.",
        ),
    ] = Field(DEFAULT_CALIB_TOKENS, ge=MIN_CALIB_TOKENS)

    @model_validator(mode="after")
    def _official_has_one_solver(self) -> OTOptions:
        if self.variant == "official" and self.solver != "sinkhorn":
            raise ValueError(
                "--ot-variant official reproduces the released code's POT Sinkhorn and has no emd solver "
                "(use --ot-variant paper or structured with --solver emd)"
            )
        return self
