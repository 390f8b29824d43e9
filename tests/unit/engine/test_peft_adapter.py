"""adapter_config.json of a LoRA export as PEFT reads it: peft's own LoraConfig loads the file
and its scale lora_alpha / r is rlbatch's alpha / rank."""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig as PeftLoraConfig

from rlbatch.config.lora import PROJECTIONS, LoraConfig
from rlbatch.engine.lora import lora_scale
from rlbatch.engine.peft_adapter import ADAPTER_CONFIG, peft_adapter_config


@pytest.mark.parametrize(
    ("lora", "modules"),
    [
        (LoraConfig(rank=16), set(PROJECTIONS)),  # alpha null = rank, all-linear spelled out
        (LoraConfig(rank=8, alpha=4.0, dropout=0.1, target_modules=["v_proj", "q_proj"]),
         {"q_proj", "v_proj"}),
        (LoraConfig(rank=4, alpha=2.5, target_modules=["down_proj"]), {"down_proj"}),
    ],
)  # fmt: skip
def test_peft_reads_the_adapter_config(tmp_path, lora, modules):
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(peft_adapter_config(lora, "some/base")))
    theirs = PeftLoraConfig.from_pretrained(str(tmp_path))
    assert theirs.peft_type.value == "LORA" and theirs.task_type == "CAUSAL_LM"
    assert theirs.r == lora.rank and theirs.lora_dropout == lora.dropout
    assert theirs.lora_alpha / theirs.r == pytest.approx(lora_scale(lora))
    assert set(theirs.target_modules) == modules
    assert theirs.base_model_name_or_path == "some/base"
    assert not theirs.use_rslora and not theirs.use_dora and theirs.bias == "none"
