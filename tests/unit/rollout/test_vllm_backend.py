"""rollout.backend=vllm against rlbatch's own forward, on the real vLLM CPU engine (the ``vllm``
extra; skipped without it, run by CI, which installs it).

One engine per module (vLLM's import and first-request compilation take ~30 s here), in this
process beside a megatron-core tiny Qwen2 policy with heads of width 32 (the CPU build's
smallest). The reference is the policy's own full causal forward, float64 log-softmax of
logits / T (tests/model_reference.py), never vLLM itself.
"""

from __future__ import annotations

import pytest
import torch

from model_reference import full_logps
from rlbatch.grpo.types import Prompt

pytestmark = [pytest.mark.optional_extra, pytest.mark.slow]  # one vLLM start: ~70 s

TEMPERATURE = 0.7
PROMPT_LEN = 70  # over two KV blocks of 32: the prefix cache holds whole blocks of it
ATOL = 5e-5  # float32 forwards (vLLM's and megatron's), compared in float64


@pytest.fixture(scope="module")
def setup():
    """(config, policy chunk, vLLM rollout engine), the engine started once for the module."""
    pytest.importorskip("vllm")
    from rlbatch.config.schema import RolloutBackend, RunConfig
    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model
    from rlbatch.grpo.rollout import build_rollout_engine

    cfg = RunConfig()
    cfg.model.num_attention_heads = 2
    cfg.model.num_query_groups = 2
    cfg.data.max_prompt_len = 80
    cfg.rollout.backend = RolloutBackend.vllm
    cfg.rollout.temperature = TEMPERATURE
    cfg.rollout.max_new_tokens = 12
    cfg.rollout.vllm.block_size = 32
    parallel.initialize(cfg)
    torch.manual_seed(0)
    (chunk,) = build_model(cfg, wrap_ddp=False)
    engine = build_rollout_engine(cfg, [chunk], eos_id=1, pad_id=0)
    return cfg, chunk, engine


def prompts_of(num: int, seed: int = 0) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 256, (num, PROMPT_LEN), generator=g).tolist()
    return [Prompt(index=i, prompt_ids=tuple(row), answer="") for i, row in enumerate(ids)]


def max_logp_error(chunk, samples) -> float:
    """Largest |behaviour logprob - the policy's own log_softmax(logits / T)| over every
    sampled token."""
    worst = 0.0
    for s in samples:
        ids = list(s.prompt.prompt_ids) + s.response_ids
        ref = full_logps_at(chunk, ids)
        start = len(s.prompt.prompt_ids) - 1
        for j, (tok, lp) in enumerate(zip(s.response_ids, s.behaviour_logps, strict=True)):
            worst = max(worst, abs(float(ref[start + j, tok]) - lp))
    return worst


def full_logps_at(chunk, ids):
    """float64 log_softmax(logits / T) of a full forward (the trainer's convention)."""
    logits = full_logps(chunk, ids)  # log-softmax at T = 1: logits up to a per-row constant
    return torch.log_softmax(logits / TEMPERATURE, dim=-1)


def train_steps(chunk, num_steps: int) -> None:
    """Real optimizer steps on the policy (Adam on a next-token loss over random sequences)."""
    chunk.train()
    optimizer = torch.optim.Adam(chunk.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(num_steps):
        tokens = torch.randint(2, 256, (4, 16), generator=g)
        mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None]
        logits = chunk(tokens, torch.arange(16)[None].expand(4, -1), mask)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_logps_equal_the_trainers_forward_before_and_after_training(setup):
    """The engine starts from the config alone and takes the weights before its first
    generation; after 3 optimizer steps (a new policy version) it takes them again, the tied
    output layer and the prefix cache of the same prompts included: the behaviour logprobs of
    every sampled token equal the policy's own forward at T = 0.7 both times."""
    _, chunk, engine = setup
    prompts = prompts_of(3)
    before = engine.generate(prompts, 2, policy_version=0, seed=11)
    assert max_logp_error(chunk, before) < ATOL
    train_steps(chunk, 3)
    after = engine.generate(prompts, 2, policy_version=1, seed=11)
    assert max_logp_error(chunk, after) < ATOL
    # the steps moved the policy: stale weights (or a stale prefix cache) would be far off
    assert max_logp_error(chunk, before) > 100 * ATOL
    figures = engine.take_figures()
    assert figures["rollout/weight_syncs"] == 2.0 and figures["rollout/weight_sync_seconds"] > 0
    assert engine.take_figures() == {}  # counters restart every round


