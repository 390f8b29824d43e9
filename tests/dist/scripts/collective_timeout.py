"""Two gloo ranks, a group with a 2 s timeout: rank 1 stays away while rank 0 waits in collectives (torch's
and rlbatch's), then rank 0 raises user errors that mention a timeout. Prints one JSON line:
which of them as_collective_timeout takes for a timed-out collective."""

from __future__ import annotations

import datetime
import json
import time

import torch
import torch.distributed as dist

from rlbatch.distributed import all_gather_object, as_collective_timeout
from rlbatch.env.protocol import EnvCallError


def _user_call() -> None:
    raise RuntimeError("the grading service timed out")  # a user's own code, by its words


def _classified(fn) -> bool:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - EnvCallError is not a RuntimeError
        return as_collective_timeout(err) is not None
    raise AssertionError("no error")


def _env_timeout() -> None:
    raise EnvCallError("environment Slow.step on sample 0 took longer than env.timeout_s=1")


def main() -> None:
    # the ranks meet without a hurry (a loaded machine starts them seconds apart), then rank 0's
    # collectives time out after 2 s on a group of their own
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    short = dist.new_group(timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(10)
        return
    out = {
        "all_reduce": _classified(lambda: dist.all_reduce(torch.ones(1), group=short)),
        "all_gather_object": _classified(lambda: all_gather_object(1, group=short)),
        "user_runtime_error": _classified(_user_call),
        "environment_timeout": _classified(_env_timeout),
    }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
