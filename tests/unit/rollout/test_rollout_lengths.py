"""The long-tailed response-length workload (debug.response_length_median) and decode-slot
occupancy of the built-in engine, on a real megatron-core GPTModel (tiny Qwen2 shape).

References: the lognormal CDF in float64 for the caps; the engine's own uncapped samples cut at
each row's cap for the capped ones (caps change where a row stops, never what it samples); the
occupancy counted in the test from the returned samples."""

from __future__ import annotations

import math

import pytest
import torch

from rlbatch.grpo.types import Prompt
from rlbatch.rollout.engines.builtin import MegatronRolloutEngine, SamplingParams
from rlbatch.rollout.sampling import length_caps, row_keys

LENGTHS = [5, 9, 3, 7, 4]
GROUP = 2


@pytest.fixture(scope="module")
def model():
    """The tiny Qwen2 policy built by the engine (pp=1)."""
    from rlbatch.config.schema import RunConfig
    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model

    cfg = RunConfig()
    cfg.model.init_method_std = 0.3
    if not parallel.is_initialized():
        parallel.initialize(cfg)
    # the same weights whatever ran before in this process: the test's cases (a row ending at an
    # EOS before its cap, truncated and untruncated rows) come from what this model samples, and
    # this seed's model has them all (seeds 0, 2 and 4 lack one)
    parallel.seed(1)
    (chunk,) = build_model(cfg, wrap_ddp=False)
    return chunk


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Prompt(
            index=i, prompt_ids=tuple(torch.randint(0, 256, (n,), generator=g).tolist()), answer=""
        )
        for i, n in enumerate(lengths)
    ]


def test_caps_follow_the_clamped_lognormal():
    """P(cap <= k) = Phi((ln(k + 0.5) - ln median) / sigma) for 1 <= k < max_new_tokens (a draw
    rounds to the nearest integer), every cap in [1, max_new_tokens]; off: every row may use
    max_new_tokens."""
    params = SamplingParams(max_new_tokens=128, eos_id=-1, length_median=12, length_sigma=1.0)
    n = 40_000
    caps = length_caps(row_keys(3, n), params)
    assert caps.dtype == torch.long and int(caps.min()) >= 1 and int(caps.max()) == 128
    assert float(caps.double().median()) == 12.0
    for k in (1, 3, 6, 12, 20, 40, 80, 127):
        z = (math.log(k + 0.5) - math.log(12)) / 1.0
        want = 0.5 * (1 + math.erf(z / math.sqrt(2)))
        assert float((caps <= k).double().mean()) == pytest.approx(want, abs=0.01), k
    # the tail beyond the clamp lands on max_new_tokens: P(12 e^z >= 127.5)
    tail = 0.5 * math.erfc(math.log(127.5 / 12) / math.sqrt(2))
    assert float((caps == 128).double().mean()) == pytest.approx(tail, abs=0.003)
    # a row's cap depends on its key alone, not on the batch it is drawn with
    keys = row_keys(3, 50)
    assert length_caps(keys[17:30], params).tolist() == caps[17:30].tolist()
    off = SamplingParams(max_new_tokens=9, eos_id=-1)
    assert length_caps(keys, off).tolist() == [9] * 50


PATHS = {  # name: engine keywords (chunk_size in prompts)
    "continuous_all": {},
    "continuous_slots": {"chunk_size": 1},
    "lockstep": {"chunk_size": 2, "continuous": False},
    "recompute": {"chunk_size": 3, "kv_cache": False},
}


def test_rows_stop_at_their_caps_on_every_path(model):
    """With caps on, each row is the uncapped sample cut at its cap (or at its EOS, when
    that comes first); a row is truncated only when it reached max_new_tokens without EOS;
    continuous batching (all rows, or slots refilled), lockstep and recompute agree."""
    seed, max_new = 4, 12
    free_params = SamplingParams(max_new_tokens=max_new, eos_id=-1, top_k=20)
    free = MegatronRolloutEngine(model, free_params).generate(prompts_of(LENGTHS), GROUP, 0, seed)
    # an EOS that some rows sample mid-way: the most frequent token after the first position
    counts: dict[int, int] = {}
    for s in free:
        for t in s.response_ids[1:]:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: counts[t])
    params = SamplingParams(
        max_new_tokens=max_new, eos_id=eos, top_k=20, length_median=4, length_sigma=1.0
    )
    caps = length_caps(row_keys(seed, len(free)), params).tolist()
    assert min(caps) < max_new and max_new in caps  # short rows and a full-length one
    want, want_trunc = [], []
    for s, cap in zip(free, caps, strict=True):
        ids = s.response_ids[:cap]
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
        want.append(ids)
        want_trunc.append(eos not in ids and len(ids) == max_new)
    assert any(eos in ids and len(ids) < cap for ids, cap in zip(want, caps, strict=True))
    assert any(want_trunc) and not all(want_trunc)
    for name, kwargs in PATHS.items():
        out = MegatronRolloutEngine(model, params, **kwargs).generate(
            prompts_of(LENGTHS), GROUP, 0, seed
        )
        assert [s.response_ids for s in out] == want, name
        assert [s.truncated for s in out] == want_trunc, name
        for s, f in zip(out, free, strict=True):
            n = len(s.response_ids)
            assert s.behaviour_logps == pytest.approx(f.behaviour_logps[:n], abs=1e-4), name


