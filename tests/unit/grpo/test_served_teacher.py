"""A served distillation teacher's keys and failures (rlbatch.config.distill,
rlbatch.grpo.served_teacher): the rules refuse every bad combination at once, naming the key;
a teacher server that refuses the connection or never answers stops the teacher pass with an
error naming the server's URL, the sample and the key to change (the scoring itself is checked
against a real vLLM server in tests/e2e/test_served_teacher_cli.py)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from rlbatch.cli.common import compose
from rlbatch.config.distill import distill_errors
from rlbatch.grpo.served_teacher import TeacherServerError, score_samples
from rlbatch.grpo.types import Prompt, Sample


def _errors(**distill):
    cfg = compose(["+recipe=grpo_qwen"], "test")
    for key, value in distill.items():
        if key == "temperature":
            cfg.rollout.temperature = value
        else:
            setattr(cfg.grpo.distill, key, value)
    return {(e.key, str(e.value)): e.message for e in distill_errors(cfg)}


def test_served_teacher_rules_name_each_key_at_once(tmp_path):
    found = _errors(
        teacher=str(tmp_path), teacher_url="localhost:8000", temperature=0.7,
        teacher_timeout_s=0.0, teacher_max_concurrency=0,
    )  # fmt: skip
    url = ("grpo.distill.teacher_url", "localhost:8000")
    assert set(found) == {
        url, ("rollout.temperature", "0.7"), ("grpo.distill.teacher_timeout_s", "0.0"),
        ("grpo.distill.teacher_max_concurrency", "0"),
    }  # fmt: skip
    # the URL's two problems are two errors under one key: the exclusivity and the scheme
    cfg = compose(["+recipe=grpo_qwen"], "test")
    cfg.grpo.distill.teacher, cfg.grpo.distill.teacher_url = str(tmp_path), "localhost:8000"
    messages = [e.message for e in distill_errors(cfg) if e.key == url[0]]
    assert any("exclusive with grpo.distill.teacher" in m for m in messages)
    assert any("http://HOST:PORT" in m for m in messages)
    assert "raw logits" in found[("rollout.temperature", "0.7")]
    # the teacher's server cannot be a rollout server too: the student's syncs would land on it
    cfg = compose(["+recipe=grpo_qwen"], "test")
    cfg.grpo.distill.teacher_url = "http://127.0.0.1:8000/"
    cfg.rollout.backend, cfg.rollout.servers.urls = "vllm_server", ["http://127.0.0.1:8000"]
    (shared,) = distill_errors(cfg)
    assert (
        shared.key == url[0] and "is the server http://127.0.0.1:8000 of rollout" in shared.message
    )
    # under any spelling of the same host and port (names resolved, loopback aliases one host)
    for alias in (
        "http://localhost:8000",
        "http://0.0.0.0:8000",
        f"http://{socket.gethostname()}:8000",
    ):
        cfg.grpo.distill.teacher_url = alias
        assert [e.key for e in distill_errors(cfg)] == [url[0]], alias
    for other in ("http://localhost:8001", "http://10.254.0.1:8000"):
        cfg.grpo.distill.teacher_url = other
        assert distill_errors(cfg) == [], other
    # a served teacher alone, at temperature 1, is a teacher: pure distillation is allowed
    assert _errors(teacher_url="http://127.0.0.1:8000", reward_coef=0.0) == {}


def _sample(i: int) -> Sample:
    return Sample(Prompt(i, (1, 2, 3), ""), i, [4, 5], [-1.0, -1.0], False, 0)


def test_a_teacher_server_that_refuses_the_connection_is_named():
    with socket.socket() as s:  # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(TeacherServerError) as err:
        score_samples(url, [_sample(0), _sample(1)], timeout_s=5.0, max_concurrency=2)
    message = str(err.value)
    assert message.startswith(f"the served teacher (grpo.distill.teacher_url={url}) failed")
    assert "refused the connection" in message and "prompt index" in message


def test_a_teacher_server_that_never_answers_times_out_naming_the_timeout_key():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # takes connections, reads nothing, answers nothing
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    started = time.monotonic()
    try:
        with pytest.raises(TeacherServerError) as err:
            score_samples(url, [_sample(3)], timeout_s=1.0, max_concurrency=4)
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()
    assert time.monotonic() - started < 30  # 1 s, and one GET /health of 5 s at most
    message = str(err.value)
    assert f"grpo.distill.teacher_url={url}" in message and "sample 0 (prompt index 3" in message
    assert (
        "did not answer /inference/v1/generate within 1 s (grpo.distill.teacher_timeout_s)"
        in message
    )
    assert "rollout.servers" not in message


def test_a_teacher_that_is_the_students_own_checkpoint_is_refused(tmp_path):
    """Same directory under another spelling (a symlink): the teacher would score every token at
    the behaviour policy's own log-prob."""
    (tmp_path / "student").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "student")
    cfg = compose(["+recipe=grpo_qwen"], "test")
    cfg.model.hf_path, cfg.grpo.distill.teacher = str(tmp_path / "student"), str(tmp_path / "link")
    (same,) = [e for e in distill_errors(cfg) if e.key == "grpo.distill.teacher"]
    assert "is the student's own checkpoint (model.hf_path=" in same.message
    (tmp_path / "teacher").mkdir()
    cfg.grpo.distill.teacher = str(tmp_path / "teacher")
    assert [e for e in distill_errors(cfg) if e.key == "grpo.distill.teacher"] == []


