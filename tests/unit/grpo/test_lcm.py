"""LCM aggregator bookkeeping, one test per invariant (docs/lcm_aggregation.md), with
deterministic fakes of the injected stage callables."""

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch.config.schema import RunConfig, ScaleRewards
from rlbatch.grpo.lcm import AggregationPlan, LCMAggregator, Stages, plan_aggregation
from rlbatch.grpo.types import Prompt, Sample, trained_samples


def prompts(n, start=0):
    return [Prompt(index=i, prompt_ids=(1, i), answer=str(i)) for i in range(start, start + n)]


class Fakes:
    """Deterministic stage callables that log every call."""

    def __init__(self):
        self.rollout_calls, self.reward_calls, self.ref_calls, self.old_calls = [], [], [], []

    def rollout(self, rows, seed):
        self.rollout_calls.append(list(rows))
        # response length 1 + (index + position) % 3 so logps have ragged lengths
        return [
            Sample(
                prompt=p,
                group_id=-1,
                response_ids=[p.index] * (1 + (p.index + k) % 3),
                behaviour_logps=[-1.0] * (1 + (p.index + k) % 3),
                truncated=False,
                policy_version=0,
            )
            for k, p in enumerate(rows)
        ]

    def reward(self, samples):
        self.reward_calls.append(len(samples))
        return [float((7 * s.prompt.index + 3 * len(s.response_ids)) % 5) for s in samples]

    def ref(self, samples):
        self.ref_calls.append(len(samples))
        return [[-0.5] * len(s.response_ids) for s in samples]

    def old(self, samples):
        self.old_calls.append(len(samples))
        return [[-0.25] * len(s.response_ids) for s in samples]

    def stages(self, ref=True, old=True, collate=None):
        return Stages(
            rollout_fn=self.rollout,
            reward_fn=self.reward,
            ref_logps_fn=self.ref if ref else None,
            old_logps_fn=self.old if old else None,
            collate_fn=collate,
        )


def make(plan, fakes=None, beta=0.0, scale=ScaleRewards.group, **kw):
    fakes = fakes or Fakes()
    agg = LCMAggregator(
        plan, fakes.stages(**kw), beta=beta, scale_rewards=scale, advantage_eps=1e-4, seed=3
    )
    return agg, fakes


def plan(rollout=2, ref=2, old=2, train=2, G=4, repeat=1, infer=False, proceed=None):
    return AggregationPlan(rollout, ref, old, train, G, repeat, infer, proceed)


def test_service_target_includes_train_micro():
    assert plan(rollout=4, ref=2, old=2, train=3).service_target_bs == 12
    assert plan(rollout=2, ref=2, old=2, train=5).service_target_bs == 10
    # ref/old passes on the infer token budget: their fixed sizes do not count
    assert plan(rollout=4, ref=5, old=7, train=2, infer=True).service_target_bs == 4
    cfg = RunConfig()
    cfg.grpo.aggregation.rollout_micro_batch_size = None
    cfg.rollout.micro_batch_size = 3
    cfg.grpo.aggregation.train_micro_batch_size = 2
    cfg.grpo.aggregation.logps_use_infer_budget = False
    p = plan_aggregation(cfg)
    assert (p.rollout_micro, p.sample_repeat) == (3, cfg.grpo.num_generations)
    # beta = 0 and on-policy: neither the ref nor the old pass runs, their sizes do not count
    assert (p.ref_pass, p.old_pass) == (False, False)
    assert p.service_target_bs == math.lcm(3, 2) == 6
    cfg.grpo.beta, cfg.grpo.num_iterations = 0.1, 2
    cfg.grpo.aggregation.ref_logps_micro_batch_size = 4
    cfg.grpo.aggregation.old_logps_micro_batch_size = 5
    assert plan_aggregation(cfg).service_target_bs == math.lcm(3, 2, 4, 5) == 60


def test_bad_sizes_name_the_keys():
    cfg = RunConfig()
    cfg.grpo.aggregation.train_micro_batch_size = 0
    cfg.grpo.aggregation.ref_logps_micro_batch_size = -1
    with pytest.raises(ValueError) as err:
        plan_aggregation(cfg)
    assert "train_micro_batch_size=0" in str(err.value)
    assert "ref_logps_micro_batch_size=-1" in str(err.value)
    cfg = RunConfig()
    cfg.grpo.aggregation.logps_use_infer_budget = False
    for k, v in [("rollout", 97), ("train", 89), ("ref_logps", 83), ("old_logps", 79)]:
        setattr(cfg.grpo.aggregation, f"{k}_micro_batch_size", v)
    with pytest.raises(ValueError, match="service_target_bs"):
        plan_aggregation(cfg)


