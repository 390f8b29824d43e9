"""rollout.backend=megatron_dynamic says what it lacks before the engine is built: CUDA, and
flash-attention (megatron-core's dynamic batching asserts flash-attn >= 2.7.3 or FA3 in the
middle of the first decode step otherwise)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlbatch.engine import dynamic_inference


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None
    or importlib.util.find_spec("flash_attn_interface") is not None,
    reason="flash-attention is installed here",
)
@pytest.mark.cpu_only
def test_missing_flash_attention_is_named_with_the_fix():
    problem = dynamic_inference.flash_attention_problem()
    assert problem is not None and "flash-attn" in problem and "2.7.3" in problem


@pytest.mark.cpu_only
@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU path")
def test_cpu_machine_is_told_to_use_the_builtin_engine():
    with pytest.raises(ValueError, match="needs CUDA.*set rollout.backend=megatron"):
        dynamic_inference.check_available()
