"""What a user sees around a vLLM run, without starting vLLM: the engine's model directory is
in the run directory and the directories of killed processes are removed at the next start;
the vLLM log records every run of this setup produces are dropped, any other is shown."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

from rlbatch.rollout.engines.vllm_engine import drop_expected_records, model_dir_path


def test_the_model_dir_is_in_the_run_dir_and_killed_processes_dirs_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    host = socket.gethostname()
    parent = tmp_path / "vllm"
    stale = parent / f"{host}-{int(dead.stdout)}"  # a process killed with SIGKILL left it
    live = parent / f"{host}-{os.getppid()}"  # another engine of this host, still running
    elsewhere = parent / f"other-host-{int(dead.stdout)}"  # not this host's to judge
    for d in (stale, live, elsewhere):
        (d / "config.json").parent.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    path = model_dir_path(tmp_path)
    assert path == parent / f"{host}-{os.getpid()}" and path.is_dir()
    assert not stale.exists() and live.exists() and elsewhere.exists()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def test_only_the_expected_vllm_records_are_dropped():
    drop_expected_records()
    drop_expected_records()  # idempotent: one filter per logger
    reload = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    renderer = logging.getLogger("vllm.renderers.base")
    args = logging.getLogger("vllm.engine.arg_utils")
    assert len(reload.filters) == 1 and len(renderer.filters) == 1 and len(args.filters) == 1
    seen = _Records()
    kept = [(logger, logger.level, logger.disabled) for logger in (reload, renderer, args)]
    for logger in (reload, renderer, args):
        logger.addHandler(seen)
        logger.setLevel(logging.DEBUG)  # whatever levels earlier tests of this process left
        logger.disabled = False
    try:
        reload.warning("%s: Failed to load weights", "RotaryEmbedding")
        reload.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real failure
        renderer.warning("Chat template warmup failed", exc_info=True)
        renderer.warning("Using None for EOS token id because tokenizer is not initialized")
        renderer.error("Chat template rendering failed for a request")
        args.warning(
            "The global random seed is set to %d. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to "
            "False, this may affect the random state of the Python process that launched vLLM.",
            0,
        )  # the trainer's generators are restored around the start
        args.warning("another warning of the engine's arguments")
    finally:
        for logger, level, disabled in kept:
            logger.removeHandler(seen)
            logger.setLevel(level)
            logger.disabled = disabled
    assert seen.records == [
        "QKVParallelLinear: Failed to load weights",
        "Chat template rendering failed for a request",
        "another warning of the engine's arguments",
    ]


def test_a_process_removes_its_model_dir_at_exit(tmp_path):
    code = (
        "import sys; from pathlib import Path; from rlbatch.config.schema import ModelConfig;"
        " from rlbatch.rollout.engines.vllm_engine import SpecialIds, write_model_dir;"
        " p = write_model_dir(ModelConfig(), 'float32', SpecialIds((258,), 257), Path(sys.argv[1]));"
        " assert (p / 'generation_config.json').is_file(); print(p)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip().startswith(str(tmp_path / "vllm"))
    assert not (tmp_path / "vllm").exists()
