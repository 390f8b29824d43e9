"""Generation on a real megatron-core GPTModel (tiny Qwen2 shape) against a plain reference
loop that recomputes full forwards for one prompt at a time."""

import math

import pytest
import torch

from rlbatch.grpo.types import Prompt
from rlbatch.rollout.engines.builtin import MegatronRolloutEngine, SamplingParams, as_rollout_fn

VOCAB = 264


@pytest.fixture(scope="module")
def model():
    """The tiny Qwen2 policy built by the engine (pp=1), init std 0.3 so that logits are
    peaked and greedy choices are far from ties."""
    from rlbatch.config.schema import RunConfig
    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model

    cfg = RunConfig()
    cfg.model.init_method_std = 0.3
    parallel.initialize(cfg)
    (chunk,) = build_model(cfg, wrap_ddp=False)
    assert cfg.model.vocab_size == VOCAB
    return chunk


def full_logits(model, ids):
    """Reference: one sequence, full causal forward, float64 log-softmax per position."""
    t = torch.tensor([ids])
    s = t.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        model.eval()
        out = model(t, torch.arange(s)[None], mask)  # [1, S, V]
    return out[0].double()


def reference_greedy(model, prompt, max_new, eos):
    ids = list(prompt)
    for _ in range(max_new):
        nxt = int(full_logits(model, ids)[-1].argmax())
        ids.append(nxt)
        if nxt == eos:
            break
    return ids[len(prompt) :]


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Prompt(
            index=i, prompt_ids=tuple(torch.randint(0, 256, (n,), generator=g).tolist()), answer=""
        )
        for i, n in enumerate(lengths)
    ]


LENGTHS = [5, 9, 3, 7]


