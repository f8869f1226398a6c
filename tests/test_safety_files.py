"""Safe by what files are, not by their names (docs/safety.md).

--force replaces an earlier output only while every file is what otdus wrote (sizes and hashes in
its manifest); the source is protected by real location and inode on every path; the lock file is
never a link or a file otdus did not make; stale folders are swept or reported truthfully; a file
that cannot be deleted after the swap leaves the new output in place and says where the old one is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from otdus_cli.errors import OtdusError
from otdus_cli.expand import expand
from otdus_cli.io import file_hashes
from otdus_cli.io.output_dir import DEEPER_TAG, TMP_TAG, OutputLock
from otdus_cli.options import ExpandOptions
from tests.support.cli_checks import one_error_line
from tests.support.file_checks import OTDUS, leftovers, run_cli, tree_digest
from tests.support.tiny_models import load_causal_lm


@pytest.fixture()
def earlier_output(stories, tmp_path) -> Path:
    out = tmp_path / "earlier"
    expand(str(stories), out, ExpandOptions(method="copy", layers=1))
    return out


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


# -- the manifest records every file otdus wrote -------------------------------------------------------
def test_manifest_records_size_and_hash_of_every_file_written(earlier_output):
    manifest = json.loads((earlier_output / "otdus.json").read_text())
    files = manifest["files"]
    assert set(files) == {p.name for p in earlier_output.iterdir()} - {"otdus.json"}
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= set(files)
    for name, record in files.items():
        data = (earlier_output / name).read_bytes()
        assert record == {"size": len(data), "hashed": "whole", "sha256": hashlib.sha256(data).hexdigest()}


def test_sampled_hash_of_a_large_file_sees_header_tail_and_strided_blocks(tmp_path):
    big = tmp_path / "model-00001-of-00002.safetensors"
    size = file_hashes.WHOLE_LIMIT + 5 * file_hashes.BLOCK + 123
    with open(big, "wb") as f:
        f.truncate(size)  # sparse: no data written
    record = file_hashes.file_record(big)
    assert record["hashed"] == "sampled" and record["size"] == size
    offsets = file_hashes._offsets(size)
    assert offsets[0] == 0 and offsets[-1] == size - file_hashes.BLOCK and len(offsets) == file_hashes.BLOCKS
    for where in (10, size - 1, offsets[7] + 17):  # header, tail, a block in the middle
        with open(big, "r+b") as f:
            f.seek(where)
            f.write(b"\x01")
        assert file_hashes.file_changes(tmp_path, {big.name: record}) == [f"{big.name} (content)"]
        with open(big, "r+b") as f:
            f.seek(where)
            f.write(b"\x00")
        assert file_hashes.file_changes(tmp_path, {big.name: record}) == []


# -- --force replaces only an unchanged otdus output --------------------------------------------------
def _force(stories: Path, out: Path, *extra: str):
    return run_cli("expand", stories, "--out", out, "--force", "--method", "copy", "--layers", "2", *extra)


def test_force_refuses_an_output_a_model_was_saved_into(stories, earlier_output):
    """A fine-tune save_pretrained'd into the expanded folder (same file names) is never deleted."""
    model = load_causal_lm(earlier_output)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(0.01)
    model.save_pretrained(earlier_output)
    before = tree_digest(earlier_output)
    line = one_error_line(_force(stories, earlier_output))
    assert "changed since otdus wrote them" in line and "model.safetensors (" in line
    assert "choose another --out, or move or delete the folder yourself" in line
    assert tree_digest(earlier_output) == before and leftovers(earlier_output.parent) == []


@pytest.mark.parametrize("edit", ["same-size-middle", "side-file", "deleted", "link"])
def test_force_refuses_an_output_with_any_file_changed(stories, earlier_output, edit):
    shard = earlier_output / "model.safetensors"
    if edit == "same-size-middle":  # tensor data edited in place: the size and header stay the same
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        expected = "model.safetensors (content)"
    elif edit == "side-file":
        with open(earlier_output / "tokenizer_config.json", "a") as f:
            f.write(" ")
        expected = "tokenizer_config.json (size"
    elif edit == "deleted":
        (earlier_output / "generation_config.json").unlink()
        expected = "generation_config.json (deleted)"
    else:  # a file replaced by a link to someone's copy
        mine = earlier_output.parent / "mine.json"
        mine.write_text((earlier_output / "config.json").read_text())
        (earlier_output / "config.json").unlink()
        (earlier_output / "config.json").symlink_to(mine)
        expected = "config.json (now a link"
    before = tree_digest(earlier_output.parent)
    line = one_error_line(_force(stories, earlier_output))
    assert expected in line and "1 of its files changed" in line, line
    assert tree_digest(earlier_output.parent) == before