def test_buffers_until_target_then_force_flush():
    agg, f = make(plan(rollout=4, ref=4, old=4, train=2))  # target 4
    assert agg.push(prompts(2)) == []
    assert agg.buffered_prompts == 2 and f.rollout_calls == []
    out = agg.push(prompts(2, start=2))
    assert [len(ex.prompts) for ex in out] == [2, 2] and agg.buffered_prompts == 0
    assert agg.push(prompts(1, start=4)) == []
    tail = agg.flush()
    assert [ex.prompts for ex in tail] == [prompts(1, start=4)]
    assert [r.forced for r in agg.records] == [False, True]
    assert agg.flush() == []


def test_prompts_repeated_contiguously_and_rolled_out_in_chunks():
    agg, f = make(plan(rollout=2, ref=4, old=4, train=4, G=3))  # target 4, chunks of 2 prompts
    agg.push(prompts(4))
    rows = [r for call in f.rollout_calls for r in call]
    assert [p.index for p in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [len(c) for c in f.rollout_calls] == [6, 6] == agg.records[0].rollout_chunks


def test_advantages_are_computed_on_the_merged_batch():
    for scale in ScaleRewards:
        agg, f = make(plan(rollout=2, ref=2, old=2, train=1, G=4), scale=scale)  # target 2
        out = agg.push(prompts(1)) + agg.push(prompts(1, start=1))
        samples = [s for ex in out for s in ex.samples]
        assert f.reward_calls == [8]  # one reward call over both micro-batches
        rewards = [s.reward for s in samples]
        batch_std = statistics.stdev(rewards)
        want = []
        for g in range(2):
            grp = rewards[4 * g : 4 * g + 4]
            div = {"group": statistics.stdev(grp) + 1e-4, "batch": batch_std + 1e-4}
            want += [(r - statistics.fmean(grp)) / div.get(scale.value, 1.0) for r in grp]
        assert [s.advantage for s in samples] == pytest.approx(want, rel=1e-12)


def test_split_back_at_original_boundaries():
    agg, f = make(plan(rollout=3, ref=3, old=3, train=3, G=2))  # target 3
    mbs = [prompts(1), prompts(2, start=1)]
    out = agg.push(mbs[0]) + agg.push(mbs[1])
    assert [ex.index for ex in out] == [0, 1]
    for ex, mb in zip(out, mbs, strict=True):
        assert ex.prompts == mb
        assert [s.prompt for s in ex.samples] == [p for p in mb for _ in range(2)]


def test_enqueue_order_is_a_a_b_b():
    agg, f = make(plan(rollout=2, ref=2, old=2, train=1, G=2, repeat=2))
    queue = agg.run(iter([prompts(1), prompts(1, start=1), prompts(1, start=2)]))
    assert [(ex.index, ex.iteration) for ex in queue] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    assert queue[0].samples is queue[1].samples  # the same example, not regenerated
    assert len(f.rollout_calls) == 2  # 2 prompts merged, then the forced remainder


def test_proceed_num_steps_bounds_consumption():
    agg, f = make(plan(rollout=4, ref=4, old=4, train=1, G=2, proceed=3))  # target 4
    source = iter([prompts(1, start=i) for i in range(10)])
    queue = agg.run(source)
    assert [ex.index for ex in queue] == [0, 1, 2]
    assert next(source)[0].index == 3  # nothing past the bound was pulled
    assert agg.buffered_prompts == 0 and agg.records[-1].forced


def test_remainder_is_never_dropped():
    agg, f = make(plan(rollout=2, ref=2, old=2, train=2, G=2))  # target 2
    queue = agg.run(iter([prompts(1, start=i) for i in range(5)]))
    assert [p.index for ex in queue for p in ex.prompts] == [0, 1, 2, 3, 4]
    assert sum(len(ex.samples) for ex in queue) == 10
    assert [r.num_prompts for r in agg.records] == [2, 2, 1]


def test_groups_are_never_split():
    # micro-batches of one prompt are smaller than a group of 8 samples (tunix #816)
    agg, f = make(plan(rollout=3, ref=3, old=3, train=1, G=8))  # target 3
    queue = agg.run(iter([prompts(1, start=i) for i in range(4)]))
    ids = []
    for ex in queue:
        assert len(ex.samples) == 8
        assert len({s.group_id for s in ex.samples}) == 1
        assert {s.prompt.index for s in ex.samples} == {ex.prompts[0].index}
        ids.append(ex.samples[0].group_id)
    assert ids == [0, 1, 2, 3]


def test_ref_pass_skipped_at_beta_zero_and_chunked_otherwise():
    agg, f = make(plan(rollout=4, ref=2, old=1, train=4, G=2), beta=0.0)  # target 4
    out = agg.push(prompts(4))
    assert f.ref_calls == [] and all(s.ref_logps is None for ex in out for s in ex.samples)
    assert f.old_calls == [2, 2, 2, 2] == agg.records[0].old_chunks
    agg, f = make(plan(rollout=4, ref=2, old=1, train=4, G=2), beta=0.1)
    out = agg.push(prompts(4))
    assert f.ref_calls == [4, 4] == agg.records[0].ref_chunks
    for s in (s for ex in out for s in ex.samples):
        assert s.ref_logps == [-0.5] * len(s.response_ids)
        assert s.old_logps == [-0.25] * len(s.response_ids)
    with pytest.raises(ValueError, match="grpo.beta=0.1"):
        make(plan(), beta=0.1, ref=False)


def test_logps_on_infer_budget_get_the_whole_merged_batch():
    agg, f = make(plan(rollout=2, ref=3, old=3, train=2, G=2, infer=True), beta=0.1)  # target 2
    agg.run(iter([prompts(2), prompts(1, start=2)]))
    assert f.ref_calls == [4, 2] and f.old_calls == [4, 2]


def test_no_old_pass_leaves_old_logps_unset():
    agg, f = make(plan(G=2), old=False)
    out = agg.run(iter([prompts(2)]))
    assert f.old_calls == [] and all(s.old_logps is None for s in out[0].samples)


def test_multi_dimensional_fields_sliced_by_rows():
    def collate(samples):
        return {"ids": np.array([[s.prompt.index, k, 7] for k, s in enumerate(samples)])}

    agg, f = make(plan(rollout=3, ref=3, old=3, train=3, G=2), collate=collate)
    out = agg.push(prompts(1)) + agg.push(prompts(2, start=1))
    assert out[0].fields["ids"].tolist() == [[0, 0, 7], [0, 1, 7]]
    assert out[1].fields["ids"].tolist() == [[1, 2, 7], [1, 3, 7], [2, 4, 7], [2, 5, 7]]


def test_state_dict_keeps_the_pending_buffer():
    agg, f = make(plan(rollout=4, ref=4, old=4, train=1, G=2))
    agg.push(prompts(1))
    agg.push(prompts(1, start=1))
    state = agg.state_dict()
    agg2, f2 = make(plan(rollout=4, ref=4, old=4, train=1, G=2))
    agg2.load_state_dict(state)
    out = agg2.push(prompts(1, start=2)) + agg2.push(prompts(1, start=3))
    assert [p.index for ex in out for p in ex.prompts] == [0, 1, 2, 3]
    assert f2.rollout_calls[0][0].index == 0


def test_empty_micro_batch_is_an_error():
    agg, f = make(plan())
    with pytest.raises(ValueError, match="empty training micro-batch"):
        agg.push([])


def test_worked_example_of_the_docs():
    p = plan(rollout=2, ref=2, old=2, train=3, G=4, repeat=2)
    assert p.service_target_bs == 6
    agg, f = make(p, beta=0.04)
    queue = agg.run(iter([prompts(3), prompts(3, start=3), prompts(1, start=6)]))
    assert [(ex.index, ex.iteration) for ex in queue] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    first, tail = agg.records
    assert (first.num_prompts, first.forced, tail.num_prompts, tail.forced) == (6, False, 1, True)
    assert first.rollout_chunks == first.ref_chunks == first.old_chunks == [8, 8, 8]
    assert tail.rollout_chunks == tail.ref_chunks == tail.old_chunks == [4]
    assert f.reward_calls == [24, 4]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=12),
    micro=st.tuples(*[st.integers(1, 4)] * 4),
    G=st.integers(1, 4),
    repeat=st.integers(1, 3),
    infer=st.booleans(),
)
def test_property_every_prompt_once_in_order_groups_whole(sizes, micro, G, repeat, infer):
    rollout, ref, old, train = micro
    p = plan(rollout, ref, old, train, G, repeat, infer)
    agg, f = make(p, beta=0.1)
    mbs, start = [], 0
    for n in sizes:
        mbs.append(prompts(n, start=start))
        start += n
    queue = agg.run(iter(mbs))
    # a a b b: each example batch_repeat times consecutively, examples in push order
    assert [(ex.index, ex.iteration) for ex in queue] == [
        (i, k) for i in range(len(mbs)) for k in range(repeat)
    ]
    firsts = queue[::repeat]
    assert [ex.prompts for ex in firsts] == mbs  # nothing dropped, boundaries kept
    for ex in firsts:
        assert [s.prompt for s in ex.samples] == [q for q in ex.prompts for _ in range(G)]
        ids = [s.group_id for s in ex.samples]
        assert all(len(set(ids[g * G : (g + 1) * G])) == 1 for g in range(len(ex.prompts)))
    # every round but the last waited for the target; chunks never exceed their size
    assert all(r.num_prompts >= p.service_target_bs for r in agg.records[:-1])
    for r in agg.records:
        assert max(r.rollout_chunks) <= rollout * G and sum(r.rollout_chunks) == r.num_prompts * G
        if not infer:
            assert max(r.ref_chunks) <= ref * G and max(r.old_chunks) <= old * G


