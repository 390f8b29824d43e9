"""rollout.backend=megatron_dynamic (megatron-core's DynamicInferenceEngine) on a GPU: greedy
generation equals the built-in engine's on the same weights."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dynamic_engine_greedy_equals_builtin():
    from rlbatch.engine.dynamic_inference import flash_attention_problem

    if (problem := flash_attention_problem()) is not None:
        pytest.skip(f"rollout.backend=megatron_dynamic needs flash-attention: {problem}")
    from rlbatch.config.schema import RunConfig
    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model
    from rlbatch.grpo.types import Prompt
    from rlbatch.rollout.engines.builtin import build_rollout_engine

    cfg = RunConfig()
    cfg.model.init_method_std = 0.3  # peaked logits: greedy far from ties
    cfg.rollout.top_k, cfg.rollout.max_new_tokens = 1, 12
    if not parallel.is_initialized():
        parallel.initialize(cfg)
    model = build_model(cfg, wrap_ddp=False)
    g = torch.Generator().manual_seed(0)
    prompts = [
        Prompt(
            index=i, prompt_ids=tuple(torch.randint(0, 256, (n,), generator=g).tolist()), answer=""
        )  # fmt: skip
        for i, n in enumerate([5, 9, 3, 7])
    ]
    builtin = build_rollout_engine(cfg, model, eos_id=-1, pad_id=256).generate(prompts, 2, 0, 1)
    cfg.rollout.backend = "megatron_dynamic"
    dynamic = build_rollout_engine(cfg, model, eos_id=-1, pad_id=256).generate(prompts, 2, 0, 1)
    assert [s.response_ids for s in dynamic] == [s.response_ids for s in builtin]
    for a, b in zip(dynamic, builtin, strict=True):
        assert a.behaviour_logps == pytest.approx(b.behaviour_logps, abs=1e-2)