def _total_tokens(samples) -> int:
    return sum(len(s.response_ids) for s in samples)


@pytest.mark.parametrize("continuous", [True, False])
def test_occupancy_of_one_batch_decoded_at_once(model, continuous):
    """Equal prompts, every row in one decoding batch: a step per token of the longest row,
    each step over all rows, busy slot-steps = the tokens generated."""
    params = SamplingParams(max_new_tokens=16, eos_id=-1, top_k=20, length_median=4)
    engine = MegatronRolloutEngine(model, params, continuous=continuous)
    out = engine.generate(prompts_of([6] * 4), GROUP, 0, seed=1)
    lengths = [len(s.response_ids) for s in out]
    stats = engine.decode_stats
    assert stats.steps == max(lengths)
    assert stats.busy_slot_steps == sum(lengths)
    assert stats.slot_steps == max(lengths) * len(out)
    assert stats.occupancy == pytest.approx(sum(lengths) / (max(lengths) * len(out)))
    assert stats.occupancy < 0.8  # the long tail leaves the batch mostly idle


def test_occupancy_counts_slots_and_lockstep_steps(model):
    """Continuous batching over 2 slots: every sampled token fills one busy slot-step, each
    step counts both slots, and the refilled slots keep the occupancy above one batch's.
    Lockstep chunks of unequal prompts: a chunk runs until its last row ends (prompt positions
    past the shortest prompt included). The stats add up over generate() calls."""
    params = SamplingParams(max_new_tokens=16, eos_id=-1, top_k=20, length_median=4)
    prompts = prompts_of(LENGTHS)
    slots = MegatronRolloutEngine(model, params, chunk_size=1)  # 1 prompt x 2 = 2 slots
    out = slots.generate(prompts, GROUP, 0, seed=2)
    s = slots.decode_stats
    assert s.busy_slot_steps == _total_tokens(out) and s.slot_steps == 2 * s.steps
    assert s.steps >= math.ceil(_total_tokens(out) / 2)
    lock = MegatronRolloutEngine(model, params, chunk_size=2, continuous=False)
    want_steps, want_slot_steps, total = 0, 0, 0
    for seed in (2, 3):
        out = lock.generate(prompts, GROUP, 0, seed=seed)
        total += _total_tokens(out)
        for start in range(0, len(out), 2 * GROUP):  # chunks of 2 prompts: 4, 4, 2 rows
            chunk = out[start : start + 2 * GROUP]
            p_min = min(len(r.prompt.prompt_ids) for r in chunk)
            steps = max(len(r.prompt.prompt_ids) - p_min + len(r.response_ids) for r in chunk)
            want_steps += steps
            want_slot_steps += steps * len(chunk)
    stats = lock.decode_stats
    assert (stats.steps, stats.busy_slot_steps) == (want_steps, total)
    assert stats.slot_steps == want_slot_steps


def test_training_rollouts_take_the_caps_and_evaluation_does_not(model):
    """debug.response_length_median reaches the training run's engine; the evaluation's engine
    (same config) samples the policy's own lengths."""
    from rlbatch.config.schema import RunConfig
    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.eval.runner import _engine
    from rlbatch.rollout.generation import build_engine

    cfg = RunConfig()
    cfg.debug.response_length_median, cfg.debug.response_length_sigma = 5, 0.5
    tokenizer = build_tokenizer(cfg.model)
    train = build_engine(cfg, [model], tokenizer).params
    assert (train.length_median, train.length_sigma) == (5, 0.5)
    assert _engine(cfg, [model], tokenizer)[0].params.length_median == 0
