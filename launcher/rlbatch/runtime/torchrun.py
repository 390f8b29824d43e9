"""torchrun, minus its own traceback on a worker failure (the driver shows the rank's error) and
minus its log lines about a run that ended as asked (a preemption save, Ctrl-C), which read like
a crash,
bound to the launcher's life (when the launcher dies, torchrun gets SIGKILL and its workers
follow it: rlbatch.runtime.lifeline), and passing preemption signals on to the workers instead
of killing them (rlbatch.runtime.preempt)."""

from __future__ import annotations

import logging
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


QUIET_EXITS = frozenset({preempt.EXIT_PREEMPTED, 130, -int(signal.SIGINT)})
"""Worker exit codes of a run that stopped as asked: saved after a preemption signal, or
interrupted (Ctrl-C: 128 + SIGINT from the worker, or killed by SIGINT)."""
ELASTIC_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
)


class QuietEnding(logging.Filter):
    """Drops torchrun's records about workers that stopped as asked: "failed (exitcode: 75)",
    "Received SIGINT death signal", and the routine "Sending process N closing signal" (the
    driver reports how the run ended, and the failing rank's own error)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
        if msg.startswith("failed (exitcode") and args:
            return args[0] not in QUIET_EXITS
        if "closing signal" in msg:
            return False
        if "death signal" in msg or "termination signal" in msg:
            return not any(a == signal.SIGINT or str(a).endswith("SIGINT") for a in args)
        return True


def quiet_elastic_logs() -> None:
    for name in ELASTIC_LOGGERS:
        logging.getLogger(name).addFilter(QuietEnding())


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

    quiet_elastic_logs()

    code = 0
    try:
        torchrun_main([f"--signals-to-handle={TORCHRUN_SIGNALS}", *sys.argv[1:]])
    except ChildFailedError as err:
        failures = err.failures
        codes = [f.exitcode for f in failures.values()] or [1]
        preempted = preempt.EXIT_PREEMPTED if preempt.EXIT_PREEMPTED in codes else None
        code = preempted or next((c for c in codes if c and c > 0), 1)
    except KeyboardInterrupt:
        code = 130
    except SignalException as err:  # SIGINT / SIGQUIT: workers are stopped
        code = 128 + int(err.sigval)
    finally:  # the workers have ended: a late preemption signal must not end torchrun by it
        preempt.ignore()
    _exit(code)


def _exit(code: int) -> None:
    """End torchrun now that its workers have ended and been reaped: its output flushed, without
    tearing down the interpreter, which holds torch and takes about 0.3 s of CPU to unload
    (torchrun runs once per rlbatch command; nothing of it outlives the workers)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
