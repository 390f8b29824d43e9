"""TokenRolloutEngine: an engine that decodes token ids only (rollout.backend=megatron_dynamic's,
which needs CUDA) becomes a RolloutEngine: contiguous groups, every per-token field aligned."""

from __future__ import annotations

from rlbatch.grpo.types import Prompt
from rlbatch.rollout.engines.megatron_dynamic import TokenRolloutEngine


class _Reverse:
    """Decodes each prompt into its ids reversed plus EOS 0 when the seed is even."""

    def __init__(self):
        self.calls = []

    def decode(self, prompt_ids, seed):
        self.calls.append(([list(p) for p in prompt_ids], seed))
        eos = [0] if seed % 2 == 0 else []
        return [(list(p)[::-1] + eos, [-0.5] * (len(p) + len(eos)), not eos) for p in prompt_ids]


def test_groups_are_contiguous_and_samples_carry_the_decoded_tokens():
    decoder = _Reverse()
    prompts = [Prompt(7, (1, 2, 3), "a"), Prompt(9, (4, 5), "b")]
    samples = TokenRolloutEngine(decoder).generate(prompts, 2, policy_version=3, seed=4)
    assert decoder.calls == [([[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]], 4)]
    assert [s.group_id for s in samples] == [0, 0, 1, 1]
    assert [s.prompt.index for s in samples] == [7, 7, 9, 9]
    assert samples[2].response_ids == [5, 4, 0] and not samples[2].truncated
    for s in samples:
        n = len(s.response_ids)
        assert s.loss_mask == [1] * n and s.token_versions == [3] * n
        assert s.behaviour_logps == [-0.5] * n
    odd = TokenRolloutEngine(_Reverse()).generate(prompts[:1], 1, policy_version=0, seed=1)
    assert odd[0].truncated and odd[0].response_ids == [3, 2, 1]


class _Backend:
    """A TokenBackend that decodes every row as [7, EOS 0]."""

    version = None

    def sync_weights(self, version):
        pass

    def decode(self, prompt_ids, seeds, sampling, max_tokens=None):
        from rlbatch.rollout.protocol import DecodedRow

        return [DecodedRow([7, 0], [-0.1, -0.2], truncated=False) for _ in prompt_ids]


def test_an_engine_derived_for_other_sampling_keeps_its_turns():
    """Evaluation's engine (the run's with other sampling settings) runs multi-turn episodes
    through the run's turns, or through the turns it is given: never single-turn."""
    from rlbatch.rollout.protocol import SyncedRolloutEngine, TokenSampling

    calls = []

    def turns(backend, sampling, rows, seeds, version):
        calls.append((sampling, len(rows)))
        return []

    def other(backend, sampling, rows, seeds, version):
        calls.append(("other", len(rows)))
        return []

    engine = SyncedRolloutEngine(_Backend(), TokenSampling(16, 1.0, eos_id=0), turns=turns)
    evaluation = TokenSampling(4, 0.5, eos_id=0, top_k=1)
    engine.with_sampling(evaluation).generate([Prompt(1, (1, 2), "a")], 2, 1, seed=3)
    assert calls == [(evaluation, 2)]
    engine.with_sampling(evaluation, turns=other).generate([Prompt(1, (1, 2), "a")], 1, 1, 3)
    assert calls[-1] == ("other", 1)


def test_a_weight_sync_made_by_a_derived_engine_counts_in_the_runs_figures():
    """Evaluation may be the first to generate with a new policy version: the sync it makes
    is reported with the run's rollout/weight_syncs, not lost with the derived engine."""
    from rlbatch.rollout.protocol import SyncedRolloutEngine, TokenSampling

    engine = SyncedRolloutEngine(_Backend(), TokenSampling(16, 1.0, eos_id=0))
    engine.with_sampling(TokenSampling(4, 0.5, eos_id=0)).generate([Prompt(1, (1,), "a")], 1, 5, 3)
    engine.generate([Prompt(1, (1,), "a")], 1, 5, seed=3)  # version 5 is already there
    assert engine.take_figures()["rollout/weight_syncs"] == 1.0
    assert engine.take_figures() == {}
