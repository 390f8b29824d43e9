"""The CPU layer patches megatron modules only: torch itself stays untouched."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

import importlib

import pytest
import torch
from engine_helpers import megatron_world  # noqa: F401

from rlbatch.engine import cpu_compat

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is a no-op on CUDA"),
]


def test_install_is_idempotent_and_pinned(megatron_world):
    assert cpu_compat.install() is True
    assert cpu_compat.install() is True
    assert cpu_compat.check_version() == cpu_compat.SUPPORTED_MEGATRON_VERSION


def test_torch_untouched_outside_patched_modules(megatron_world):
    cpu_compat.install()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2, device="cuda")
    assert not isinstance(torch, cpu_compat.TorchProxy)
    assert not getattr(torch.Tensor.cuda, "__rlbatch_cpu_compat__", False)
    with pytest.raises((AssertionError, RuntimeError)):
        torch.ones(1).cuda()
    unpatched = importlib.import_module("megatron.core.transformer.transformer_block")
    assert unpatched.torch is torch


def test_patched_modules_map_cuda_to_cpu(megatron_world):
    cpu_compat.install()
    for name in cpu_compat.PATCHED_MODULES:
        proxy = importlib.import_module(name).torch
        assert isinstance(proxy, cpu_compat.TorchProxy), name
    proxy = importlib.import_module("megatron.core.pipeline_parallel.schedules").torch
    assert proxy.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert proxy.empty(3, device=0).device.type == "cpu"
    assert proxy.cuda.current_device() == torch.device("cpu")
    assert proxy.cuda.synchronize() is None
    assert proxy.Tensor is torch.Tensor and proxy.float32 is torch.float32
