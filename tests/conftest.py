"""Shared test helpers. Multi-process and CLI tests run real subprocesses (no mocks)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """Environment for CLI / torchrun subprocesses: one thread each on this small machine."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    """Directory of the installed console scripts (rlbatch-train, ...)."""
    return Path(sys.executable).parent
