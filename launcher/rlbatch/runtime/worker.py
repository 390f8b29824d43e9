"""The torchrun worker: resolved.yaml -> RunConfig (no Hydra) -> entry(cfg).

    python -m rlbatch.runtime.worker --config RUN_DIR/resolved.yaml --entry module:function

The worker dies with its torchrun (SIGKILL: an orphan has nothing left to finish; checkpoints
commit atomically), bound from the first lines of this module, and so does every child it forks
or spawns (rlbatch.runtime.lifeline). A failure is written to <run_dir>/errors/rank<N>.txt for the driver to
show, then the process exits non-zero so torchrun stops the other ranks. An entry that returns
leaves <run_dir>/done/rank<N> (an exit with code 0 without it is a failure: user code called
sys.exit). Preemption signals are recorded, not fatal (rlbatch.runtime.preempt): the loop
saves and raises Preempted, and the worker exits with EXIT_PREEMPTED. Once the entry has ended
(returned, preempted or failed), the worker ignores preemption signals while it shuts down
(preempt.ignore).
"""

from __future__ import annotations

import signal

from rlbatch.runtime.lifeline import die_with_parent

if __name__ in ("__main__", "__mp_main__"):
    # Bound before the imports below, which take seconds: a worker whose torchrun dies while it
    # imports must not finish them first. multiprocessing's spawn imports this module as
    # __mp_main__ in each child a rank starts (its generation worker) before it unpickles the
    # child's own code: that child is bound here too, by the parent-pid watch (the kernel's
    # signal is armed once it knows it was started from its rank's main thread).
    die_with_parent(signal.SIGKILL, kernel=__name__ == "__main__")

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from rlbatch.config.errors import ConfigErrors
from rlbatch.config.load import load_run_config
from rlbatch.config.schema import RunConfig
from rlbatch.env.protocol import EnvCallError
from rlbatch.runtime import preempt
from rlbatch.runtime.logs import setup_logging


def resolve_entry(entry: str) -> Callable[[RunConfig], None]:
    module_name, _, func_name = entry.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, func_name)


def _is_user_error(exc: BaseException) -> bool:
    """A configuration error found by a worker (e.g. what only the device can tell), or an
    error of the user's environment (rlbatch.env: its message names the class, the sample and
    the turn): shown without a traceback."""
    return isinstance(exc, (ConfigErrors, EnvCallError))


def _report(run_dir: Path, rank: int, exc: BaseException, debug: bool = False) -> None:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    # user errors read like the driver's (what and where, the fix), without a traceback unless
    # logging.level=DEBUG
    quiet = _is_user_error(exc) and not debug
    detail = "" if quiet else "".join(traceback.format_exception(exc))
    write_report(run_dir, rank, f"rank {rank}: {text}\n\n{detail}")


def write_report(run_dir: Path, rank: int, text: str) -> None:
    """<run_dir>/errors/rank<N>.txt, written atomically (the driver shows it)."""
    errors = run_dir / "errors"
    errors.mkdir(parents=True, exist_ok=True)
    tmp = errors / f".rank{rank}.tmp"
    tmp.write_text(text)
    tmp.replace(errors / f"rank{rank}.txt")


def _mark_done(run_dir: Path, rank: int) -> None:
    done = run_dir / "done"
    done.mkdir(parents=True, exist_ok=True)
    (done / f"rank{rank}").write_text("")


def main(argv: list[str] | None = None) -> None:
    die_with_parent(signal.SIGKILL)  # a no-op when bound at import
    parser = argparse.ArgumentParser(prog="rlbatch.runtime.worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--entry", required=True)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    cfg = load_run_config(args.config)
    run_dir = Path(cfg.run_dir or Path(args.config).parent)
    setup_logging(rank, cfg.logging.level)
    preempt.install()
    try:
        resolve_entry(args.entry)(cfg)
        _mark_done(run_dir, rank)
    except KeyboardInterrupt:
        sys.exit(130)
    except preempt.Preempted:
        sys.exit(preempt.EXIT_PREEMPTED)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then re-signalled
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        _report(run_dir, rank, exc, debug=cfg.logging.level.upper() == "DEBUG")
        print(f"[rank {rank}] {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:  # ending, however: a late preemption signal must not end it by that signal
        preempt.ignore()


if __name__ == "__main__":
    main()
