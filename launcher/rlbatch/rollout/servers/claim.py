"""Whose weight update a rollout server holds open, and whether a run may take it over.

vLLM accepts one weight update at a time (``start_weight_update`` refuses a second one until
``finish_weight_update``) and keeps no record of who started it. A trainer killed in the middle
of a sync (preempted, SIGKILLed, out of memory) leaves its servers paused, with the update
open, or with a failed push's weights half applied; every later run would then fail at its
first push with vLLM's raw error, or at its probe with a message that blames the model.

So every push first labels the server with its owner (vLLM's weight-version label, which a
finished update replaces with the sync's own): ``rlbatch-update:<nonce>:<host>:<pid>:<time>``.
A run that finds such a label on a server knows whose update is open or failed there:

- its own (the same run nonce) or one of no live run (a process of this machine that is gone,
  or, for another machine's trainer, one older than the longest a live push may take) is taken
  over: the open update is ended, the whole weights are pushed, and the probe checks them;
- another live run's is refused, naming it: two runs must not update one server.

This module is the pure part (the label and the verdict); rlbatch.rollout.servers.sync asks the
server and acts on it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Optional

from rlbatch.runtime.lock import pid_alive

PREFIX = "rlbatch-update"
"""The first field of an update owner's label."""
ACTIVE_MARK = "already active"
"""What vLLM's refusal of a second concurrent update says."""


@dataclass(frozen=True)
class UpdateOwner:
    """The run that started a server's open (or failed) weight update."""

    nonce: str
    host: str
    pid: int
    since: int
    """Unix time (s) the update started."""

    def label(self) -> str:
        return f"{PREFIX}:{self.nonce}:{self.host}:{self.pid}:{self.since}"

    def describe(self) -> str:
        return (
            f"run {self.nonce}, trainer process {self.pid} on {self.host},"
            f" started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}"
        )


def this_process(nonce: str) -> UpdateOwner:
    return UpdateOwner(nonce, socket.gethostname(), os.getpid(), int(time.time()))


def parse_owner(label: Optional[str]) -> Optional[UpdateOwner]:
    """The owner a server's weight label names, or None when it is a finished sync's label
    (or anything else)."""
    fields = str(label).split(":")
    if len(fields) != 5 or fields[0] != PREFIX:
        return None
    try:
        return UpdateOwner(fields[1], fields[2], int(fields[3]), int(fields[4]))
    except ValueError:
        return None


class Verdict(str, Enum):
    free = "free"
    """No update of an rlbatch run is open or failed there."""
    recover = "recover"
    """This run's own, or a run that is gone: take it over."""
    refuse = "refuse"
    """Another live run's update."""


def judge(
    owner: Optional[UpdateOwner],
    *,
    nonce: str,
    host: str,
    now: float,
    alive: Callable[[int], bool],
    stale_after_s: float,
) -> Verdict:
    """What a run of ``nonce`` on ``host`` may do with a server whose update ``owner`` holds:
    a process of this host is alive or not (``alive``); a trainer on another host counts as
    gone once its update is older than ``stale_after_s``."""
    if owner is None:
        return Verdict.free
    if owner.nonce == nonce:
        return Verdict.recover
    if owner.host == host:
        return Verdict.refuse if alive(owner.pid) else Verdict.recover
    return Verdict.recover if now - owner.since > stale_after_s else Verdict.refuse


STALE_AFTER_TIMEOUTS = 8
"""An update another machine's trainer started counts as abandoned after this many
rollout.servers.timeout_s (one server's push is five requests, each bounded by it)."""


def verdict_of(owner: Optional[UpdateOwner], nonce: str, timeout_s: float) -> Verdict:
    """:func:`judge` for this process (of run ``nonce``) now."""
    return judge(
        owner, nonce=nonce, host=socket.gethostname(), now=time.time(), alive=pid_alive,
        stale_after_s=STALE_AFTER_TIMEOUTS * timeout_s,
    )  # fmt: skip


def describe_live_owner(label: Optional[str], timeout_s: float) -> Optional[str]:
    """Before launch (no run nonce yet): the live run whose update a server's label names, or
    None."""
    owner = parse_owner(label)
    if owner is None or verdict_of(owner, "", timeout_s) != Verdict.refuse:
        return None
    return owner.describe()
