"""Dynamic sampling (grpo.filter_groups=zero_variance): exact batches, a global decision over
DP ranks (two ranks in threads with a real barrier-based all-gather), the sampler cursor, resume.

The reference is the global prompt stream itself: DP ranks take contiguous blocks of each draw,
so the kept groups in (draw, rank, group) order are the stream's groups with a reward spread,
in stream order; a round trains the first prompts_per_round of them."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from rlbatch.grpo.types import Prompt, Sample
from rlbatch.rollout.schedule import PromptSampler, derive_schedule
from rlbatch.train.filtering import GroupFilter, keep_flags, kept_in_order
from rlbatch.train.producer import RunAheadProducer

G, GBS, NUM_PROMPTS = 2, 8, 23


def flat(gid: int) -> bool:
    """The fake reward: every third stream position gives a group of equal rewards."""
    return gid % 3 != 1


def _generate(request, snapshot):
    out = []
    for p, gid in zip(request.prompt_indices, request.group_ids, strict=True):
        for j in range(request.num_generations):
            out.append(
                Sample(Prompt(p, (1, 2), "a"), gid, [7], [-1.0], False, snapshot.version,
                       reward=0.5 if flat(gid) else float(j))
            )  # fmt: skip
    return out


class ThreadGather:
    """An all-gather over threads (one per DP rank): every rank gets every rank's object."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list = [None] * n

    def for_rank(self, rank: int):
        def gather(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return gather


def _producer(dp, rank, gather, *, k=0, steps=1, max_rounds=8):
    sched = derive_schedule(num_generations=G, global_batch_size=GBS, dp=dp,
                            steps_per_generation=steps)  # fmt: skip
    sampler = PromptSampler(NUM_PROMPTS, sched, dp_rank=rank, seed=5)
    filt = GroupFilter(G, sched.prompts_per_round, max_rounds, rank, gather)
    return RunAheadProducer(sampler, _generate, num_steps_async=k, max_staleness=k, seed=3,
                            group_filter=filt)  # fmt: skip


def _run(dp, steps_total, *, k=0, steps=1, cut=None):
    """Per step: the global mini-batch's group ids (all ranks) and rank 0's filter metrics."""
    gather = ThreadGather(dp)
    results: list[list] = [[] for _ in range(dp)]
    errors: list[BaseException] = []

    def rank_main(rank):
        try:
            producer = _producer(dp, rank, gather.for_rank(rank), k=k, steps=steps)
            for step in range(1, steps_total + 1):
                if cut is not None and step == cut + 1:  # resume from a checkpointed state
                    buf = io.BytesIO()
                    torch.save(producer.state_dict(), buf)
                    buf.seek(0)
                    producer = _producer(dp, rank, gather.for_rank(rank), k=k, steps=steps)
                    producer.load_state_dict(torch.load(buf, weights_only=False))
                b = producer.batch_for_step(step)
                results[rank].append(([s.group_id for s in b.samples], b.filter_metrics))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            gather.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [
        (sorted(g for r in range(dp) for g in results[r][i][0]), results[0][i][1])
        for i in range(steps_total)
    ]


def _reference(rounds: int, per_round: int):
    """Per round: the trained group ids and the prompts drawn, walking the stream."""
    out, pos = [], 0
    for _ in range(rounds):
        kept, drawn = [], 0
        while len(kept) < per_round:
            block = range(pos, pos + per_round)
            kept += [gid for gid in block if not flat(gid)]
            pos += per_round
            drawn += per_round
        out.append((kept[:per_round], drawn, len(kept) - per_round))
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_every_step_trains_exactly_the_global_batch_of_kept_groups(dp):
    steps = 6
    got = _run(dp, steps)
    per_round = GBS // G
    for (ids, metrics), (kept, drawn, unused) in zip(
        got, _reference(steps, per_round), strict=True
    ):
        assert len(ids) == GBS  # exact, whatever was filtered
        assert sorted(set(ids)) == sorted(kept)  # the first kept groups of the stream
        assert metrics["prompts_drawn"] == drawn and metrics["groups_unused"] == unused
        assert metrics["groups_filtered"] == drawn - per_round - unused
        assert metrics["generation_rounds"] == drawn // per_round
    assert any(m["generation_rounds"] > 1 for _, m in got)  # refills happened


def test_dp_invariant_with_several_mini_batches_and_run_ahead():
    """Rounds of two mini-batches, one step ahead: each round's steps train the same groups on
    one or two ranks, every step exactly global_batch_size samples."""
    one, two = _run(1, 6, k=1, steps=2), _run(2, 6, k=1, steps=2)
    for (a, _), (b, _) in zip(one, two, strict=True):
        assert len(a) == len(b) == GBS
    for r in range(3):  # a round's two mini-batches together: the same kept groups
        assert sorted(one[2 * r][0] + one[2 * r + 1][0]) == sorted(
            two[2 * r][0] + two[2 * r + 1][0]
        )


@pytest.mark.parametrize("dp", [1, 2])
def test_resume_continues_exactly(dp):
    assert _run(dp, 6, k=1, cut=3) == _run(dp, 6, k=1)


def test_too_few_groups_with_a_spread_is_a_clear_error_on_every_rank():
    def generate(request, snapshot):
        out = _generate(request, snapshot)
        for s in out:
            s.reward = 1.0  # every group flat
        return out

    sched = derive_schedule(num_generations=G, global_batch_size=GBS, dp=1)
    sampler = PromptSampler(NUM_PROMPTS, sched, dp_rank=0, seed=5)
    filt = GroupFilter(G, sched.prompts_per_round, 2, 0, lambda x: [x])
    producer = RunAheadProducer(sampler, generate, group_filter=filt)
    with pytest.raises(RuntimeError, match=r"grpo.max_generation_rounds=2.*grpo.filter_groups"):
        producer.batch_for_step(1)
    assert sampler.cursor == 3 * sched.prompts_per_round  # 1 + 2 extra draws, all counted


def test_selection_helpers():
    assert keep_flags([1.0, 1.0, 0.0, 1.0, 2.0, 2.0], 2) == [False, True, False]
    flags = [[[True, False], [False, True]], [[True, True], [False, False]]]
    assert kept_in_order(flags) == [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1)]