def test_force_refuses_an_output_whose_manifest_records_no_hashes(stories, earlier_output):
    """An output of an otdus version that recorded no hashes cannot be checked: refused, not guessed."""
    path = earlier_output / "otdus.json"
    manifest = json.loads(path.read_text())
    del manifest["files"]
    path.write_text(json.dumps(manifest))
    before = tree_digest(earlier_output)
    line = one_error_line(_force(stories, earlier_output))
    assert "earlier otdus version" in line and "records no hashes" in line
    assert tree_digest(earlier_output) == before


def test_the_manifest_records_the_hash_of_its_own_canonical_content(earlier_output):
    manifest = json.loads((earlier_output / "otdus.json").read_text())
    assert list(manifest)[-1] == "manifest_sha256"
    content = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    assert manifest["manifest_sha256"] == hashlib.sha256(canonical).hexdigest()


def _rewrite_manifest(folder: Path, edit, seal: bool = False) -> None:
    path = folder / "otdus.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(file_hashes.sealed(manifest) if seal else manifest, indent=2))


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda m: m.update(method="ot"), "otdus.json was edited since otdus wrote it"),
        (lambda m: m["files"].pop("tokenizer.json"), "otdus.json was edited since otdus wrote it"),
        (lambda m: m.pop("manifest_sha256"), "records no hash of itself (an earlier otdus version)"),
    ],
    ids=["a value", "a file left out of its list", "its own hash removed"],
)
def test_force_refuses_an_output_whose_manifest_was_edited(stories, earlier_output, edit, expected):
    """The manifest covers itself: a manifest edited to list fewer files (so --force would delete one
    that is no longer otdus's), or to say anything else, is refused like an edited shard."""
    _rewrite_manifest(earlier_output, edit)
    before = tree_digest(earlier_output.parent)
    line = one_error_line(_force(stories, earlier_output))
    assert expected in line and "--force replaces only an unchanged otdus output" in line, line
    assert tree_digest(earlier_output.parent) == before


def test_force_replaces_a_manifest_only_reformatted(stories, earlier_output):
    """The hash is of the canonical content: the same manifest indented otherwise is unchanged."""
    path = earlier_output / "otdus.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=8))
    assert _force(stories, earlier_output).exit_code == 0


@pytest.mark.parametrize(
    ("edit", "damaged"),
    [
        (lambda m: m["files"].update({"model.safetensors\x00x": m["files"]["config.json"]}), "files"),
        (lambda m: m["files"].update({"..": m["files"]["config.json"]}), "files"),
        (lambda m: m["copied_files"].append("../../.bashrc"), "copied_files"),
        (lambda m: m["copied_files"].append("tokenizer.json\x00"), "copied_files"),
    ],
    ids=["files: NUL", "files: ..", "copied_files: outside", "copied_files: NUL"],
)
def test_a_manifest_naming_a_file_outside_its_folder_is_damaged(stories, earlier_output, edit, damaged):
    """Entries are file names inside the output folder, checked on read, even under a valid hash: one
    error line (exit 2) from --force, verify and inspect, never an unexpected error."""
    _rewrite_manifest(earlier_output, edit, seal=True)
    before = tree_digest(earlier_output.parent)
    line = one_error_line(_force(stories, earlier_output))
    assert "the file list of its otdus.json is damaged" in line, line
    for command in (["verify", earlier_output, "--static"], ["inspect", earlier_output]):
        line = one_error_line(run_cli(*command))
        assert f"otdus.json is damaged ({damaged}: Value error, " in line, line
        assert "is not the name of a file in the output folder" in line and "\x00" not in line
    assert tree_digest(earlier_output.parent) == before


