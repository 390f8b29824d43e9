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
LORA_RANK = 8


@pytest.fixture(scope="module")
def setup():
    """(config, policy chunk, vLLM rollout engine), the engine started once for the module, for
    a LoRA run of rank 8 (the config's; vLLM's LoRA on): the policy is built without adapters
    and takes them in the last test; until then the engine takes its whole weights."""
    pytest.importorskip("vllm")
    from dataclasses import replace

    from rlbatch.config.schema import RolloutBackend, RunConfig
    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model
    from rlbatch.rollout.engines.builtin import build_rollout_engine

    cfg = RunConfig()
    cfg.model.num_attention_heads = 2
    cfg.model.num_query_groups = 2
    cfg.data.max_prompt_len = 80
    cfg.rollout.backend = RolloutBackend.vllm
    cfg.rollout.temperature = TEMPERATURE
    cfg.rollout.max_new_tokens = 12
    cfg.rollout.vllm.block_size = 32
    cfg.rollout.vllm.sleep = True  # the CPU build has no sleep mode: recorded, frees nothing
    parallel.initialize(cfg)
    torch.manual_seed(0)
    (chunk,) = build_model(cfg, wrap_ddp=False)
    seed_process_generators(1234)
    before = process_rng_states()
    lora_run = replace(cfg, model=replace(cfg.model, lora=replace(cfg.model.lora, rank=LORA_RANK)))
    engine = build_rollout_engine(lora_run, [chunk], eos_id=1, pad_id=0)
    RNG_AROUND_START.extend([before, process_rng_states()])
    return lora_run, chunk, engine


RNG_AROUND_START: list[dict] = []
"""The process-wide generators' states just before and just after the engine started."""


