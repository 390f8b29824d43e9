"""generate_fn on the real LCM aggregator with a fake rollout engine; reward adapter."""

from __future__ import annotations

import random

from rlbatch.config.schema import ScaleRewards
from rlbatch.grpo.lcm import AggregationPlan, LCMAggregator, Stages
from rlbatch.grpo.stages import make_reward_batch_fn
from rlbatch.grpo.types import Prompt, Sample
from rlbatch.rollout.generation import make_generate_fn, rank_seed
from rlbatch.rollout.schedule import GenerationRequest, PromptSampler, derive_schedule
from rlbatch.train.producer import PolicySnapshot, RunAheadProducer


class FakeEngine:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, num_generations, policy_version, seed):
        self.calls.append((len(prompts), policy_version, seed))
        rng = random.Random(seed)
        return [
            Sample(p, g, [rng.randrange(3) for _ in range(2)], [-0.5, -0.5], False, policy_version)
            for g, p in enumerate(prompts)
            for _ in range(num_generations)
        ]


def _setup(num_prompts=20, g=2):
    prompts = [Prompt(i, (1, i + 2), str(i)) for i in range(num_prompts)]
    plan = AggregationPlan(
        rollout_micro=2, ref_micro=2, old_micro=2, train_micro=2, sample_repeat=g, batch_repeat=3
    )
    stages = Stages(rollout_fn=None, reward_fn=lambda ss: [float(sum(s.response_ids)) for s in ss])
    agg = LCMAggregator(
        plan, stages, beta=0.0, scale_rewards=ScaleRewards.none, advantage_eps=1e-4, seed=1
    )
    engine = FakeEngine()
    return prompts, agg, engine, make_generate_fn(prompts, agg, engine, train_micro_batch_size=2)


def test_generate_fn_returns_request_order_groups_with_advantages():
    prompts, agg, engine, gen = _setup()
    req = GenerationRequest(
        round_index=0,
        prompt_indices=(7, 3, 11, 0, 5, 9),
        group_ids=(100, 101, 102, 103, 104, 105),
        num_generations=2,
    )
    out = gen(req, PolicySnapshot(version=4))
    assert [s.prompt.index for s in out] == [7, 7, 3, 3, 11, 11, 0, 0, 5, 5, 9, 9]
    assert [s.group_id for s in out] == [100, 100, 101, 101, 102, 102, 103, 103, 104, 104, 105, 105]
    assert {s.policy_version for s in out} == {4}
    assert [v for _, v, _ in engine.calls] == [4, 4, 4]  # 3 rollout chunks of 2 prompts
    for k in range(0, 12, 2):  # scale_rewards=none: advantage = reward - group mean
        r0, r1 = out[k].reward, out[k + 1].reward
        assert out[k].advantage == r0 - (r0 + r1) / 2
    assert agg.buffered_prompts == 0  # nothing left behind (and no a a b b repeats)
    assert len(out) == 12


def test_generate_fn_under_run_ahead_tags_versions():
    prompts, agg, engine, gen = _setup()
    sched = derive_schedule(num_generations=2, global_batch_size=4, dp=1)
    producer = RunAheadProducer(
        PromptSampler(20, sched, dp_rank=0, seed=0), gen, num_steps_async=1, max_staleness=1
    )
    stale = [producer.batch_for_step(step).staleness_mean for step in range(1, 6)]
    assert stale == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [v for _, v, _ in engine.calls] == [0, 0, 1, 2, 3, 4]


class ByteTok:
    eos_id = 0
    eos_ids = (0,)

    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids)


def test_reward_batch_strips_eos_and_decodes():
    seen = []

    def fn(x):
        seen.append(x)
        return float(len(x.response))

    s = Sample(Prompt(0, (1,), "ans", "Q?"), 0, [1, 2, 0], [0.0] * 3, False, 0)
    t = Sample(Prompt(0, (1,), "ans", "Q?"), 0, [3, 3, 3], [0.0] * 3, True, 0)
    assert make_reward_batch_fn(fn, ByteTok())([s, t]) == [2.0, 3.0]
    assert (seen[0].response, seen[0].num_response_tokens, seen[0].answer) == ("ab", 2, "ans")
    assert seen[0].prompt == "Q?"


def test_rank_seed_distinct_and_stable():
    seeds = {rank_seed(1234, r) for r in range(1000)}
    assert len(seeds) == 1000 and rank_seed(1234, 5) == rank_seed(1234, 5)


class _ThreadDist:
    """Two DP ranks in threads: sums and gathers over both (a barrier between them)."""

    def __init__(self) -> None:
        import threading

        self.barrier = threading.Barrier(2, timeout=30)
        self.slots: list = [None, None]

    def for_rank(self, rank: int):
        outer = self

        class Rank:
            def _gather(self, obj):
                outer.slots[rank] = obj
                outer.barrier.wait()
                out = list(outer.slots)
                outer.barrier.wait()
                return out

            def all_reduce_sum(self, values):
                return [sum(v) for v in zip(*self._gather(list(values)), strict=True)]

            def all_gather_object(self, obj):
                return self._gather(obj)

        return Rank()


def test_the_served_error_stop_names_an_example_on_every_dp_rank():
    """Only rank 1's samples failed: the step is over data.served.max_error_fraction on both
    ranks, and rank 0's message (the one a run shows when rank 0 reports first) named no
    example; both name rank 1's."""
    import threading
    from types import SimpleNamespace

    from rlbatch.config.schema import RunConfig
    from rlbatch.grpo.stages import SERVED_FAILED
    from rlbatch.rewards.served import ServedError
    from rlbatch.train.build import make_served_check

    cfg = RunConfig()
    cfg.data.reward = "judge"
    cfg.data.served.max_error_fraction = 0.2  # 2 of 8 is over it
    dist = _ThreadDist()

    def batch(rank: int):
        samples = [Sample(Prompt(0, (1,), "a"), 0, [7], [-1.0], False, 0) for _ in range(4)]
        if rank == 1:
            for s in samples[:2]:
                s.metrics[SERVED_FAILED] = 1.0
                s.reward_failures = ["judge: no_score: 'Score: 5%'"]
        return SimpleNamespace(samples=samples, new_round=False, filter_metrics={})

    errors: dict[int, str] = {}

    def run(rank: int) -> None:
        check = make_served_check(cfg, dist.for_rank(rank))
        try:
            check(batch(rank), 3)
        except ServedError as err:
            errors[rank] = str(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(errors) == [0, 1]
    for rank in (0, 1):
        assert "step 3: 2 of the 8 samples had a served reward failure" in errors[rank]
        assert "e.g. judge: no_score: 'Score: 5%'" in errors[rank], rank


def test_reward_failures_count_once_when_a_round_trains_again():
    """grpo.num_iterations=2 trains the round's samples twice: their reward failures are
    counted on the first iteration's step and 0 on the second (summed over steps, once)."""
    from rlbatch.config.schema import RunConfig
    from rlbatch.train.build import make_batch_figures
    from rlbatch.train.components import LocalDist

    cfg = RunConfig()
    cfg.data.reward = "judge"
    samples = [Sample(Prompt(0, (1,), "a"), 0, [7], [-1.0], False, 0) for _ in range(4)]
    for s in samples[:3]:
        s.metrics["reward_fail/timeout"] = 1.0
    figures = make_batch_figures(cfg, LocalDist(), 0)
    assert figures(samples, 1, 0)["reward_fail/timeout"] == 3.0
    assert figures(samples, 2, 1)["reward_fail/timeout"] == 0.0