def test_force_says_when_it_replaced_an_earlier_output(stories, earlier_output, tmp_path):
    result = _force(stories, earlier_output)
    assert result.exit_code == 0, result.output
    assert f"wrote {earlier_output} (replacing the earlier otdus output there)" in result.stdout
    assert json.loads((earlier_output / "config.json").read_text())["num_hidden_layers"] == 7
    again = _force(stories, earlier_output, "--json")
    assert json.loads(again.stdout)["replaced_earlier_output"] is True
    fresh = run_cli("expand", stories, "--out", tmp_path / "fresh", "--method", "copy", "--json")
    assert json.loads(fresh.stdout)["replaced_earlier_output"] is False
    plain = run_cli("expand", stories, "--out", tmp_path / "plain", "--method", "copy")
    assert "replacing" not in plain.stdout


# -- the source is protected by what its files are -------------------------------------------------------
@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_source_whose_shard_links_into_the_forced_output_is_protected(
    stories, earlier_output, tmp_path, link
):
    source = tmp_path / "linked-source"  # a model of its own, but its shard is the earlier output's
    shutil.copytree(earlier_output, source)
    (source / "model.safetensors").unlink()
    if link == "symbolic":
        (source / "model.safetensors").symlink_to(earlier_output / "model.safetensors")
    else:
        os.link(earlier_output / "model.safetensors", source / "model.safetensors")
    before = tree_digest(tmp_path)
    line = one_error_line(_force(source, earlier_output))
    assert "source model" in line and "the input is never modified" in line
    assert tree_digest(tmp_path) == before and leftovers(tmp_path) == []


def test_a_recipe_cannot_force_over_a_linked_source_either(earlier_output, tmp_path):
    source = tmp_path / "linked-source"
    shutil.copytree(earlier_output, source)
    (source / "model.safetensors").unlink()
    (source / "model.safetensors").symlink_to(earlier_output / "model.safetensors")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {source}\nout: {earlier_output}\nexpand:\n  method: copy\n  layers: 2\n")
    before = tree_digest(tmp_path)
    line = one_error_line(run_cli("expand", "--recipe", recipe, "--force"))
    assert "a file of the source model" in line
    assert tree_digest(tmp_path) == before and leftovers(tmp_path) == []


def test_expand_experts_never_replaces_its_own_source(tiny_models, tmp_path):
    """`expand X --experts 2 --force --out X`, X an earlier otdus output, as plain expand and widen."""
    earlier = tmp_path / "moe"
    expand(str(tiny_models["qwen3_moe"]), earlier, ExpandOptions(method="copy", layers=1))
    before = tree_digest(tmp_path)
    args = ("expand", earlier, "--out", earlier, "--force", "--method", "copy", "--experts", "2")
    line = one_error_line(run_cli(*args))
    assert "source model" in line
    assert tree_digest(tmp_path) == before and leftovers(tmp_path) == []


def test_widen_and_expand_experts_protect_a_linked_source(tiny_models, tmp_path):
    earlier = tmp_path / "earlier"
    expand(str(tiny_models["qwen3_moe"]), earlier, ExpandOptions(method="copy", layers=1))
    source = tmp_path / "source"
    shutil.copytree(earlier, source)
    (source / "config.json").unlink()
    (source / "config.json").symlink_to(earlier / "config.json")
    before = tree_digest(tmp_path)
    for args in (["widen", source], ["expand", source, "--method", "copy", "--experts", "2"]):
        line = one_error_line(run_cli(*args, "--out", earlier, "--force"))
        assert "a file of the source model" in line, line
        assert tree_digest(tmp_path) == before and leftovers(tmp_path) == []


# -- the lock file -------------------------------------------------------------------------------------
def _lock_of(out: Path) -> Path:
    return out.parent / f".{out.name}.otdus-lock"


