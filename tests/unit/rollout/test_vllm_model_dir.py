"""The model directory vLLM starts from (rollout.backend=vllm) carries the run's end ids: vLLM
stops at the eos_token_id of the directory's generation config, and transformers fills a
missing one from the architecture's defaults (LlamaConfig: EOS 2, BOS 1; '#' in Llama-3's
vocabulary), so a Llama policy stopped at id 2 before. Read back with transformers, the
library vLLM reads it with."""

from __future__ import annotations

import pytest

from rlbatch.config.schema import Architecture, ModelConfig


@pytest.mark.parametrize("arch", list(Architecture))
@pytest.mark.parametrize("eos_ids", [(258,), (258, 35)])
def test_the_engines_model_dir_carries_the_runs_eos_and_bos(arch, eos_ids):
    from transformers import AutoConfig, GenerationConfig

    from rlbatch.rollout.engines.vllm_engine import SpecialIds, write_model_dir

    model = ModelConfig(
        architecture=arch,
        add_qkv_bias=arch in (Architecture.qwen2, Architecture.qwen2_moe),
        num_moe_experts=4 if "moe" in arch.value else None,  # MoE needs experts
    )
    path = write_model_dir(model, "float32", SpecialIds(eos_ids, 257))
    expected = eos_ids[0] if len(eos_ids) == 1 else list(eos_ids)
    config = AutoConfig.from_pretrained(path)
    assert (config.eos_token_id, config.bos_token_id) == (expected, 257)
    generation = GenerationConfig.from_pretrained(path)
    assert (generation.eos_token_id, generation.bos_token_id) == (expected, 257)
