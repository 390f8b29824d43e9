"""The round's first step (batch reward std over every DP rank, the old-logprob pass), the
aggregation round bound in training (proceed_num_steps) and the LCM rule shared by the
validator and the runtime. References: Python's statistics module and plain arithmetic."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from rlbatch.config.schema import RolloutCorrection, RunConfig, ScaleRewards
from rlbatch.config.validate import lcm_micro_sizes, validate
from rlbatch.grpo.advantages import compute_advantages
from rlbatch.grpo.lcm import (
    AggregationPlan,
    LCMAggregator,
    OldSource,
    Stages,
    aggregation_plan,
    behaviour_weighted,
    off_policy,
    old_from_forward,
    old_pass_runs,
    pi_old_source,
    steps_per_round,
)
from rlbatch.grpo.proximal import compute_old_logps, scale_by_batch_std
from rlbatch.grpo.types import Prompt, Sample
from rlbatch.rollout.generation import make_generate_fn
from rlbatch.rollout.schedule import GenerationRequest
from rlbatch.train.producer import PolicySnapshot


def _samples(n: int, g: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r_len = rng.randint(1, 5)
        out.append(
            Sample(
                prompt=Prompt(i // g, (1, 2), ""),
                group_id=i // g,
                response_ids=[3] * r_len,
                behaviour_logps=[-rng.uniform(0.5, 3) for _ in range(r_len)],
                truncated=False,
                policy_version=0,
                reward=rng.choice([0.0, 0.25, 1.0]),
            )
        )
    return out


def test_batch_std_spans_every_rank_of_the_generation_batch():
    g, eps = 4, 1e-4
    ranks = [_samples(12, g, seed=r) for r in range(3)]  # 3 DP ranks, 3 groups each
    for share in ranks:  # what the aggregator computes with scale_rewards=none: centring only
        centred = compute_advantages([s.reward for s in share], g, ScaleRewards.none, eps)
        for s, a in zip(share, centred, strict=True):
            s.advantage = a
    everything = [s.reward for share in ranks for s in share]
    std = statistics.stdev(everything)  # unbiased, over the whole generation batch
    gather = lambda _mine: [[s.reward for s in share] for share in ranks]  # noqa: E731
    for share in ranks:
        centred = [s.advantage for s in share]
        assert scale_by_batch_std(share, eps, gather) == pytest.approx(std, rel=1e-13)
        for s, c in zip(share, centred, strict=True):
            assert s.advantage == pytest.approx(c / (std + eps), rel=1e-13)
    # one rank's own std differs: a per-rank (or per aggregation round) std would be wrong
    assert statistics.stdev(s.reward for s in ranks[0]) != pytest.approx(std)


def _plan(infer: bool, old: int = 2) -> AggregationPlan:
    return AggregationPlan(
        rollout_micro=2, ref_micro=2, old_micro=old, train_micro=2, sample_repeat=4,
        batch_repeat=2, logps_use_infer_budget=infer,
    )  # fmt: skip


@pytest.mark.parametrize(("infer", "chunks"), [(False, [12, 12, 4]), (True, [28])])
def test_old_pass_chunks_and_sets_old_logps(infer, chunks):
    samples = _samples(28, 4, seed=5)
    calls: list[int] = []

    def policy_logps(batch):  # a deterministic stand-in policy: -0.1 * position
        return [[-0.1 * (k + 1) for k in range(len(s.response_ids))] for s in batch]

    compute_old_logps(samples, policy_logps, _plan(infer, old=3), calls)
    assert calls == chunks  # 3 prompts x 4 rows per chunk, or one infer-budget call
    for s in samples:
        assert s.old_logps == [-0.1 * (k + 1) for k in range(len(s.response_ids))]


# (steps_per_generation, generation_batch_size, num_iterations, num_steps_async, correction)
#   -> (off-policy, pi_old source); written from docs/grpo_loss.md's table, case by case
PI_OLD_CASES = [
    # synchronous round of one step: on-policy, pi_old = the forward, w = trainer / rollout
    ((None, None, 1, 0, "token_tis"), (False, OldSource.forward)),
    # several mini-batches per generation, synchronous: steps 2.. are off-policy -> old pass
    ((2, None, 1, 0, "token_tis"), (True, OldSource.old_pass)),
    ((4, None, 1, 0, "seq_mask"), (True, OldSource.old_pass)),
    ((None, 2 * 64, 1, 0, "token_tis"), (True, OldSource.old_pass)),  # gen batch = 2 x global
    ((None, None, 2, 0, "token_tis"), (True, OldSource.old_pass)),  # each sample trained twice
    # generated ahead, one step per round: the proximal policy is the step's own
    ((None, None, 1, 1, "token_tis"), (True, OldSource.forward)),
    ((2, None, 1, 1, "token_tis"), (True, OldSource.old_pass)),
    ((None, 2 * 64, 2, 2, "seq_tis"), (True, OldSource.old_pass)),
    # none: pi_old is the behaviour policy in every case (the ratio sees staleness directly)
    ((None, None, 1, 0, "none"), (False, OldSource.behaviour)),
    ((4, None, 1, 0, "none"), (True, OldSource.behaviour)),
    ((None, None, 1, 1, "none"), (True, OldSource.behaviour)),
    ((2, None, 2, 1, "none"), (True, OldSource.behaviour)),
]


@pytest.mark.parametrize(("case", "expected"), PI_OLD_CASES)
def test_pi_old_source_follows_the_documented_rule(case, expected):
    steps, gen_batch, iters, ahead, correction = case
    cfg = RunConfig()
    cfg.grpo.global_batch_size = 64
    cfg.grpo.steps_per_generation, cfg.grpo.generation_batch_size = steps, gen_batch
    cfg.grpo.num_iterations, cfg.grpo.num_steps_async = iters, ahead
    cfg.grpo.rollout_correction = RolloutCorrection(correction)
    want_off, want_source = expected
    assert (off_policy(cfg), pi_old_source(cfg)) == (want_off, want_source)
    assert old_pass_runs(cfg) == (want_source == OldSource.old_pass)
    assert old_from_forward(cfg) == (want_source == OldSource.forward)
    assert behaviour_weighted(cfg) == (want_source != OldSource.behaviour)
    # the aggregation plan counts the old pass's chunk size only when that pass runs
    assert aggregation_plan(cfg).old_pass == (want_source == OldSource.old_pass)


def test_no_round_of_several_steps_takes_pi_old_from_the_step_itself():
    """No combination trains steps 2.. of a round against the step's own forward (ratio 1)."""
    for steps in (None, 1, 2, 3):
        for iters in (1, 2):
            for ahead in (0, 1):
                for correction in RolloutCorrection:
                    cfg = RunConfig()
                    cfg.grpo.steps_per_generation, cfg.grpo.num_iterations = steps, iters
                    cfg.grpo.num_steps_async = ahead
                    cfg.grpo.rollout_correction = correction
                    if (steps or 1) * iters > 1:
                        assert pi_old_source(cfg) != OldSource.forward, (steps, iters, ahead)


