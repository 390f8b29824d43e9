"""Checkpoint integrity: the manifest is the commit point, damage of any kind is found, resume
falls back to the newest intact checkpoint, pruning never costs an intact one, and a full disk
is reported as such with the previous checkpoints kept."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

from rlbatch.train import integrity
from rlbatch.train.checkpoint import (
    latest_checkpoint,
    resume_candidates,
    save_checkpoint,
    verify_share,
)


def _save(root, step, keep_last=5):
    return save_checkpoint(root, step, {"w": torch.full((1000,), float(step))}, keep_last=keep_last)


def test_manifest_lists_every_file_with_size_and_crc32(tmp_path):
    path = _save(tmp_path, 2)
    manifest = json.loads((path / "manifest.json").read_text())
    on_disk = sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == on_disk == ["meta.json", "rank_00000.pt"]
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert verify_share(path, 0, 1) == []


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip", "no_manifest", "bad_meta"])
def test_damaged_newest_falls_back_to_the_older_intact_one(tmp_path, damage):
    _save(tmp_path, 2)
    newest = _save(tmp_path, 4)
    rank_file = newest / "rank_00000.pt"
    data = rank_file.read_bytes()
    if damage == "truncate":
        rank_file.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        rank_file.unlink()
    elif damage == "flip":  # same size: only the checksum can tell
        rank_file.write_bytes(data[:-100] + bytes(b ^ 0xFF for b in data[-100:]))
    elif damage == "no_manifest":
        (newest / "manifest.json").unlink()
    else:
        (newest / "meta.json").write_text("{not json")
    candidates, skipped = resume_candidates("auto", tmp_path)
    if damage == "flip":
        assert candidates == [newest, tmp_path / "step_00000002"] and not skipped
        assert "rank_00000.pt is corrupt" in verify_share(newest, 0, 1)[0]
    else:
        assert candidates == [tmp_path / "step_00000002"]
        assert [f.path.name for f in skipped] == ["step_00000004"]
        expected = {
            "truncate": f"rank_00000.pt has {len(data) // 2} bytes, the manifest says {len(data)}",
            "delete": "rank_00000.pt missing",
            "no_manifest": "no manifest.json (the save did not finish)",
            "bad_meta": "meta.json",
        }[damage]
        assert any(expected in p for p in skipped[0].problems), skipped[0].problems
        assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"


def test_none_intact_is_an_error_that_lists_them_and_deletes_nothing(tmp_path):
    for path in [_save(tmp_path, 2), _save(tmp_path, 4)]:
        (path / "meta.json").write_text("")
    with pytest.raises(integrity.NoIntactCheckpointError) as err:
        resume_candidates("auto", tmp_path)
    message = str(err.value)
    assert "step_00000004 (meta.json has 0 bytes, the manifest says" in message
    assert "step_00000002 (meta.json has 0 bytes, the manifest says" in message
    assert "trainer.resume=none" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000004"]
    assert resume_candidates("none", tmp_path) == ([], [])
    assert resume_candidates("auto", tmp_path / "empty") == ([], [])


def test_pruning_keeps_intact_checkpoints_when_a_newer_one_is_damaged(tmp_path):
    _save(tmp_path, 2, keep_last=2)
    damaged = _save(tmp_path, 4, keep_last=2)
    (damaged / "rank_00000.pt").write_bytes(b"torn")
    _save(tmp_path, 6, keep_last=2)
    # keep_last=2 counts intact checkpoints only: 2 and 6; the damaged 4 is newer than 2: kept
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step_00000002", "step_00000004", "step_00000006"]
    _save(tmp_path, 8, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000006", "step_00000008"]


def test_free_space_check_names_path_and_sizes(tmp_path):
    assert integrity.free_space_problem(tmp_path, 3, 1024) is None
    _save(tmp_path, 2)
    problem = integrity.free_space_problem(tmp_path, 3, 1 << 60)
    assert problem is not None
    assert problem.startswith(f"no space left on the file system of {tmp_path}")
    assert "checkpoint step 3: it needs about 1073741824.0 GiB" in problem
    assert "are free" in problem and "step_00000002" in problem


ENOSPC_SCRIPT = """
import sys, torch
from rlbatch.train.checkpoint import save_checkpoint, latest_checkpoint, load_checkpoint
from rlbatch.train.integrity import CheckpointSpaceError
root = sys.argv[1]
save_checkpoint(root, 1, {"w": torch.ones(1000)})
try:
    save_checkpoint(root, 2, {"w": torch.ones(4 << 20)})  # 16 MiB on a 2 MiB file system
except CheckpointSpaceError as err:
    print("ERROR", err)
print("LATEST", latest_checkpoint(root).name, float(load_checkpoint(latest_checkpoint(root))["w"][0]))
"""


def test_disk_full_during_save_says_no_space_and_keeps_previous(tmp_path):
    """A real 2 MiB file system (tmpfs in a private mount namespace)."""
    mount = tmp_path / "small"
    mount.mkdir()
    script = textwrap.dedent(ENOSPC_SCRIPT)
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c",
         f'mount -t tmpfs -o size=2m tmpfs "{mount}" && "{sys.executable}" -c "$0" "{mount}"',
         script],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ERROR [Errno 28] no space left on the file system of" in proc.stdout, proc.stdout
    assert "checkpoint step 2" in proc.stdout and "step_00000001" in proc.stdout
    assert "LATEST step_00000001 1.0" in proc.stdout


def test_checkpoint_written_before_manifests_still_resumes(tmp_path):
    """A complete checkpoint of the format before manifests (committed by an atomic rename,
    meta.json format 2) resumes, unverified; a current-format one without its manifest is a
    damaged save and is skipped."""
    old = _save(tmp_path, 2)
    (old / "manifest.json").unlink()
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({**meta, "format": integrity.MANIFEST_SINCE - 1}))
    candidates, skipped = resume_candidates("auto", tmp_path)
    assert candidates == [old] and not skipped
    assert verify_share(old, 0, 1) == []
    newer = _save(tmp_path, 4)
    (newer / "manifest.json").unlink()
    candidates, skipped = resume_candidates("auto", tmp_path)
    assert candidates == [old] and [f.path for f in skipped] == [newer]
