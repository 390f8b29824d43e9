"""Async run-ahead producer: exact staleness, waiting instead of dropping, resume."""

from __future__ import annotations

import io
import random
import time

import pytest
import torch

from rlbatch.grpo.types import Prompt, Sample
from rlbatch.rollout.schedule import PromptSampler, derive_schedule
from rlbatch.train.producer import PolicySnapshot, RunAheadProducer, VersionedSlot


def _make(k, max_staleness=4, *, steps=1, iters=1, calls=None, g=2, gbs=4):
    sched = derive_schedule(
        num_generations=g,
        global_batch_size=gbs,
        dp=1,
        steps_per_generation=steps,
        num_iterations=iters,
    )
    sampler = PromptSampler(11, sched, dp_rank=0, seed=5)

    def generate(request, snapshot):
        if calls is not None:
            calls.append((request.round_index, snapshot.version))
        out = []
        for p, gid in zip(request.prompt_indices, request.group_ids, strict=True):
            for j in range(request.num_generations):
                rng = random.Random(gid * 100 + j)
                out.append(
                    Sample(
                        prompt=Prompt(p, (1, 2), "a"),
                        group_id=gid,
                        response_ids=[rng.randrange(50)],
                        behaviour_logps=[-1.0],
                        truncated=False,
                        policy_version=snapshot.version,
                    )
                )
        return out

    return RunAheadProducer(
        sampler, generate, num_steps_async=k, max_staleness=max_staleness, seed=3
    )


def _trace(producer, first, last):
    """What steps first .. last (1-based, inclusive) train on."""
    out = []
    for step in range(first, last + 1):
        b = producer.batch_for_step(step)
        out.append(
            (
                step,
                b.round_index,
                [(s.group_id, s.response_ids[0], s.policy_version) for s in b.samples],
                b.staleness_mean,
            )
        )
    return out


def test_steps_are_numbered_from_one():
    # step 1 = the first optimizer step: round 0, iteration 0, slice 0, the untrained policy
    p = _make(0, steps=2, iters=2, gbs=8)
    first = p.batch_for_step(1)
    assert (first.step, first.round_index, first.iteration, first.slice_index) == (1, 0, 0, 0)
    assert first.new_round and first.round_start_version == 0
    assert {s.policy_version for s in first.samples} == {0}
    with pytest.raises(RuntimeError, match="expected step 2, got 1"):
        p.batch_for_step(1)
    positions = [
        (b.round_index, b.iteration, b.slice_index, b.new_round)
        for b in (p.batch_for_step(step) for step in range(2, 6))
    ]
    assert positions == [(0, 1, 0, False), (0, 0, 1, False), (0, 1, 1, False), (1, 0, 0, True)]
    with pytest.raises(RuntimeError, match="expected step 1, got 0"):
        _make(0).batch_for_step(0)


def test_synchronous_has_zero_staleness():
    p = _make(0)
    for step in range(1, 9):
        b = p.batch_for_step(step)
        assert b.generated == [step - 1]  # round step - 1, by the policy step - 1 starts from
        assert {s.policy_version for s in b.samples} == {step - 1}
        assert b.staleness_mean == 0.0


def test_one_step_ahead_is_exactly_one_stale_after_warmup():
    calls = []
    p = _make(1, max_staleness=1, calls=calls)
    stale = [p.batch_for_step(step).staleness_mean for step in range(1, 9)]
    assert stale == [0.0] + [1.0] * 7
    # round 0 and 1 both come from version 0; round r >= 1 from version r - 1
    assert calls[:3] == [(0, 0), (1, 0), (2, 1)]
    assert [v for _, v in calls] == [0] + list(range(8))
    assert p.queued_versions() == [(8, 7)]


def test_two_steps_ahead_batch_of_step_t_from_version_t_minus_3():
    p = _make(2, max_staleness=2)
    for step in range(1, 8):
        b = p.batch_for_step(step)  # the policy is at version step - 1
        assert {s.policy_version for s in b.samples} == {max(0, step - 3)}
        assert b.staleness_max == min(step - 1, 2)