@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "hard-link", "foreign-file", "folder"])
def test_lock_never_follows_a_link_nor_touches_a_foreign_file(stories, tmp_path, kind):
    out = tmp_path / "out"
    lock = _lock_of(out)
    precious = tmp_path / "precious.txt"
    precious.write_text("a user's file")
    if kind == "symlink":
        lock.symlink_to(precious)
    elif kind == "dangling-symlink":
        lock.symlink_to(tmp_path / "would-be-created")
    elif kind == "hard-link":
        os.link(precious, lock)
    elif kind == "foreign-file":
        lock.write_text("not an otdus record")
    else:
        lock.mkdir()
    before = tree_digest(tmp_path)
    line = one_error_line(run_cli("expand", stories, "--out", out, "--method", "copy"))
    assert str(lock) in line and "otdus never touches it" in line, line
    assert tree_digest(tmp_path) == before and os.path.lexists(lock)
    assert precious.read_text() == "a user's file" and not (tmp_path / "would-be-created").exists()
    assert not out.exists()


def test_lock_without_unnamed_files_is_created_exclusively_too(tmp_path, monkeypatch):
    """Where O_TMPFILE is missing, the lock file is made with O_CREAT | O_EXCL | O_NOFOLLOW: the same
    refusals, and release removes only that file."""
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    out = tmp_path / "out"
    lock = OutputLock(out)
    lock.acquire()
    assert json.loads(_lock_of(out).read_text())["pid"] == os.getpid()
    with pytest.raises(OtdusError, match="another otdus run"):
        OutputLock(out).acquire()
    lock.release()
    assert not os.path.lexists(_lock_of(out))
    precious = tmp_path / "precious.txt"
    precious.write_text("a user's file")
    _lock_of(out).symlink_to(precious)
    with pytest.raises(OtdusError, match="is a symbolic link"):
        OutputLock(out).acquire()
    assert precious.read_text() == "a user's file" and _lock_of(out).is_symlink()


def test_a_stale_otdus_lock_is_taken_over(stories, tmp_path):
    out = tmp_path / "out"
    record = {"pid": _dead_pid(), "host": socket.gethostname(), "started": "2026-01-01T00:00:00"}
    _lock_of(out).write_text(json.dumps(record))  # left by a run killed with SIGKILL: nobody holds it
    result = run_cli("expand", stories, "--out", out, "--method", "copy")
    assert result.exit_code == 0, result.output
    assert (out / "otdus.json").is_file() and leftovers(tmp_path) == []


_NAMESPACE = ["unshare", "--user", "--map-root-user", "--mount"]


def _namespaces_work() -> bool:
    return shutil.which("unshare") is not None and subprocess.run([*_NAMESPACE, "true"]).returncode == 0


needs_namespaces = pytest.mark.skipif(
    not _namespaces_work(), reason="needs unprivileged user and mount namespaces (unshare -rm)"
)


