"""torchrun, minus its own traceback on a worker failure (the driver shows the rank's error),
bound to the launcher's life (when the launcher dies, torchrun gets SIGKILL and its workers
follow it: rlbatch.runtime.lifeline), and passing preemption signals on to the workers instead
of killing them (rlbatch.runtime.preempt)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from rlbatch.runtime import preempt
from rlbatch.runtime.lifeline import die_with_parent

TORCHRUN_SIGNALS = "SIGINT,SIGQUIT"
"""The signals torchrun itself handles (by stopping its workers); it must not kill them on
SIGTERM / SIGUSR1 / SIGHUP, which ask them to save first."""


def _children() -> list[int]:
    """Pids of this process's children (Linux: /proc/self/task/*/children)."""
    pids: list[int] = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return pids


def _forward(signum: int, frame: Any) -> None:
    for pid in _children():
        try:
            os.kill(pid, preempt.FORWARD)
        except ProcessLookupError:
            pass


def main() -> None:
    die_with_parent(signal.SIGKILL)  # SIGTERM now means 'save and stop'
    for sig in preempt.SIGNALS:
        signal.signal(sig, _forward)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main([f"--signals-to-handle={TORCHRUN_SIGNALS}", *sys.argv[1:]])
    except ChildFailedError as err:
        failures = err.failures
        codes = [f.exitcode for f in failures.values()] or [1]
        code = preempt.EXIT_PREEMPTED if preempt.EXIT_PREEMPTED in codes else None
        sys.exit(code or next((c for c in codes if c and c > 0), 1))
    except KeyboardInterrupt:
        sys.exit(130)
    except SignalException as err:  # SIGINT / SIGQUIT: workers are stopped
        sys.exit(128 + int(err.sigval))


if __name__ == "__main__":
    main()