def test_producer_waits_at_max_staleness_instead_of_dropping():
    calls = []
    with pytest.warns(UserWarning, match="max_staleness=1"):
        p = _make(3, max_staleness=1, calls=calls)
    trace = _trace(p, 1, 6)
    assert [st for *_, st in trace] == [0.0] + [1.0] * 5
    # every generated round is trained, in order: none skipped
    assert [r for _, r, _, _ in trace] == list(range(6))
    assert [r for r, _ in calls] == list(range(7))


def test_reuse_rounds_with_run_ahead():
    # 2 steps per generation x 2 iterations = 4 steps per round; 1 step ahead.
    calls = []
    p = _make(1, max_staleness=1, steps=2, iters=2, calls=calls, gbs=8)
    trace = _trace(p, 1, 12)
    assert calls == [(0, 0), (1, 3), (2, 7), (3, 11)]
    assert [st for *_, st in trace] == [0.0] * 4 + [1.0] * 8
    # order a a b b: each mini-batch trained num_iterations times in a row, the two
    # mini-batches together cover the round's buffer once
    r0 = [x for _, r, x, _ in trace if r == 0]
    assert r0[0] == r0[1] and r0[2] == r0[3] and r0[0] != r0[2]
    assert sorted(r0[0] + r0[2]) == sorted(set(r0[0] + r0[2]))


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("k,steps,iters,cut", [(0, 1, 1, 3), (1, 1, 1, 4), (2, 2, 2, 3)])
def test_resume_equals_uninterrupted_without_replay(k, steps, iters, cut):
    """A checkpoint after step ``cut`` resumes at step cut + 1 exactly."""
    full = _trace(_make(k, steps=steps, iters=iters), 1, 12)
    first = _make(k, steps=steps, iters=iters)
    head = _trace(first, 1, cut)
    state = _roundtrip(first.state_dict())
    assert state["next_step"] == cut + 1
    assert state["queue"] or k == 0  # queued batches travel with the checkpoint
    calls = []
    second = _make(k, steps=steps, iters=iters, calls=calls)
    second.load_state_dict(state)
    tail = _trace(second, cut + 1, 12)
    assert head + tail == full
    generated_before = {r.round_index for r in state["queue"]} | {state["current"].round_index}
    assert not generated_before & {r for r, _ in calls}  # nothing generated twice


def test_resume_from_a_state_with_the_0_based_expected_step():
    """Checkpoints written before steps were 1-based everywhere hold the 0-based index of the
    next step under "expected_step"; they resume at the same step."""
    full = _trace(_make(1, steps=2, iters=2, gbs=8), 1, 10)
    first = _make(1, steps=2, iters=2, gbs=8)
    head = _trace(first, 1, 6)  # mid-round: steps 5 .. 8 train round 1
    state = _roundtrip(first.state_dict())
    state["expected_step"] = state.pop("next_step") - 1
    assert state["expected_step"] == 6
    second = _make(1, steps=2, iters=2, gbs=8)
    second.load_state_dict(state)
    assert second.state_dict()["next_step"] == 7
    assert head + _trace(second, 7, 10) == full


def test_resume_refuses_other_lag_and_out_of_order_steps():
    p = _make(1, max_staleness=1)
    p.batch_for_step(1)
    with pytest.raises(ValueError, match="num_steps_async"):
        _make(0).load_state_dict(p.state_dict())
    with pytest.raises(RuntimeError, match="expected step 2"):
        p.batch_for_step(3)


def test_generate_fn_must_tag_the_snapshot_version():
    sched = derive_schedule(num_generations=1, global_batch_size=1, dp=1)
    sampler = PromptSampler(3, sched, dp_rank=0, seed=0)

    def bad(request, snapshot):
        return [Sample(Prompt(0, (1,), ""), 0, [1], [0.0], False, policy_version=99)]

    with pytest.raises(ValueError, match="policy_version 99"):
        RunAheadProducer(sampler, bad).batch_for_step(1)


def test_versioned_slot_is_monotonic_and_waits():
    slot = VersionedSlot()
    slot.publish(PolicySnapshot(1, "w1"))
    assert slot.wait_for(1).weights == "w1"
    with pytest.raises(TimeoutError):
        slot.wait_for(2, timeout_s=0.01)
    with pytest.raises(ValueError, match="back from 1 to 0"):
        slot.publish(PolicySnapshot(0))


