"""Two gloo ranks whose collectives give up after 3 s (a group of their own, as trainer.timeout_s
bounds the run's): rank 1 spends 6 s in a round of user code (harness episodes with longer
deadlines) while rank 0 is done; they meet through rlbatch.distributed.meet (bounded by the
round's 30 s) and the collective after it succeeds; once both have met again, the first meet's
keys are gone from the store. Then rank 0 meets alone, bounded by 2 s: a TimeoutError naming
rank 1. Prints one JSON line from rank 0."""

from __future__ import annotations

import datetime
import json
import time

import torch
import torch.distributed as dist

from rlbatch.distributed import meet


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    short = dist.new_group(timeout=datetime.timedelta(seconds=3))
    dist.all_reduce(torch.ones(1))  # start together (a loaded machine starts them apart)
    started = time.monotonic()
    if dist.get_rank() == 1:
        time.sleep(6)  # its round of harness episodes
    meet("round-1", 30)
    total = torch.ones(1)
    dist.all_reduce(total, group=short)  # the first collective after the round
    waited = time.monotonic() - started
    meet("round-2", 30)  # both: the keys of round-1 are deleted (every rank is past it)
    dist.all_reduce(torch.ones(1))
    store = dist.distributed_c10d._get_default_store()
    kept = [store.check([f"rlbatch/meet/round-1/{r}"]) for r in range(2)]
    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 1:
        time.sleep(4)  # away while rank 0 meets alone
        return
    try:
        meet("round-3", 2)
        alone = "met"
    except TimeoutError as err:
        alone = str(err)
    out = {"sum": float(total[0]), "waited_s": waited, "alone": alone, "kept": kept}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
