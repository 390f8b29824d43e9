"""The probe's comparison: a server's log-probabilities of the fixed tokens against the
trainer's current and previous ones (values chosen by hand)."""

from __future__ import annotations

import pytest

from rlbatch.rollout.servers.probe import judge_probe, probe_sequence

PREVIOUS = [-1.0, -2.0, -3.0]
CURRENT = [-1.0004, -2.0, -2.9996]  # one step moved them by 4e-4 (below a 1e-3 tolerance)
NOISE = 5e-6


def test_the_fixed_sequence_is_the_prompt_and_fixed_tokens_inside_the_vocabulary():
    sequence, prompt_len = probe_sequence(3, 50)
    assert sequence == [3, 14, 15, 42, 15, 35, 39, 29, 11, 18, 25]
    assert prompt_len == 8


def test_a_current_server_passes():
    v = judge_probe([-1.0004, -2.0000005, -2.9996], CURRENT, PREVIOUS, NOISE)
    assert not v.behind and not v.undecided
    assert v.off == pytest.approx(5e-7) and v.moved == pytest.approx(4e-4)


def test_a_server_one_sync_behind_is_behind_although_within_the_tolerance():
    v = judge_probe(list(PREVIOUS), CURRENT, PREVIOUS, NOISE)
    assert v.behind and v.off == pytest.approx(4e-4) and v.off < 1e-3


def test_a_server_halfway_between_the_versions_is_behind():
    v = judge_probe([-1.0002, -2.0, -2.9998], CURRENT, PREVIOUS, NOISE)
    assert v.behind  # 2e-4 from either: not nearer the current one by half the move


def test_a_move_within_the_noise_cannot_tell_the_versions_apart():
    current = [-1.00001, -2.0, -3.0]  # moved 1e-5, within 4 x the noise (2e-5)
    v = judge_probe(list(PREVIOUS), current, PREVIOUS, NOISE)
    assert v.undecided and not v.behind


def test_the_first_sync_has_no_previous_version():
    v = judge_probe(list(CURRENT), CURRENT, None, NOISE)
    assert v.moved is None and not v.behind and v.off == 0.0