def _policy_trace(threaded, k, steps=1, iters=1, n=10, cut=None):
    """Train n steps of a fake policy whose 'weights' are its version; return what was seen."""
    live = {"w": 0}
    sched = derive_schedule(
        num_generations=2,
        global_batch_size=4,
        dp=1,
        steps_per_generation=steps,
        num_iterations=iters,
    )
    jitter = random.Random(0)

    def generate(request, snapshot):
        w = snapshot.weights if snapshot.weights is not None else live["w"]
        time.sleep(jitter.random() * 0.002)
        return [
            Sample(Prompt(p, (1,), ""), gid, [w, p], [0.0, 0.0], False, snapshot.version)
            for p, gid in zip(request.prompt_indices, request.group_ids, strict=True)
            for _ in range(2)
        ]

    def make():
        return RunAheadProducer(
            PromptSampler(9, sched, dp_rank=0, seed=1),
            generate,
            num_steps_async=k,
            max_staleness=k,
            threaded=threaded,
            snapshot_fn=lambda: live["w"],
            timeout_s=10,
        )

    producer, out = make(), []
    for step in range(1, n + 1):
        if cut is not None and step == cut + 1:
            state = _roundtrip(producer.state_dict())
            producer.close()
            producer = make()
            producer.load_state_dict(state)
        b = producer.batch_for_step(step)
        out.append([(s.group_id, s.response_ids[0], s.policy_version) for s in b.samples])
        live["w"] += 1  # the optimizer step: version step
    producer.close()
    return out


@pytest.mark.parametrize("k,steps,iters", [(0, 1, 1), (1, 1, 1), (3, 1, 1), (2, 2, 2)])
def test_threaded_mode_generates_exactly_what_inline_mode_does(k, steps, iters):
    inline = _policy_trace(False, k, steps, iters)
    assert _policy_trace(True, k, steps, iters) == inline
    # the generating weights are the version the sample carries
    assert all(w == v for step in inline for _, w, v in step)


def test_threaded_mode_resumes_exactly():
    assert _policy_trace(True, 2, cut=5) == _policy_trace(False, 2)


def test_threaded_generation_error_reaches_the_training_thread():
    sched = derive_schedule(num_generations=1, global_batch_size=1, dp=1)

    def broken(request, snapshot):
        raise OSError("generator died")

    p = RunAheadProducer(
        PromptSampler(3, sched, dp_rank=0, seed=0), broken, threaded=True, timeout_s=10
    )
    with pytest.raises(RuntimeError, match="generator died"):
        p.batch_for_step(1)
    p.close()


@pytest.mark.parametrize("threaded", [False, True])
def test_the_events_of_rounds_generated_ahead_are_taken_once(threaded):
    """At the run's last step (3, one step ahead) round 3 is generated for a step the run never
    trains: take_ahead_events waits for it (threaded: a slow generation thread), returns its
    counters and leaves 0 in its place, so a second take (or a resumed run training it) finds
    none; the round's other figures are left as they were."""
    from rlbatch.rollout.streaming import RoundOutput

    sched = derive_schedule(num_generations=1, global_batch_size=1, dp=1)

    def generate(request, snapshot):
        time.sleep(0.2 * threaded)
        samples = [
            Sample(Prompt(p, (1,), "a"), g, [5], [0.0], False, snapshot.version)
            for p, g in zip(request.prompt_indices, request.group_ids, strict=True)
        ]
        figures = {"rollout/server_restarts": float(request.round_index), "rollout/kept": 1.0}
        return RoundOutput(request, samples, figures)

    p = RunAheadProducer(
        PromptSampler(5, sched, dp_rank=0, seed=0), generate, num_steps_async=1,
        max_staleness=1, threaded=threaded, snapshot_fn=lambda: None, timeout_s=10,
    )  # fmt: skip
    for step in (1, 2, 3):
        p.batch_for_step(step)
    keys = ("rollout/server_restarts", "rollout/absent")
    assert p.take_ahead_events(keys) == {"rollout/server_restarts": 3.0}
    assert p.take_ahead_events(keys) == {"rollout/server_restarts": 0.0}
    assert [r.filter_metrics for r in p.queue] == [
        {"rollout/server_restarts": 0.0, "rollout/kept": 1.0}
    ]
    p.close()