def test_a_split_episode_trains_every_segment_with_its_episodes_advantage():
    """A row whose sample carries earlier segments (a split agent episode): one reward per row,
    advantages over the group's episodes, the logp passes over every segment, and each segment
    handed its episode's advantage; rows, groups and the split back stay the rows'."""
    f = Fakes()
    rollout = f.rollout

    def split_every_third(rows, seed):
        out = rollout(rows, seed)
        for k, s in enumerate(out):
            if k % 3 == 0:  # two earlier segments of 2 and 3 tokens
                s.earlier_segments = [
                    Sample(s.prompt, -1, [9] * n, [-2.0] * n, False, 0) for n in (2, 3)
                ]
        return out

    f.rollout = split_every_third
    agg, _ = make(plan(rollout=2, ref=2, old=2, train=2, G=4), fakes=f, beta=0.1)
    out = agg.push(prompts(2))
    rows = [s for ex in out for s in ex.samples]
    assert len(rows) == 8 and f.reward_calls == [8]  # one reward per episode
    rewards = [s.reward for s in rows]
    for g in range(2):  # float64 reference: the group's 4 episodes
        grp = rewards[4 * g : 4 * g + 4]
        want = [(r - statistics.fmean(grp)) / (statistics.stdev(grp) + 1e-4) for r in grp]
        assert [s.advantage for s in rows[4 * g : 4 * g + 4]] == pytest.approx(want, rel=1e-12)
    split = [s for s in rows if s.earlier_segments]
    assert len(split) == 3
    assert sum(f.ref_calls) == sum(f.old_calls) == 8 + 2 * 3  # every segment scored
    for row in split:
        for part in row.earlier_segments:
            assert part.advantage == row.advantage and part.reward == row.reward
            assert part.group_id == row.group_id
            assert part.ref_logps == [-0.5] * len(part.response_ids)
            assert part.old_logps == [-0.25] * len(part.response_ids)


