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


def test_megatron_imports_without_torch_compile_in_a_fresh_process():
    """A worker's first megatron import leaves torch.compile as it was, megatron's fused
    functions plain (its jit_fuser disabled) and numerically the formula, never imports
    torch's compiler back end for them, and prints none of megatron's notices about Apex and
    Transformer Engine (a run's output is checked for warnings). wandb, which megatron would
    import for its own logging, is not imported (a second and a half of every worker's start),
    megatron holds no wandb, and the package still imports for the run's own wandb logger."""
    import subprocess
    import sys

    probe = """
import sys, torch
compile_ = torch.compile
from rlbatch.engine import cpu_compat
cpu_compat.install()
import megatron.core.jit as jit
from megatron.core.transformer.utils import gelu_impl
x = torch.linspace(-3, 3, 7, dtype=torch.float64)
want = 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))
print(torch.compile is compile_, jit.jit_fuser is jit.noop_decorator,
      type(gelu_impl).__name__, torch.equal(gelu_impl(x), want), "torch._inductor" in sys.modules)
import megatron.core.timers as timers
print("wandb" in sys.modules, timers.wandb is None)
import wandb
print(callable(wandb.init))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    compiled, imported, wandb = out.stdout.splitlines()
    assert compiled.split() == ["True", "True", "function", "True", "False"]
    assert imported.split() == ["False", "True"] and wandb == "True"
    assert "not installed" not in out.stderr  # megatron's CUDA-extras notices stay quiet