@pytest.mark.parametrize(
    ("steps", "gen_batch", "iters"), [(None, None, 1), (3, None, 1), (None, 256, 2), (2, None, 3)]
)
def test_steps_per_round_agrees_with_the_loop_schedule(steps, gen_batch, iters):
    """The old-pass rule reads the same round length the producer trains (rollout.schedule)."""
    from rlbatch.rollout.schedule import schedule_from_config

    cfg = RunConfig()
    cfg.grpo.steps_per_generation, cfg.grpo.generation_batch_size = steps, gen_batch
    cfg.grpo.num_iterations = iters
    for dp in (1, 2, 4):
        assert steps_per_round(cfg) == schedule_from_config(cfg.grpo, dp).steps_per_round


@pytest.mark.parametrize(
    ("infer", "beta", "iters", "expected"),
    [
        (True, 0.1, 2, math.lcm(4, 2)),  # infer budget: ref/old sizes never count
        (False, 0.0, 1, math.lcm(4, 2)),  # no ref pass (beta 0), no old pass (on-policy)
        (False, 0.1, 1, math.lcm(4, 2, 3)),  # ref pass with fixed chunks
        (False, 0.1, 2, math.lcm(4, 2, 3, 5)),  # and the old pass
    ],
)
def test_validator_lcm_rule_is_the_runtime_rule(infer, beta, iters, expected):
    from rlbatch.grpo.lcm import plan_aggregation

    cfg = RunConfig()
    agg = cfg.grpo.aggregation
    cfg.rollout.micro_batch_size, agg.train_micro_batch_size = 4, 2
    agg.ref_logps_micro_batch_size, agg.old_logps_micro_batch_size = 3, 5
    agg.logps_use_infer_budget = infer
    cfg.grpo.beta, cfg.grpo.num_iterations = beta, iters
    assert lcm_micro_sizes(cfg) == plan_aggregation(cfg).service_target_bs == expected
    # the validator rejects exactly when the runtime target exceeds a rank's prompts per round
    cfg.grpo.num_generations, cfg.grpo.global_batch_size = 2, 2 * (expected - 1)
    rejected = [e for e in validate(cfg) if e.key == "grpo.aggregation"]
    assert rejected and f"lcm({expected})" in str(rejected[0])
    cfg.grpo.global_batch_size = 2 * expected
    assert not [e for e in validate(cfg) if e.key == "grpo.aggregation"]


class _Engine:
    def generate(self, prompts, num_generations, policy_version, seed):
        return [Sample(p, 0, [1, 2], [-0.5, -0.5], False, policy_version) for p in prompts]


@pytest.mark.parametrize(("proceed", "rounds"), [(None, [2, 2, 1]), (1, [1, 1, 1, 1, 1])])
def test_proceed_num_steps_bounds_each_aggregation_round_in_training(proceed, rounds):
    """A round's 10 prompts arrive as 5 training micro-batches of 2; service_target_bs = 4
    merges two of them per aggregation round; proceed_num_steps=1 flushes after each."""
    plan = AggregationPlan(
        rollout_micro=4, ref_micro=4, old_micro=4, train_micro=2, sample_repeat=2,
        batch_repeat=1, proceed_num_steps=proceed,
    )  # fmt: skip
    stages = Stages(rollout_fn=None, reward_fn=lambda ss: [1.0] * len(ss))
    agg = LCMAggregator(
        plan, stages, beta=0.0, scale_rewards=ScaleRewards.group, advantage_eps=1e-4
    )
    prompts = [Prompt(i, (1, i + 2), "") for i in range(10)]
    gen = make_generate_fn(prompts, agg, _Engine(), train_micro_batch_size=2)
    req = GenerationRequest(0, tuple(range(10)), tuple(range(10)), num_generations=2)
    out = gen(req, PolicySnapshot(version=0))
    assert [s.prompt.index for s in out] == [i for i in range(10) for _ in range(2)]
    assert [r.num_micro_batches for r in agg.records] == rounds
