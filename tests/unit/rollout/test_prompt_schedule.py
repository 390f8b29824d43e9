"""Prompt sampler and generation schedule: sharding, epochs, groups, resume, determinism."""

from __future__ import annotations

from collections import Counter

import pytest

from rlbatch.rollout.schedule import (
    PromptSampler,
    derive_schedule,
    expand_groups,
    minibatch_groups,
)


def _samplers(num_prompts, dp, *, g=4, gbs=16, steps=None, seed=7):
    sched = derive_schedule(
        num_generations=g, global_batch_size=gbs, dp=dp, steps_per_generation=steps
    )
    return [PromptSampler(num_prompts, sched, dp_rank=r, seed=seed) for r in range(dp)]


def test_derived_numbers_from_steps_or_generation_batch_size():
    a = derive_schedule(
        num_generations=8, global_batch_size=64, dp=2, steps_per_generation=3, num_iterations=2
    )
    # 64 samples/step x 3 steps = 192 samples = 24 prompts per round, 12 per rank; 2 iterations.
    assert (a.generation_batch_size, a.prompts_per_round, a.prompts_per_rank_round) == (192, 24, 12)
    assert (a.steps_per_round, a.groups_per_rank_step, a.samples_per_rank_step) == (6, 4, 32)
    b = derive_schedule(
        num_generations=8, global_batch_size=64, dp=2, generation_batch_size=192, num_iterations=2
    )
    assert b == a
    c = derive_schedule(num_generations=8, global_batch_size=64, dp=1)
    assert c.steps_per_generation == 1 and c.prompts_per_round == 8


def test_derived_numbers_reject_bad_combinations_all_at_once():
    with pytest.raises(ValueError) as err:
        derive_schedule(
            num_generations=8,
            global_batch_size=24,
            dp=2,
            steps_per_generation=2,
            generation_batch_size=48,
        )
    msg = str(err.value)
    assert "mutually exclusive" in msg
    assert "grpo.global_batch_size=24" in msg and "16" in msg
    with pytest.raises(ValueError, match="generation_batch_size=100"):
        derive_schedule(num_generations=4, global_batch_size=16, dp=1, generation_batch_size=100)


def test_round_position_order():
    s = derive_schedule(
        num_generations=2, global_batch_size=4, dp=1, steps_per_generation=2, num_iterations=2
    )
    got = [s.round_position(step) for step in range(1, 10)]
    # (round, iteration, slice): each mini-batch (slice) twice in a row, a a b b
    assert got == [
        (0, 0, 0),
        (0, 1, 0),
        (0, 0, 1),
        (0, 1, 1),
        (1, 0, 0),
        (1, 1, 0),
        (1, 0, 1),
        (1, 1, 1),
        (2, 0, 0),
    ]
    with pytest.raises(ValueError, match="numbered from 1"):
        s.round_position(0)


@pytest.mark.parametrize("num_prompts", [40, 37, 5])
def test_every_prompt_once_per_epoch_across_ranks(num_prompts):
    dp = 2
    samplers = _samplers(num_prompts, dp, g=4, gbs=16)  # 4 prompts per round, 2 per rank
    stream = []  # global order reconstructed from the ranks' blocks
    while len(stream) < 3 * num_prompts:
        reqs = [s.next_round() for s in samplers]
        for a in range(dp):
            for b in range(a + 1, dp):
                assert not set(reqs[a].group_ids) & set(reqs[b].group_ids)
        for r in reqs:
            stream.extend(r.prompt_indices)
    for epoch in range(3):
        block = stream[epoch * num_prompts : (epoch + 1) * num_prompts]
        assert sorted(block) == list(range(num_prompts)), epoch
    first, second = stream[:num_prompts], stream[num_prompts : 2 * num_prompts]
    if num_prompts > 5:
        assert first != second  # reshuffled per epoch
        assert first != sorted(first)  # shuffled at all


def test_ranks_read_disjoint_prompts_within_a_round():
    samplers = _samplers(1000, 4, g=2, gbs=16)
    reqs = [s.next_round() for s in samplers]
    sets = [set(r.prompt_indices) for r in reqs]
    assert all(len(x) == 2 for x in sets)
    assert len(set().union(*sets)) == 8


def test_shuffle_is_global_not_within_a_shard():
    # Rank 0 must eventually see prompts from the whole dataset, not a fixed half.
    (s0, _) = _samplers(100, 2, g=1, gbs=2)
    seen_epoch0 = {s0.next_round().prompt_indices[0] for _ in range(50)}
    seen_epoch1 = {s0.next_round().prompt_indices[0] for _ in range(50)}
    assert seen_epoch0 != seen_epoch1
    assert max(seen_epoch0) >= 50 and min(seen_epoch0) < 50


def test_groups_contiguous_and_group_ids_unique():
    (s,) = _samplers(10, 1, g=3, gbs=6)
    req = s.next_round()
    assert req.repeated() == [req.prompt_indices[0]] * 3 + [req.prompt_indices[1]] * 3
    ids = [g for _ in range(20) for g in s.next_round().group_ids]
    assert len(ids) == len(set(ids))


def test_resume_equals_uninterrupted():
    (a,) = _samplers(13, 1, g=2, gbs=6)  # 3 prompts per round: rounds straddle epochs
    full = [a.next_round() for _ in range(20)]
    (b,) = _samplers(13, 1, g=2, gbs=6)
    head = [b.next_round() for _ in range(7)]
    state = b.state_dict()
    (c,) = _samplers(13, 1, g=2, gbs=6)
    c.load_state_dict(state)
    tail = [c.next_round() for _ in range(13)]
    assert head + tail == full


def test_resume_refuses_other_dataset():
    (a,) = _samplers(13, 1, g=2, gbs=6)
    (b,) = _samplers(14, 1, g=2, gbs=6)
    with pytest.raises(ValueError, match="num_prompts=13"):
        b.load_state_dict(a.state_dict())


def test_deterministic_and_seed_dependent():
    def order(seed):
        (s,) = _samplers(50, 1, g=1, gbs=5, seed=seed)
        return [s.next_round().prompt_indices for _ in range(10)]

    assert order(3) == order(3)
    assert order(3) != order(4)


def test_minibatches_cover_buffer_once_and_reshuffle_per_round():
    s = derive_schedule(
        num_generations=2, global_batch_size=6, dp=1, steps_per_generation=4, num_iterations=2
    )
    n = s.prompts_per_rank_round  # 12 groups
    per_round = []
    for rnd in (5, 6):
        groups = [
            g
            for sl in range(4)
            for g in minibatch_groups(n, s, seed=1, round_index=rnd, slice_index=sl)
        ]
        assert sorted(groups) == list(range(n))
        per_round.append(groups)
    assert per_round[0] != per_round[1]
    assert expand_groups([3, 0], 2) == [6, 7, 0, 1]


def test_sibling_count_per_epoch():
    samplers = _samplers(8, 2, g=4, gbs=16)
    c = Counter()
    for _ in range(2):
        for s in samplers:
            c.update(s.next_round().repeated())
    assert c == Counter({i: 4 for i in range(8)})
