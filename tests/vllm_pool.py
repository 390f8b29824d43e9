"""The rlbatch-serve servers the server end-to-end files share (tests/conftest.py's
``vllm_server_pool``, one per test session): starting a vLLM server costs minutes of CPU on
this machine, and two files each starting their own at once made CI start five in parallel,
past rlbatch-serve's start-up deadline. The files run on one xdist worker, one after the other
(tests/conftest.py's SERVER_FILES)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

MODEL = (
    "+recipe=grpo_qwen", "model.num_attention_heads=2", "model.num_query_groups=2",
    "rollout.vllm.kv_cache_space_gb=0.25",
)  # fmt: skip
"""The tiny model with heads of width 32 (the smallest vLLM's CPU attention supports); the
servers and the trainers are composed from the same recipe and overrides."""

SERVED_LEN = 160
"""The servers' longest sequence: a multi-turn episode of the guess-the-number recipe (same
tiny model) fits, so its test shares the servers."""

BLOCK = 32
"""The servers' KV block: vLLM's prefix cache reuses whole blocks only, so the short rows of
the tests reach a cached block (rollout.servers.on_update=keep) only with the smallest the
CPU build takes (a multiple of 32)."""

POOL_SIZE = 3
"""Two servers the run tests share (the last server test kills the second) and a spare that
the tests of a server relabelled, restarted or killed mid-run use up."""

TEACHER: dict[str, object] = {}
"""The served distillation teacher's rlbatch-serve (test_served_teacher_cli.py), started with
the pool so that its vLLM start overlaps theirs: ``proc``, ``port``, ``root`` (its folder,
the checkpoint in ``root``/teacher)."""

PROCS: list[subprocess.Popen] = []
"""Every rlbatch-serve of the session (a test that restarts a server adds the new one); the
pool stops each one (SIGTERM) at the end of the session."""


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports, bound together before any is released (servers that bind
    theirs only once vLLM has loaded cannot be handed each other's)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def serve(
    bin_dir: Path, env: dict[str, str], cwd: Path, port: int, *extra: str
) -> subprocess.Popen:
    """rlbatch-serve on ``port`` with the pool's model and lengths (and ``extra`` overrides,
    e.g. a teacher's model.hf_path); it prints its URL once
    /health answers. Its log (vLLM's output) goes to ``cwd``/serve-PORT.log, which
    :func:`started_url` shows when the server does not come up."""
    log = open(cwd / f"serve-{port}.log", "w")
    with log:
        return subprocess.Popen(
            [str(bin_dir / "rlbatch-serve"), *MODEL, f"rollout.servers.port={port}",
             f"rollout.vllm.max_model_len={SERVED_LEN}", f"rollout.vllm.block_size={BLOCK}", *extra],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=cwd,
            start_new_session=True,  # a process group of its own, as a shell job has
        )  # fmt: skip


def started_url(proc: subprocess.Popen, cwd: Path, port: int) -> str:
    """The URL ``proc`` prints once healthy; an assertion with the tail of its log if it
    ended first."""
    line = proc.stdout.readline().strip()
    if not line.startswith("http://127.0.0.1:"):
        log = (cwd / f"serve-{port}.log").read_text(errors="replace")
        raise AssertionError(
            f"rlbatch-serve on port {port} printed {line!r}; its log ends:\n{log[-4000:]}"
        )
    return line


def stop_all() -> None:
    """SIGTERM to every rlbatch-serve of the pool, then wait for each (idempotent): once the
    last server file is done, so idle servers do not hold memory and CPU through the rest of
    the session."""
    import signal

    for proc in PROCS:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in PROCS:
        proc.wait(60)


def save_teacher(root: Path) -> Path:
    """A peaked teacher of the pool's model shape in ``root``/teacher: the folder rlbatch-serve
    writes for the pool's model (its config.json, and the byte tokenizer's marker the pool's
    model reads bytes by), with random weights (seed 7), the embeddings scaled by 10 (tied:
    the output layer too)."""
    import torch
    import transformers

    from rlbatch.cli.serve import server_config
    from rlbatch.rollout.servers.process import write_server_model_dir

    teacher = root / "teacher"
    write_server_model_dir(
        server_config([*MODEL, f"rollout.vllm.max_model_len={SERVED_LEN}"]), teacher
    )
    torch.manual_seed(7)
    config = transformers.AutoConfig.from_pretrained(teacher)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10.0)
    model.save_pretrained(teacher)
    return teacher


def start_teacher(bin_dir: Path, env: dict[str, str], root: Path, port: int) -> None:
    """The teacher's checkpoint (:func:`save_teacher`) and its rlbatch-serve on ``port``, not
    waited for (:data:`TEACHER`; stopped by the teacher's tests, or with the pool). A failure
    is kept in TEACHER["error"] for the teacher's tests to raise: the pool's other tests go on."""
    TEACHER.update(root=root, port=port)
    try:
        teacher = save_teacher(root)
        proc = serve(bin_dir, env, root, port, f"model.hf_path={teacher}")
    except Exception as err:  # noqa: BLE001 - raised again by the teacher's fixture
        TEACHER["error"] = err
        return
    PROCS.append(proc)
    TEACHER["proc"] = proc
