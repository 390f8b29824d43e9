"""Worker logging: rich on rank 0 at the configured level, warnings only on other ranks."""

from __future__ import annotations

import logging


def setup_logging(rank: int, level: str = "INFO") -> None:
    from rich.logging import RichHandler

    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    handler: logging.Handler
    if rank == 0:
        handler = RichHandler(show_path=False, rich_tracebacks=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.setLevel(level.upper())
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
        root.setLevel(logging.WARNING)
    root.addHandler(handler)
    # megatron-core logs a lot at INFO; keep its warnings.
    logging.getLogger("megatron").setLevel(logging.WARNING)
