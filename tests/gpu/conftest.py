"""tests/gpu: what runs only on a CUDA machine (tests/gpu/check.sh runs them there in one command).

Figures (parity errors, tokens/s, peak memory) go through the ``gpu_figures`` fixture: printed,
and appended as JSON lines to the file named by ``RLBATCH_GPU_FIGURES`` when it is set, so the
check script can show them side by side at the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
from gpu_support import DRYRUN


@pytest.fixture(scope="session")
def gpu_figures() -> Callable[..., None]:
    path = os.environ.get("RLBATCH_GPU_FIGURES")

    def record(check: str, **figures: float | int | str | None) -> None:
        line = {"check": check, "dryrun": DRYRUN, **figures}
        print(json.dumps(line))
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    return record
