"""Worker logging: rich on rank 0 at the configured level, warnings only on other ranks.

Rich lays a record out in columns wrapped at the terminal's width; into a file or a pipe (CI,
``| tee``, a scheduler's log) that width is a guess, and a message cut across lines defeats
grep. There a record is one plain line instead (:func:`console_handler`, also the launcher's
handler through conf/hydra/job_logging).

Python warnings go through logging too (once per rank-0 process, never once per rank), and
the ones every CPU run would print are silenced: they describe the expected CPU fallback; so
are torch's and megatron-core's Future/DeprecationWarnings about their own APIs.
"""

from __future__ import annotations

import logging
import warnings

EXPECTED_WARNINGS = (
    # megatron-core on a machine without Transformer Engine / Apex (every CPU run): it falls
    # back to torch implementations, which is what the CPU path uses by design.
    r"Transformer Engine and Apex are not installed",
    r".*(TransformerEngine|Transformer Engine) is not installed",
)


def console_handler() -> logging.Handler:
    """Rich's handler on a terminal; elsewhere one unwrapped line a record: time, level,
    message."""
    import sys

    if sys.stderr.isatty():
        from rich.logging import RichHandler

        rich = RichHandler(show_path=False, rich_tracebacks=False, markup=False)
        rich.setFormatter(logging.Formatter("%(message)s"))
        return rich
    plain = logging.StreamHandler()
    plain.setFormatter(logging.Formatter("%(asctime)s %(levelname)-8s %(message)s", "%H:%M:%S"))
    return plain


def setup_logging(rank: int, level: str = "INFO") -> None:
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    handler: logging.Handler
    if rank == 0:
        handler = console_handler()
        root.setLevel(level.upper())
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
        root.setLevel(logging.WARNING)
    root.addHandler(handler)
    for pattern in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for category in (FutureWarning, DeprecationWarning):
        # torch's and megatron-core's notes to each other about their own APIs (a deprecated
        # checkpoint call Megatron makes on load): nothing a user of rlbatch can act on
        warnings.filterwarnings("ignore", category=category, module=r"(torch|megatron)(\.|$)")
    if rank != 0:
        warnings.simplefilter("ignore")  # rank 0 already reports what every rank would
    logging.captureWarnings(True)
    # megatron-core logs a lot at INFO; keep its warnings.
    logging.getLogger("megatron").setLevel(logging.WARNING)
