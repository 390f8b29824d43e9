"""Whose weight update a rollout server holds, read from its label, and what a run may do with
it: take over its own or a gone run's, refuse another live run's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlbatch.rollout.servers.claim import (
    UpdateOwner,
    Verdict,
    judge,
    parse_owner,
    pid_alive,
)

OWNER = UpdateOwner("abc123", "node7", 4242, 1_700_000_000)


def _judge(owner, *, nonce="mine", host="node7", now=1_700_000_100.0, alive=True):
    return judge(
        owner, nonce=nonce, host=host, now=now, alive=lambda pid: alive, stale_after_s=600.0
    )


def test_the_label_names_its_owner_and_reads_back():
    assert OWNER.label() == "rlbatch-update:abc123:node7:4242:1700000000"
    assert parse_owner(OWNER.label()) == OWNER


@pytest.mark.parametrize("label", ["abc123-3", None, "rlbatch-update:a:b:notapid:1", "x:a:b:1:2"])
def test_a_finished_syncs_label_or_anything_else_names_no_owner(label):
    assert parse_owner(label) is None


def test_a_server_without_an_owner_is_free():
    assert _judge(None) == Verdict.free


def test_this_runs_own_update_is_taken_over_even_while_it_lives():
    assert _judge(OWNER, nonce="abc123", alive=True) == Verdict.recover


def test_a_live_process_of_this_machine_is_refused_a_dead_one_taken_over():
    assert _judge(OWNER, alive=True) == Verdict.refuse
    assert _judge(OWNER, alive=False) == Verdict.recover


def test_another_machines_update_is_refused_until_it_is_older_than_the_bound():
    assert _judge(OWNER, host="node8", now=OWNER.since + 600.0) == Verdict.refuse
    assert _judge(OWNER, host="node8", now=OWNER.since + 601.0) == Verdict.recover


def test_pid_alive_tells_a_running_process_from_an_ended_one():
    assert pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not pid_alive(proc.pid)