def test_a_teacher_served_from_another_machine_is_checked_on_a_local_copy(tmp_path):
    """The server's model directory is not on this machine: the checks read
    grpo.distill.teacher_tokenizer (the teacher's config.json and tokenizer files) instead;
    without it the error says so; a wrong copy is refused naming its key."""
    from hf_reference import save_tiny_teacher
    from rlbatch.grpo.served_teacher import _model_errors

    save_tiny_teacher(tmp_path / "copy")
    cfg = compose(["+recipe=grpo_qwen"], "test")
    cfg.grpo.distill.teacher_url = url = "http://teacher-host:8100"
    elsewhere = "/tmp/rlbatch-serve-elsewhere/model"  # rlbatch-serve's root on its own host
    (refused,) = _model_errors(cfg, url, elsewhere)
    assert refused.key == "grpo.distill.teacher_url"
    assert "grpo.distill.teacher_tokenizer=DIR" in refused.message
    cfg.grpo.distill.teacher_tokenizer = str(tmp_path / "copy")
    assert _model_errors(cfg, url, elsewhere) == []
    cfg.grpo.distill.teacher_tokenizer = str(tmp_path / "missing")
    (bad,) = _model_errors(cfg, url, elsewhere)
    assert bad.key == "grpo.distill.teacher_tokenizer" and "config.json" in bad.message
    # a copy whose context is too short for the run is refused as the served directory would be
    config = json.loads((tmp_path / "copy" / "config.json").read_text())
    config["max_position_embeddings"] = 16
    (tmp_path / "copy" / "config.json").write_text(json.dumps(config))
    cfg.grpo.distill.teacher_tokenizer = str(tmp_path / "copy")
    (short,) = _model_errors(cfg, url, elsewhere)
    assert "max_position_embeddings = 16" in short.message
    # the key alone, without a served teacher, is an error rather than ignored
    cfg.grpo.distill.teacher_url = None
    assert [e.key for e in distill_errors(cfg)] == ["grpo.distill.teacher_tokenizer"]


def test_a_served_directory_without_weights_or_with_the_students_is_refused(tmp_path):
    """rlbatch-serve's served directory: no *.safetensors = dummy weights; links to the
    student's own *.safetensors = the student as its own teacher."""
    from rlbatch.grpo.served_teacher import _weights_errors

    cfg = compose(["+recipe=grpo_qwen"], "test")
    url = "http://127.0.0.1:8100"
    served, student, teacher = tmp_path / "served", tmp_path / "student", tmp_path / "teacher"
    for d in (served, student, teacher):
        d.mkdir()
    (served / "config.json").write_text("{}")
    (dummy,) = _weights_errors(cfg, url, str(served))
    assert (
        dummy.key == "grpo.distill.teacher_url" and "runs dummy (random) weights" in dummy.message
    )
    (student / "model.safetensors").write_bytes(b"s")
    (teacher / "model.safetensors").write_bytes(b"s")  # same bytes, another checkpoint's file
    cfg.model.hf_path = str(student)
    (served / "model.safetensors").symlink_to(student / "model.safetensors")
    (own,) = _weights_errors(cfg, url, str(served))
    assert "serves the student's own checkpoint" in own.message
    (served / "model.safetensors").unlink()
    (served / "model.safetensors").symlink_to(teacher / "model.safetensors")
    assert _weights_errors(cfg, url, str(served)) == []
