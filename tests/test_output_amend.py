"""`verify --card` changes an otdus output in place (io/output_amend.py): only one still as otdus
wrote it, checked before any work and again under the output's lock; the card and the manifest
replaced together, the manifest's hashes kept true; a failure or a signal part way changes nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from otdus_cli.card import CARD, add_verification
from otdus_cli.errors import Interrupted, OtdusError
from otdus_cli.expand import expand
from otdus_cli.io.output_amend import amended_output, check_amendable
from otdus_cli.io.output_dir import TMP_TAG, earlier_output_files
from otdus_cli.io.output_lock import OutputLock
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import one_error_line
from tests.support.file_checks import leftovers, run_cli, tree_digest

VERIFY = [
    "--text",
    "bundled:tinystories-sample",
    "--max-tokens",
    "64",
    "--seq-len",
    "32",
    "--protocol",
    "token",
]
REPORT = {  # a verify report as VerifyReport.to_dict() gives it, what the card section reads
    "verdict": "PARITY: function preserved",
    "device": "cpu",
    "dtype": "float32",
    "base": {"corpus": "c", "protocol": "token", "n_tokens": 64, "token_perplexity": 2.0},
    "expanded": {"token_perplexity": 2.0},
    "logits_equal": True,
    "logprob_max_abs_diff": 0.0,
    "expect_parity": True,
    "tolerance": 0.0,
    "base_model": "somewhere",
}


@pytest.fixture
def output(stories, tmp_path) -> Path:
    out = tmp_path / "out"
    expand(str(stories), out, ExpandOptions(method="copy", layers=1))
    return out


def test_a_changed_output_is_refused_before_verifying(output):
    """A fine-tune saved into the output: its card is otdus's, but the output is no longer what the
    card would describe; refused before the perplexity run, nothing touched."""
    shard = output / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    before = tree_digest(output)
    result = run_cli("verify", output, *VERIFY, "--card")
    one_error_line(result, message="model.safetensors (content)")
    assert "PARITY" not in result.output and tree_digest(output) == before


def test_a_linked_output_and_an_older_manifest_are_refused(output, tmp_path):
    (tmp_path / "link").symlink_to(output)
    one_error_line(run_cli("verify", tmp_path / "link", *VERIFY, "--card"), message="symbolic link")
    manifest = json.loads((output / "otdus.json").read_text())
    del manifest["files"]  # as otdus <= 0.1.x wrote it: whether its files changed cannot be told
    del manifest["manifest_sha256"]  # nor whether the manifest itself did
    (output / "otdus.json").write_text(json.dumps(manifest))
    before = tree_digest(output)
    one_error_line(run_cli("verify", output, *VERIFY, "--card"), message="cannot tell whether they changed")
    assert tree_digest(output) == before


def test_the_card_and_the_manifest_stay_consistent(output):
    data = add_verification(output, REPORT)
    assert (output / CARD).read_bytes() == data
    manifest = json.loads((output / "otdus.json").read_text())
    assert manifest["card"]["sha256"] == manifest["files"][CARD]["sha256"]
    check_amendable(output, "--card")  # every recorded hash true again
    assert CARD in earlier_output_files(output)
    assert not leftovers(output.parent) and not [p for p in output.iterdir() if p.name.startswith(".")]


def test_a_failure_or_a_signal_part_way_changes_nothing(output):
    before = tree_digest(output)
    for raised in (OSError(28, "No space left on device"), Interrupted(signal.SIGTERM)):
        with pytest.raises(type(raised)), amended_output(output, [CARD], "--card") as amendment:
            (amendment.folder / CARD).write_text("half a card")
            raise raised
        assert tree_digest(output) == before and not leftovers(output.parent)


def test_a_run_holding_the_outputs_lock_keeps_the_card_unchanged(output):
    """An `expand --force` to that folder holds its lock: verify --card waits for no one, it refuses."""
    before = tree_digest(output)
    lock = OutputLock(Path(os.path.abspath(output)))
    lock.acquire()
    try:
        with pytest.raises(OtdusError, match="another otdus run"):
            add_verification(output, REPORT)
    finally:
        lock.release()
    assert tree_digest(output) == before


def test_a_dead_runs_temporary_folder_is_swept_and_said(output):
    """A verify --card SIGKILLed part way leaves its temporary folder beside the output; the next run
    there removes it, and says so."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    pid = int(dead.stdout)
    stale = output.parent / f".{output.name}.{TMP_TAG}{pid}@{socket.gethostname()}.abcd"
    stale.mkdir()
    (stale / CARD).write_text("half")
    notes: list[str] = []
    add_verification(output, REPORT, on_note=notes.append)
    assert not stale.exists() and len(notes) == 1 and "left by an otdus run that died" in notes[0]
