"""The teacher's identity a checkpoint records (rlbatch.grpo.teacher_identity): an in-process
teacher is its weight files' content, wherever they lie; a served one its log-probs of a fixed
probe; a resume names the teacher's key when they differ (end to end in
tests/e2e/test_distill_cli.py and test_served_teacher_cli.py)."""

from __future__ import annotations

import shutil

from rlbatch.cli.common import compose
from rlbatch.grpo.teacher_identity import (
    PROBE_TOLERANCE,
    files_digest,
    identity_errors,
    same_teacher,
)


def test_a_teacher_is_its_weights_not_its_path(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "a" / "config.json").write_text("{}")
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    assert files_digest(tmp_path / "a") == files_digest(tmp_path / "moved")
    (tmp_path / "moved" / "config.json").write_text('{"x": 1}')  # not weights
    assert files_digest(tmp_path / "a") == files_digest(tmp_path / "moved")
    (tmp_path / "moved" / "model.safetensors").write_bytes(b"x" * 999 + b"y")  # same size
    assert files_digest(tmp_path / "a") != files_digest(tmp_path / "moved")


def test_served_probes_compare_within_the_tolerance_and_errors_name_the_key(tmp_path):
    saved = {"kind": "probe", "logps": [-1.0, -2.0], "where": "http://a:1"}
    near = {"kind": "probe", "logps": [-1.0, -2.0 + PROBE_TOLERANCE / 2]}
    far = {"kind": "probe", "logps": [-1.0, -2.1]}
    assert same_teacher(saved, near) and not same_teacher(saved, far)
    assert not same_teacher(saved, {"kind": "files", "digest": "0"})
    cfg = compose(["+recipe=grpo_qwen"], "test")
    cfg.grpo.distill.teacher_url = "http://b:2"
    assert identity_errors(cfg, saved, near, tmp_path) == []
    (err,) = identity_errors(cfg, saved, far, tmp_path)
    assert err.key == "grpo.distill.teacher_url" and err.value == "http://b:2"
    assert "then http://a:1" in err.message and "log-probs of a fixed probe differ" in err.message
    (err,) = identity_errors(cfg, saved, None, tmp_path)  # the server could not be asked
    assert err.key == "grpo.distill.teacher_url"
