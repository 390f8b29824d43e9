"""torchrun worker of tests/dist/test_checkpoint_reshard.py.

Usage: reshard_worker.py MODE HF_DIR CKPT_DIR OUT_DIR
  MODE save:   tp2 pp2 (4 ranks): optimizer step 1, checkpoint (rlbatch.train.checkpoint), step 2.
  MODE dp2:    tp1 pp1 dp2 (2 ranks): resume from the checkpoint, step 2.
  MODE dp1:    one rank: resume, step 2.
Every layout runs the distributed optimizer and the same 4 micro-batches per step (split over
DP). Writes OUT_DIR/rank{r}.pt: step-2 losses, grad norm and the full weights after step 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_case import MICRO_BATCHES, ROUND, make_cfg, plan_of, sequences

from rlbatch import distributed
from rlbatch.engine import hf, parallel, schedule
from rlbatch.engine import model as engine_model
from rlbatch.train import checkpoint

LAYOUTS = {
    "save": (2, 2, 1),
    "dp2": (1, 1, 2),
    "dp1": (1, 1, 1),
    "tp2": (2, 1, 1),
    "pp2": (1, 2, 1),
}  # tp, pp, dp
STEP_BATCHES = MICRO_BATCHES[:4]


def train_step(cfg, chunks, optimizer, scheduler, dp_rank: int) -> dict:
    dp = cfg.parallel.dp
    mine = STEP_BATCHES[dp_rank * (4 // dp) : (dp_rank + 1) * (4 // dp)]
    plan = plan_of([mine] * dp, cfg.parallel.pp)
    seqs = sequences()

    def batch_fn(mb):
        return schedule.make_inputs([seqs[i] for i in mb.samples], mb, round_to=ROUND)

    out = schedule.run_pass(chunks, plan.ranks[0], plan, batch_fn, schedule.next_token_loss)
    _, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    state = parallel.current_layout()
    mine_losses = [float(m["loss_sum"]) for m in out] if state.tp_rank == 0 else []
    gathered = distributed.all_gather_object((state.dp_rank, mine_losses))  # last stages hold them
    losses = [x for _, rank_losses in sorted(gathered) for x in rank_losses]
    return {"losses": losses, "grad_norm": grad_norm}


def main() -> None:
    mode, hf_dir, ckpt_dir, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    tp, pp, dp = LAYOUTS[mode]
    cfg = make_cfg(tp, pp, 1, dp, hf_dir, distributed_optimizer=True)
    state = parallel.initialize(cfg)
    chunks = engine_model.build_model(cfg)
    hf.load_hf_into(chunks, cfg.model.hf_path)
    optimizer, scheduler = engine_model.build_optimizer(cfg, chunks)
    barrier = dist.barrier
    if mode == "save" or mode == os.environ.get("RESHARD_SAVE_AS"):
        train_step(cfg, chunks, optimizer, scheduler, state.dp_rank)
        payload = checkpoint.build_payload(
            chunks, optimizer, scheduler, checkpoint.TrainState(step=1)
        )
        layout = {k: getattr(state, k) for k in ("tp", "pp", "vpp", "cp", "dp")}
        checkpoint.save_checkpoint(
            ckpt_dir, 1, payload, rank=state.rank, world_size=state.world_size,
            meta={"parallel": layout}, barrier=barrier,
        )  # fmt: skip
    else:
        path = checkpoint.latest_checkpoint(ckpt_dir)
        assert path is not None
        payload = checkpoint.load_checkpoint(path, rank=state.rank, world_size=state.world_size)
        train_state = checkpoint.apply_payload(payload, chunks, optimizer, scheduler)
        assert payload["resharded"] and train_state.step == 1
    result = train_step(cfg, chunks, optimizer, scheduler, state.dp_rank)
    result["params"] = hf.gather_full(chunks, cfg.model)
    torch.save(result, out_dir / f"rank{state.rank}.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()