@pytest.mark.parametrize("kv_cache", [True, False])
def test_greedy_equals_full_recompute_reference(model, kv_cache):
    params = SamplingParams(max_new_tokens=10, eos_id=-1, top_k=1)
    prompts = prompts_of(LENGTHS)
    out = MegatronRolloutEngine(model, params, kv_cache=kv_cache).generate(prompts, 2, 3, seed=1)
    assert len(out) == 8
    for k, s in enumerate(out):
        assert s.prompt == prompts[k // 2] and s.group_id == k // 2 and s.policy_version == 3
        assert s.response_ids == reference_greedy(model, s.prompt.prompt_ids, 10, -1)
        assert s.truncated


@pytest.mark.parametrize("kv_cache", [True, False])
def test_every_eos_id_of_the_set_stops_a_sequence(model, kv_cache):
    """extra_eos_ids (a chat model's end-of-turn token beside its EOS): a row ends at the first
    token of the whole set, not truncated; the rows are the free greedy rows cut there."""
    free_params = SamplingParams(max_new_tokens=10, eos_id=-1, top_k=1)
    prompts = prompts_of(LENGTHS)
    free = MegatronRolloutEngine(model, free_params, kv_cache=kv_cache).generate(prompts, 1, 0, 0)
    ends = (free[0].response_ids[3], free[1].response_ids[2])
    params = SamplingParams(max_new_tokens=10, eos_id=-1, top_k=1, extra_eos_ids=ends)
    out = MegatronRolloutEngine(model, params, kv_cache=kv_cache).generate(prompts, 1, 0, seed=0)
    for f, s in zip(free, out, strict=True):
        cut = next((n for n, t in enumerate(f.response_ids) if t in ends), None)
        assert s.response_ids == (f.response_ids if cut is None else f.response_ids[: cut + 1])
        assert s.truncated == (cut is None)
    assert not out[0].truncated and not out[1].truncated


def test_eos_stops_a_sequence(model):
    params = SamplingParams(max_new_tokens=10, eos_id=-1, top_k=1)
    prompts = prompts_of(LENGTHS)
    free = MegatronRolloutEngine(model, params).generate(prompts, 1, 0, seed=0)
    # choose as EOS a token that row 0 emits greedily at step 3 and not before
    eos = free[0].response_ids[3]
    assert eos not in free[0].response_ids[:3]
    params = SamplingParams(max_new_tokens=10, eos_id=eos, top_k=1)
    out = MegatronRolloutEngine(model, params).generate(prompts, 1, 0, seed=0)
    assert out[0].response_ids == free[0].response_ids[:4] and not out[0].truncated
    for s in out:
        assert s.response_ids == reference_greedy(model, s.prompt.prompt_ids, 10, eos)
        assert s.truncated == (eos not in s.response_ids)
        assert len(s.behaviour_logps) == len(s.response_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logps_equal_full_forward(model, temperature):
    params = SamplingParams(max_new_tokens=8, eos_id=-1, temperature=temperature, top_p=0.9)
    out = MegatronRolloutEngine(model, params).generate(prompts_of(LENGTHS), 2, 0, seed=5)
    for s in out:
        logits = full_logits(model, s.input_ids) / temperature
        logp = torch.log_softmax(logits, dim=-1)
        n = len(s.prompt.prompt_ids)
        want = [float(logp[n - 1 + j, tok]) for j, tok in enumerate(s.response_ids)]
        assert s.behaviour_logps == pytest.approx(want, abs=1e-4)


def test_same_seed_same_samples_and_paths_agree(model):
    params = SamplingParams(max_new_tokens=8, eos_id=-1, temperature=1.0, top_k=20)
    prompts = prompts_of(LENGTHS)
    a = MegatronRolloutEngine(model, params, kv_cache=True).generate(prompts, 2, 0, seed=11)
    b = MegatronRolloutEngine(model, params, kv_cache=True).generate(prompts, 2, 0, seed=11)
    c = MegatronRolloutEngine(model, params, kv_cache=False).generate(prompts, 2, 0, seed=11)
    d = MegatronRolloutEngine(model, params, kv_cache=True).generate(prompts, 2, 0, seed=12)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.response_ids for s in a] == [s.response_ids for s in c]
    assert [s.response_ids for s in a] != [s.response_ids for s in d]


def test_top_k_samples_stay_in_the_top_k(model):
    params = SamplingParams(max_new_tokens=6, eos_id=-1, temperature=2.0, top_k=3)
    out = MegatronRolloutEngine(model, params).generate(prompts_of(LENGTHS), 4, 0, seed=2)
    for s in out:
        logits = full_logits(model, s.input_ids)
        n = len(s.prompt.prompt_ids)
        for j, tok in enumerate(s.response_ids):
            assert tok in torch.topk(logits[n - 1 + j], 3).indices.tolist()


def test_chunked_by_rollout_micro_size(model):
    params = SamplingParams(max_new_tokens=4, eos_id=-1, top_k=1)
    engine = MegatronRolloutEngine(model, params, chunk_size=3)
    out = engine.generate(prompts_of([4, 5, 6, 7, 8]), 2, 0, seed=0)
    assert engine.calls == [6, 4] and len(out) == 10
    rows = as_rollout_fn(engine, policy_version=7)(prompts_of([4, 5]), 0)
    assert [s.policy_version for s in rows] == [7, 7] and engine.calls[-1] == 2


def test_factory_reads_the_rollout_config(model):
    from rlbatch.config.schema import RunConfig
    from rlbatch.rollout.engines.builtin import build_rollout_engine

    cfg = RunConfig()
    cfg.rollout.micro_batch_size, cfg.rollout.top_k, cfg.rollout.kv_cache = 2, 1, False
    engine = build_rollout_engine(cfg, [model], eos_id=258, pad_id=256)
    assert (engine.chunk_size, engine.kv_cache, engine.params.top_k) == (2, False, 1)
    assert (
        build_rollout_engine(cfg, [model], eos_id=258, pad_id=256, chunked=False).chunk_size is None
    )
    cfg.rollout.temperature, cfg.rollout.top_p = 0.0, 1.5
    with pytest.raises(ValueError) as err:
        build_rollout_engine(cfg, [model], eos_id=258, pad_id=256)
    assert "rollout.temperature=0.0" in str(err.value) and "rollout.top_p=1.5" in str(err.value)


def test_filter_logits_against_a_float64_reference():
    from rlbatch.rollout.engines.builtin import filter_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g, dtype=torch.float64) * 3
    for top_k, top_p in [(0, 0.5), (0, 0.9), (5, 1.0), (5, 0.3), (1, 1.0), (0, 1.0)]:
        kept = torch.isfinite(filter_logits(logits, top_k, top_p))
        for row, k_row in zip(logits.tolist(), kept.tolist(), strict=True):
            order = sorted(range(50), key=lambda i: -row[i])
            if top_k:
                order = order[:top_k]
            z = sum(math.exp(row[i]) for i in order)  # top-p renormalizes after top-k (HF)
            want, mass = set(), 0.0
            for i in order:  # smallest prefix of the sorted tokens whose mass reaches top_p
                if mass >= top_p:
                    break
                want.add(i)
                mass += math.exp(row[i]) / z
            assert {i for i, k in enumerate(k_row) if k} == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only error")
def test_dynamic_backend_is_a_config_error_without_cuda(model):
    from rlbatch.config.schema import RunConfig
    from rlbatch.rollout.engines.builtin import build_rollout_engine

    cfg = RunConfig()
    cfg.rollout.backend = "megatron_dynamic"
    with pytest.raises(ValueError) as err:
        build_rollout_engine(cfg, [model], eos_id=258, pad_id=256)
    assert "rollout.backend=megatron_dynamic" in str(err.value)
    assert "rollout.backend=megatron" in str(err.value).split("set ")[-1]
