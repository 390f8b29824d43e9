"""Generation against independent references: transformers' Qwen2 ``generate`` (greedy) on the
same checkpoint, the megatron forward (lockstep path), and a float64 softmax for the sampler.
Continuous batching (rows leave, new rows take their slots) gives the same samples as decoding
every row at once."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rlbatch.grpo.types import Prompt  # noqa: E402
from rlbatch.rollout.engines.builtin import (  # noqa: E402
    MegatronRolloutEngine,
    SamplingParams,
    row_keys,
    sample_tokens,
)

VOCAB = 96
LENGTHS = [7, 16, 3, 12, 5]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """transformers' Qwen2 with random weights (peaked logits, non-trivial norms and biases),
    saved and loaded into the megatron policy."""
    from dataclasses import replace

    from rlbatch.config.schema import ModelConfig, RunConfig
    from rlbatch.engine import hf, parallel
    from rlbatch.engine.model import build_model

    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        initializer_range=0.3,
        attn_implementation="eager",
    )
    torch.manual_seed(1)
    ref = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen2")
    ref.save_pretrained(path, safe_serialization=True)
    cfg = RunConfig()
    if not parallel.is_initialized():
        parallel.initialize(cfg)
    cfg.model, _ = hf.resolve_model_config(replace(ModelConfig(), hf_path=str(path)))
    chunks = build_model(cfg, wrap_ddp=False)
    hf.load_hf_into(chunks, path)
    return ref, chunks


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Prompt(
            index=i,
            prompt_ids=tuple(torch.randint(2, VOCAB, (n,), generator=g).tolist()),
            answer="",
        )  # fmt: skip
        for i, n in enumerate(lengths)
    ]


def hf_greedy(ref, prompt, max_new):
    """transformers' greedy generate for one prompt: tokens and log_softmax of its logits."""
    out = ref.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logps = [
        float(torch.log_softmax(lg[0].double(), -1)[t])
        for lg, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logps


@pytest.mark.parametrize("continuous", [True, False])
def test_greedy_equals_transformers_generate(models, continuous):
    ref, chunks = models
    params = SamplingParams(max_new_tokens=12, eos_id=-1, top_k=1)
    engine = MegatronRolloutEngine(chunks, params, chunk_size=2, continuous=continuous)
    out = engine.generate(prompts_of(LENGTHS), 1, 0, seed=0)
    for s in out:
        tokens, logps = hf_greedy(ref, list(s.prompt.prompt_ids), 12)
        assert s.response_ids == tokens
        assert s.behaviour_logps == pytest.approx(logps, abs=1e-4)


def test_long_tailed_prompts_decode_their_short_rows_apart_and_equal_transformers(models):
    """One long prompt among short ones: decode attends over the long row and the short rows
    separately (each range up to its own longest cache), and greedy decoding still equals
    transformers' generate token for token."""
    from rlbatch.engine.generation import attention_parts

    lengths = [3, 5, 4, 90, 3, 6, 2]
    assert len(attention_parts([90] + [6] * 6)) == 2  # what decode sees: longest prompt first
    ref, chunks = models
    params = SamplingParams(max_new_tokens=10, eos_id=-1, top_k=1)
    out = MegatronRolloutEngine(chunks, params).generate(prompts_of(lengths, seed=3), 1, 0, 0)
    for s in out:
        tokens, logps = hf_greedy(ref, list(s.prompt.prompt_ids), 10)
        assert s.response_ids == tokens
        assert s.behaviour_logps == pytest.approx(logps, abs=1e-4)


def test_attention_parts_split_only_when_it_saves_reading():
    from rlbatch.engine.generation import attention_parts

    assert attention_parts([40, 41, 39, 40]) == [(0, 4, 41)]  # alike: one range
    assert attention_parts([600, 610, 8, 9, 7, 12]) == [(0, 2, 610), (2, 6, 12)]
    assert attention_parts([8, 600, 9]) == [(0, 1, 8), (1, 3, 600)]  # any order stays exact
    assert attention_parts([17]) == [(0, 1, 17)]


def test_continuous_batching_matches_all_rows_at_once(models):
    """Rows end at different lengths (an EOS that sampling meets) and new rows refill their
    slots: every row's sample is the one it gets when all rows decode together, or through
    megatron's forward in lockstep."""
    _, chunks = models
    params = SamplingParams(max_new_tokens=16, eos_id=5, temperature=1.5, top_p=0.95)
    prompts = prompts_of(LENGTHS)
    small = MegatronRolloutEngine(chunks, params, chunk_size=1)
    a = small.generate(prompts, 3, 0, seed=4)
    b = MegatronRolloutEngine(chunks, params).generate(prompts, 3, 0, seed=4)
    c = MegatronRolloutEngine(chunks, params, continuous=False).generate(prompts, 3, 0, seed=4)
    lengths = {len(s.response_ids) for s in a}
    assert len(lengths) > 1 and any(not s.truncated for s in a)  # rows left early
    assert len(small.calls) > len(prompts)  # slots were refilled as rows ended
    assert max(small.calls) <= 3
    for x, y, z in zip(a, b, c, strict=True):
        assert x.response_ids == y.response_ids == z.response_ids
        assert x.behaviour_logps == pytest.approx(y.behaviour_logps, abs=1e-5)
        assert x.behaviour_logps == pytest.approx(z.behaviour_logps, abs=1e-4)


def test_sampler_draws_from_the_tempered_filtered_softmax():
    """Frequencies over many keyed draws match a float64 softmax (top-k applied)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 1.5]])
    params = SamplingParams(max_new_tokens=1, eos_id=-1, temperature=0.8, top_k=4)
    n = 40000
    keys = row_keys(3, n)
    tokens, logps = sample_tokens(
        logits.expand(n, -1), params, keys, torch.zeros(n, dtype=torch.long)
    )
    scaled = logits[0].double() / 0.8
    kept = torch.topk(scaled, 4).indices
    probs = torch.zeros(6, dtype=torch.float64)
    probs[kept] = torch.softmax(scaled[kept], -1)
    freq = torch.bincount(tokens, minlength=6).double() / n
    assert torch.allclose(freq, probs, atol=0.01)
    full = torch.log_softmax(scaled, -1)
    assert torch.allclose(logps.double(), full[tokens], atol=1e-5)


def test_keyed_uniforms_carry_53_random_bits():
    """Each uniform is an integer of 53 bits over 2**53: none falls on a coarser grid (a float32
    product would keep 24 bits and repeat values), and 200k draws do not repeat."""
    from rlbatch.rollout.sampling import keyed_uniform

    keys = torch.arange(2000, dtype=torch.long).repeat_interleave(100)
    steps = torch.arange(100, dtype=torch.long).repeat(2000)
    u = keyed_uniform(keys * 7919 + 11, steps)
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    scaled = u * 2.0**53
    assert torch.equal(scaled, scaled.floor())  # on the 2**-53 grid
    assert len(torch.unique(u)) == len(u)
    assert float((scaled % 2**29 != 0).double().mean()) > 0.99  # low bits are used


def test_sampler_is_the_inverse_cdf_of_each_rows_keyed_uniform():
    """Each row's token is the first index where a float64 running sum of its tempered,
    filtered softmax exceeds the row's keyed uniform, whatever other rows share the batch."""
    from rlbatch.rollout.sampling import keyed_uniform, uniform_table

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 50, generator=gen) * 2
    keys, steps = row_keys(7, 32), torch.arange(32, dtype=torch.long) % 5
    for params in (
        SamplingParams(max_new_tokens=1, eos_id=-1, temperature=0.7),
        SamplingParams(max_new_tokens=1, eos_id=-1, temperature=1.3, top_k=10, top_p=0.8),
    ):
        tokens, logps = sample_tokens(logits, params, keys, steps)
        u = keyed_uniform(keys, steps)
        assert bool(((u >= 0) & (u < 1)).all()) and len(set(u.tolist())) == 32
        for r in range(32):
            scaled = logits[r].double() / params.temperature
            allowed = torch.ones(50, dtype=torch.bool)
            if params.top_k:
                allowed[torch.argsort(scaled, descending=True)[params.top_k :]] = False
            if params.top_p < 1:
                order = torch.argsort(torch.where(allowed, scaled, -torch.inf), descending=True)
                p = torch.softmax(torch.where(allowed, scaled, -torch.inf)[order], -1)
                allowed[order[(torch.cumsum(p, -1) - p) >= params.top_p]] = False
            probs = torch.softmax(torch.where(allowed, scaled, -torch.inf), -1)
            expected = int(torch.nonzero(torch.cumsum(probs, -1) > u[r])[0, 0])
            assert int(tokens[r]) == expected
            assert float(logps[r]) == pytest.approx(
                float(torch.log_softmax(scaled, -1)[expected]), abs=1e-5
            )
        # a row alone, or among other rows in another order, draws the same token
        perm = torch.randperm(32, generator=gen)[:9]
        alone, _ = sample_tokens(logits[perm], params, keys[perm], steps[perm])
        assert torch.equal(alone, tokens[perm])
        # the decoding loop's precomputed draws: the same uniforms, so the same tokens
        table = uniform_table(keys, 5)
        assert table.shape == (32, 5)
        drawn = table[torch.arange(32), steps]
        assert torch.equal(drawn, u)
        assert torch.equal(sample_tokens(logits, params, keys, steps, drawn)[0], tokens)
