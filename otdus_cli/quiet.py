"""Library calls that load models for verification keep transformers quiet: no advisories, no bars.

A user of the Python API asked for figures; transformers' own warnings about configs and its loading
bars are not theirs to read. The settings are restored when the call returns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

Fn = TypeVar("Fn", bound=Callable[..., Any])


def quiet_transformers(fn: Fn) -> Fn:
    """Run ``fn`` with transformers' logging at error level and its progress bars off."""

    @functools.wraps(fn)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        from transformers.utils import logging as hf_logging  # heavy import

        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            return fn(*args, **kwargs)
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()

    return quiet  # type: ignore[return-value]
