"""A worker entry that checks the runtime itself: process group, collectives, fault handling.

Used by the launcher's tests (driver -> torchrun -> worker with a real gloo process group)
independently of the training loop. Honors debug.fail_at_step / fail_rank / fail_kind at
"step" 1 so crash propagation can be tested.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

from rlbatch.config.schema import FailKind, RunConfig


def run(cfg: RunConfig) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.trainer.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.debug.fail_at_step == 1 and rank == cfg.debug.fail_rank:
        if cfg.debug.fail_kind == FailKind.raise_error:
            raise RuntimeError(f"injected failure on rank {rank}")
        if cfg.debug.fail_kind == FailKind.kill:
            os._exit(17)
        if cfg.debug.fail_kind == FailKind.hang:
            time.sleep(3600)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    if rank == 0:
        report = {"world_size": world, "rank_sum": total.item(), "pid": os.getpid()}
        (Path(cfg.run_dir or ".") / "selftest.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