def seed_process_generators(seed: int) -> None:
    """The trainer's process-wide generators at a seed of its own (not vLLM's 0)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed + 1)
    torch.manual_seed(seed + 2)


def process_rng_states() -> dict:
    """Python's, NumPy's and torch's process-wide generator states (and CUDA's when present)."""
    import random

    import numpy as np

    state = {
        "python": random.getstate(),
        "numpy": [v.tolist() if hasattr(v, "tolist") else v for v in np.random.get_state()],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def test_starting_the_engine_leaves_the_trainers_random_streams_as_they_were(setup):
    """vLLM seeds Python's, NumPy's and torch's process-wide generators (seed 0) while it
    starts; the trainer's streams (dropout, the RNG state a checkpoint saves) must be the ones
    it seeded: they are saved before the start and restored after it. A weight sync and a
    generation leave them alone too."""
    before, after = RNG_AROUND_START
    assert after == before
    _, _, engine = setup
    seed_process_generators(99)
    state = process_rng_states()
    engine.generate(prompts_of(2, seed=5), 2, policy_version=40, seed=3)  # sync + decode
    assert process_rng_states() == state
    engine.take_figures()  # the next test counts its own syncs


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


def test_sleep_after_a_round_and_wake_before_the_next_sync_and_decode(setup):
    """rollout.vllm.sleep: the loop's release after a round puts the engine to sleep (once);
    the next round wakes it before it takes the weights and decodes. The CPU build cannot free
    memory, so the order of the calls is what can be observed here; the samples are those of
    an engine that never slept."""
    from rlbatch.rollout.engines.vllm_engine import release_memory

    _, _, engine = setup
    running = engine.backend.running
    prompts = prompts_of(2, seed=6)
    awake = engine.generate(prompts, 2, policy_version=40, seed=5)
    running.events.clear()
    release_memory()
    release_memory()  # already asleep: nothing more
    slept = engine.generate(prompts, 2, policy_version=41, seed=5)  # a new version: a sync
    release_memory()
    assert list(running.events) == ["sleep", "wake", "sync", "decode", "sleep"]
    assert [s.response_ids for s in slept] == [s.response_ids for s in awake]
    assert [s.behaviour_logps for s in slept] == [s.behaviour_logps for s in awake]


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


def test_partial_rollout_segments_give_each_token_its_own_versions_logprob(setup):
    """The partial-rollout stream on vLLM in segments of 3 tokens over three policy versions
    (real optimizer steps between rounds): rows still decoding at a swap go on as new requests
    (prompt + their tokens so far) under the new weights, so some rows carry two versions, and
    every token's behaviour logprob is the policy's own forward under the weights of the
    version it records (a row continued on a stale cache would be off)."""
    from rlbatch.rollout.partial import PartialRolloutStream
    from rlbatch.rollout.sampling import SamplingParams
    from rlbatch.rollout.segments import SegmentEngine

    cfg, chunk, engine = setup
    prompts = [p.prompt_ids for p in prompts_of(8, seed=7)]

    def draw():  # the stream's q-th draw: two prompts, two groups
        q = len(stream.draws)
        return ((2 * q) % 8, (2 * q + 1) % 8), (2 * q, 2 * q + 1), 2 * q

    stream = PartialRolloutStream(
        draw, lambda index: prompts[index],
        SamplingParams(12, temperature=TEMPERATURE, eos_id=1, length_median=6, length_sigma=1.0),
        num_generations=2, groups_per_round=2, num_slots=4, lead=1, slack=0, seed=3, max_len=82,
    )  # fmt: skip
    segments = SegmentEngine(engine, 3)
    checked = mixed = 0
    for version in (10, 11, 12):
        segments.ensure_version(version)
        result = stream.run_round(version, segments.segments)
        groups = [*result.groups, *stream.groups.values()]
        rows = [(g.prompt_index, row) for g in groups for row in g.rows]
        for prompt_index, row in rows:
            prompt = prompts[prompt_index]
            ref = full_logps_at(chunk, [*prompt, *row.ids])
            for j, (tok, lp, v) in enumerate(zip(row.ids, row.logps, row.versions, strict=True)):
                if v == version:
                    assert abs(float(ref[len(prompt) - 1 + j, tok]) - lp) < ATOL
                    checked += 1
        mixed += sum(len(set(row.versions)) > 1 for _, row in rows)
        train_steps(chunk, 2)
    assert checked > 50 and mixed > 0


def test_evaluation_samples_with_its_own_settings_on_the_same_engine(setup):
    """Evaluation runs on the process's one engine with its own sampling per request:
    eval.temperature=0 is greedy (every token the policy's own argmax, so a prompt's samples
    are the same), eval.max_new_tokens caps the rows."""
    import dataclasses
    from types import SimpleNamespace

    from rlbatch.eval.runner import _engine

    cfg, chunk, engine = setup
    ev = dataclasses.replace(cfg.eval, temperature=0.0, max_new_tokens=5, num_samples=2)
    tokenizer = SimpleNamespace(eos_id=1, eos_ids=(1,), pad_id=0)
    evaluation, _ = _engine(dataclasses.replace(cfg, eval=ev), [chunk], tokenizer)
    assert evaluation.backend.running is engine.backend.running  # no second vLLM engine
    samples = evaluation.generate(prompts_of(2, seed=6), 2, policy_version=7, seed=3)
    for s in samples:
        assert len(s.response_ids) == 5 or s.response_ids[-1] == 1
        ref = full_logps(chunk, list(s.prompt.prompt_ids) + s.response_ids)  # float64
        start = len(s.prompt.prompt_ids) - 1
        greedy = [int(ref[start + j].argmax()) for j in range(len(s.response_ids))]
        assert s.response_ids == greedy
    assert samples[0].response_ids == samples[1].response_ids
    # the run's engine keeps training's sampling: same seed, same samples as before evaluation
    prompts = prompts_of(2, seed=4)
    before = engine.generate(prompts, 2, policy_version=7, seed=21)
    evaluation.generate(prompts, 2, policy_version=7, seed=21)
    after = engine.generate(prompts, 2, policy_version=7, seed=21)
    assert [s.response_ids for s in before] == [s.response_ids for s in after]
    assert before[0].response_ids != before[1].response_ids  # sampled, not greedy


def test_lora_adapters_reach_the_engine_as_vllm_lora(setup):
    """LoRA (last in the module: it adapts the shared policy chunk): adapters of rank 8 on every
    projection, trained a few steps (Adam over the chunk's parameters: only the adapters
    train), reach vLLM as a LoRA adapter of the next policy version (its base weights stay the
    frozen base); its behaviour logprobs equal the adapted policy's own forward, and are far
    from the base model's (the adapters switched off), so rollouts cannot keep sampling the
    base model unnoticed. A further update is a new adapter (new id: vLLM's adapter and prefix
    caches cannot serve the old one), and with the adapters switched off the engine samples
    the base model."""
    from dataclasses import replace

    from rlbatch.engine import lora

    cfg, chunk, engine = setup
    model_cfg = replace(cfg.model, lora=replace(cfg.model.lora, rank=LORA_RANK))
    assert lora.attach_adapters([chunk], model_cfg, seed=3) > 0
    train_steps(chunk, 3)
    # a version no earlier test of the module used: the engine must take the new weights
    prompts = prompts_of(2, seed=6)
    adapted = engine.generate(prompts, 2, policy_version=100, seed=12)
    assert max_logp_error(chunk, adapted) < ATOL
    with lora.adapters_disabled([chunk]):
        assert max_logp_error(chunk, adapted) > 100 * ATOL
    first = engine.backend.running.lora_request
    assert first is not None
    train_steps(chunk, 2)
    again = engine.generate(prompts, 2, policy_version=101, seed=12)
    assert engine.backend.running.lora_request.lora_int_id != first.lora_int_id
    assert max_logp_error(chunk, again) < ATOL
    with lora.adapters_disabled([chunk]):
        base = engine.generate(prompts, 2, policy_version=102, seed=12)
        assert engine.backend.running.lora_request is None
        assert max_logp_error(chunk, base) < ATOL