def test_trained_samples_lists_rows_then_earlier_segments():
    def sample(n):
        return Sample(prompts(1)[0], 7, [1] * n, [-1.0] * n, False, 0)

    a, b, c = sample(1), sample(2), sample(3)
    b.earlier_segments = [sample(4), sample(5)]
    b.reward, b.advantage = 2.0, -0.5
    assert trained_samples([a, c]) == [a, c]
    out = trained_samples([a, b, c])
    assert out[:3] == [a, b, c] and out[3:] == b.earlier_segments
    assert [(s.advantage, s.reward, s.group_id) for s in out[3:]] == [(-0.5, 2.0, 7)] * 2


def test_a_split_episodes_segments_are_masked_as_the_episode_under_mask_truncated():
    """grpo.mask_truncated_completions reads each trained sample's ``truncated``: a segment
    carries its episode's (cut short: all masked), not its own last call's length stop."""
    from rlbatch.batching.plan import MicroBatch
    from rlbatch.grpo.loss import build_grpo_batch

    def sample(n, truncated):
        return Sample(prompts(1)[0], 7, [1] * n, [-1.0] * n, truncated, 0)

    cut, whole = sample(3, True), sample(3, False)
    cut.earlier_segments = [sample(4, False)]  # its own call ended on EOS; the episode was cut
    whole.earlier_segments = [sample(5, True)]  # a call stopped at a limit; the episode went on
    out = trained_samples([cut, whole])
    assert [s.truncated for s in out] == [True, False, True, False]
    lengths = [s.length for s in out]
    mb = MicroBatch(tuple(range(4)), tuple(lengths), max(lengths), 4 * max(lengths), sum(lengths))
    batch, _ = build_grpo_batch(out, mb, round_to=1, mask_truncated=True)
    kept = batch.loss_mask.sum(-1).tolist()  # one row per sample
    assert kept == [0, len(whole.response_ids), 0, len(whole.earlier_segments[0].response_ids)]