def test_the_round_counts_served_failures_of_the_groups_it_does_not_train():
    """Two DP ranks (their gathers side by side): rank 0 draws a flat group whose two samples
    failed and a kept one; rank 1 a kept group and a flat one with one failure. One group is
    needed: rank 0's kept group; the other three groups (6 samples, 3 failed) are untrained."""
    from rlbatch.train.filtering import UNTRAINED, UNTRAINED_FAILED

    def sample(reward: float, failed: bool) -> Sample:
        s = Sample(Prompt(0, (1,), "a"), 0, [7], [-1.0], False, 0, reward=reward)
        s.metrics["failed"] = float(failed)
        return s

    draws = {
        0: [sample(0.0, True), sample(0.0, True), sample(0.0, False), sample(1.0, False)],
        1: [sample(0.0, False), sample(1.0, False), sample(0.5, True), sample(0.5, False)],
    }
    # what each rank sends, worked out by hand: its keep flags, then [untrained, failed]
    sends = {0: [[False, True], [2, 2]], 1: [[True, False], [4, 1]]}

    def gather_of(rank: int):
        calls = iter(range(2))

        def gather(obj):
            k = next(calls)
            assert obj == sends[rank][k]
            return [sends[0][k], sends[1][k]]

        return gather

    for rank in (0, 1):
        filt = GroupFilter(2, 1, 0, rank, gather_of(rank), lambda s: bool(s.metrics["failed"]))
        kept, positions, metrics = filt.fill((None, draws[rank]), lambda: pytest.fail("drew"))
        assert metrics[UNTRAINED] == 6 and metrics[UNTRAINED_FAILED] == 3, rank
        assert len(kept) == (2 if rank == 0 else 0) and positions == ([0] if rank == 0 else [])