@needs_namespaces
def test_disk_full_leaves_no_lock_file_behind(stories, tmp_path):
    """At 0 free blocks the lock file can be created but not written: it is removed again, so
    "nothing was left behind" is true."""
    full = tmp_path / "full"
    full.mkdir()
    script = (
        f"mount -t tmpfs -o size=64k tmpfs {full} && (dd if=/dev/zero of={full}/fill bs=4k 2>/dev/null; "
        f"true) && {OTDUS} expand {stories} --out {full}/out --method copy; echo rc=$? >&2; ls -A {full}"
    )
    proc = subprocess.run([*_NAMESPACE, "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert "rc=2" in proc.stderr and "disk full" in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["fill"], proc.stdout


# -- the swap's clean-up and the sweep -----------------------------------------------------------------
@needs_namespaces
def test_a_file_not_deletable_after_the_swap_is_reported_and_the_run_succeeds(stories, earlier_output):
    """A file of the earlier output that cannot be deleted (here a mount point: EBUSY): the new
    output is in place, exit 0, and one warning says where the old files are left."""
    busy = earlier_output / "config.json"
    cmd = f"{OTDUS} expand {stories} --out {earlier_output} --force --method copy --layers 2"
    proc = subprocess.run(
        [*_NAMESPACE, "sh", "-c", f"mount --bind {busy} {busy} && exec {cmd}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((earlier_output / "config.json").read_text())["num_hidden_layers"] == 7
    left = [p for p in earlier_output.parent.iterdir() if TMP_TAG in p.name]
    assert len(left) == 1 and sorted(p.name for p in left[0].iterdir()) == ["config.json"]
    warnings = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and "the new output is in place" in warnings[0], proc.stderr
    assert str(left[0]) in warnings[0] and "Traceback" not in proc.stderr


def test_a_stale_entry_that_is_a_symlink_is_kept_and_said_so(stories, tmp_path):
    target = tmp_path / "their-folder"
    target.mkdir()
    (target / "data.bin").write_text("theirs")
    link = tmp_path / f".out.{TMP_TAG}{_dead_pid()}@{socket.gethostname()}.zzzz"
    link.symlink_to(target)
    result = run_cli("expand", stories, "--out", tmp_path / "out", "--method", "copy")
    assert result.exit_code == 0, result.output
    assert f"{link} is a symbolic link" in result.stderr and "kept" in result.stderr
    assert f"removed {link}" not in result.stderr
    assert link.is_symlink() and (target / "data.bin").read_text() == "theirs"


def test_expand_experts_scratch_left_by_sigkill_is_swept_by_the_next_run(tiny_models, tmp_path):
    out = tmp_path / "out"
    cmd = [OTDUS, "expand", str(tiny_models["qwen3_moe"]), "--out", str(out), "--method", "copy"]
    proc = subprocess.Popen([*cmd, "--experts", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not [p for p in tmp_path.iterdir() if "otdus-deeper" in p.name]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    scratch = [p for p in tmp_path.iterdir() if "otdus-deeper" in p.name]
    assert scratch and scratch[0].name.startswith(f".out.{DEEPER_TAG}{proc.pid}@")
    result = run_cli(*cmd[1:], "--experts", "2")
    assert result.exit_code == 0, result.output
    assert f"removed {scratch[0]}" in result.stderr
    assert leftovers(tmp_path) == []


def test_expand_experts_says_each_sweep_once(tiny_models, tmp_path):
    """The stale folder the widen step sweeps is said when removed, and not again with the summary's
    warnings: one removal, one line (a repeated line reads as a second folder removed)."""
    out = tmp_path / "out"
    stale = tmp_path / f".out.{TMP_TAG}{_dead_pid()}@{socket.gethostname()}.zzzz"
    stale.mkdir()
    cmd = ["expand", tiny_models["qwen3_moe"], "--out", out, "--method", "copy", "--experts", "2"]
    result = run_cli(*cmd)
    assert result.exit_code == 0, result.output
    assert result.stderr.count(f"removed {stale}, left by an otdus run that died") == 1, result.stderr
    assert not stale.exists() and leftovers(tmp_path) == []


def test_widen_says_the_manifest_warnings_and_each_sweep_once(tiny_models, tmp_path, monkeypatch):
    """`otdus widen` prints what its manifest warns of (here a config check transformers could not
    make), as expand does, and a stale folder it swept once."""
    from otdus_cli import widen

    skipped = "transformers 9.9 does not know model_type 'qwen3_moe'; checked by otdus's depth rules"
    monkeypatch.setattr(widen, "validate_with_transformers", lambda folder, depth: skipped)
    stale = tmp_path / f".out.{TMP_TAG}{_dead_pid()}@{socket.gethostname()}.zzzz"
    stale.mkdir()
    result = run_cli("widen", tiny_models["qwen3_moe"], "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert result.stderr.count(f"warning: {skipped}") == 1, result.stderr
    assert result.stderr.count(f"removed {stale}, left by an otdus run that died") == 1, result.stderr
    manifest = json.loads((tmp_path / "out" / "otdus.json").read_text())
    assert manifest["warnings"] == [skipped] and not manifest["config_checked_by_transformers"]


def test_shrink_says_a_stale_folder_it_swept_once(stories, tmp_path):
    stale = tmp_path / f".out.{TMP_TAG}{_dead_pid()}@{socket.gethostname()}.zzzz"
    stale.mkdir()
    result = run_cli("shrink", stories, "--out", tmp_path / "out", "--method", "drop", "--remove", "2")
    assert result.exit_code == 0, result.output
    assert result.stderr.count(f"removed {stale}, left by an otdus run that died") == 1, result.stderr
    assert not stale.exists() and leftovers(tmp_path) == []