def test_samples_are_groups_of_the_built_in_engines_shape(setup):
    """G rows per prompt, contiguous, with the version and one logprob per token; a row that
    reaches max_new_tokens without EOS is truncated."""
    cfg, _, engine = setup
    prompts = prompts_of(2, seed=3)
    samples = engine.generate(prompts, 3, policy_version=5, seed=2)
    assert [s.group_id for s in samples] == [0, 0, 0, 1, 1, 1]
    assert [s.prompt.index for s in samples] == [0, 0, 0, 1, 1, 1]
    for s in samples:
        assert s.policy_version == 5
        assert len(s.behaviour_logps) == len(s.response_ids) <= cfg.rollout.max_new_tokens
        assert s.truncated == (
            len(s.response_ids) == cfg.rollout.max_new_tokens and 1 not in s.response_ids
        )


def test_same_seed_same_samples_other_seed_other_samples(setup):
    _, _, engine = setup
    prompts = prompts_of(2, seed=4)
    first = engine.generate(prompts, 2, policy_version=5, seed=21)
    again = engine.generate(prompts, 2, policy_version=5, seed=21)
    other = engine.generate(prompts, 2, policy_version=5, seed=22)
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    assert [s.behaviour_logps for s in first] == [s.behaviour_logps for s in again]
    assert [s.response_ids for s in first] != [s.response_ids for s in other]
    # siblings of one prompt are different draws (their own seeds, not one shared)
    assert first[0].response_ids != first[1].response_ids


def test_eos_ends_a_row_and_is_kept(setup):
    """With the token a row sampled third declared EOS, the same seed stops the row there:
    EOS is the last response token, the row is not truncated, and the tokens before it are
    the same draws."""
    from rlbatch.rollout.protocol import SyncedRolloutEngine, TokenSampling

    _, _, engine = setup
    prompts = prompts_of(1, seed=5)
    (free,) = engine.generate(prompts, 1, policy_version=5, seed=8)
    eos = free.response_ids[2]
    stop_at = free.response_ids.index(eos)
    sampling = TokenSampling(engine.sampling.max_new_tokens, engine.sampling.temperature, eos)
    (ended,) = SyncedRolloutEngine(engine.backend, sampling).generate(prompts, 1, 5, seed=8)
    assert ended.response_ids == free.response_ids[: stop_at + 1]
    assert ended.response_ids[-1] == eos and not ended.truncated


def test_lora_adapters_reach_the_engine_merged(setup):
    """LoRA (last in the module: it adapts the shared policy chunk): adapters of rank 8 on every
    projection, trained a few steps (Adam over the chunk's parameters: only the adapters
    train), reach vLLM as merged weights with the next policy version; its behaviour logprobs
    equal the adapted policy's own forward, and are far from the base model's (the adapters
    switched off), so rollouts cannot keep sampling the base model unnoticed."""
    from dataclasses import replace

    from rlbatch.engine import lora

    cfg, chunk, engine = setup
    model_cfg = replace(cfg.model, lora=replace(cfg.model.lora, rank=8))
    assert lora.attach_adapters([chunk], model_cfg, seed=3) > 0
    train_steps(chunk, 3)
    prompts = prompts_of(2, seed=6)
    adapted = engine.generate(prompts, 2, policy_version=7, seed=12)
    assert max_logp_error(chunk, adapted) < ATOL
    with lora.adapters_disabled([chunk]):
        assert max_logp_error(chunk, adapted) > 100 * ATOL
