"""megatron-core 0.16.1 on a CUDA-less machine: the CPU compatibility layer, in one module.

megatron-core hard-codes CUDA in a handful of places (docs/engine.md lists them). When
CUDA is unavailable, :func:`install` replaces the module-level name ``torch`` **inside those
megatron modules only** with a proxy that forwards everything to torch except:

- ``torch.cuda.current_device()`` -> ``torch.device("cpu")``; ``torch.cuda.synchronize()`` -> no-op;
- tensor factories (``zeros``, ``empty``, ``tensor``, ...) whose ``device`` is ``"cuda"``,
  ``"cuda:N"``, an int or a CUDA ``torch.device`` -> CPU;
- in ``tensor_parallel.random``: the CUDA RNG state is the CPU generator's state (so the RNG
  tracker and activation recomputation restore the right state).

Plus three scoped replacements: a device-agnostic ``clip_grad_by_total_norm_fp32`` (megatron's
asserts ``torch.cuda.FloatTensor``), ``Tensor.cuda`` as identity only while
``LanguageModule.setup_embeddings_and_output_layer`` runs (tied embeddings with pp > 1), and
nothing else. torch itself is never modified: user code still gets "Torch not compiled with
CUDA enabled" from ``torch.cuda.current_device()``. On a CUDA machine :func:`install` is a no-op.

The layer patches internals by module name, so it is pinned to megatron-core 0.16.1.
"""

from __future__ import annotations

import functools
import importlib
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

SUPPORTED_MEGATRON_VERSION = "0.16.1"

PATCHED_MODULES = (
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.cross_entropy",
)
"""Megatron modules whose ``torch`` name is replaced by the proxy."""

_FACTORIES = frozenset(
    {
        "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn",
        "randint", "eye", "linspace", "zeros_like", "ones_like", "empty_like", "full_like",
    }
)  # fmt: skip

_CPU = torch.device("cpu")
_installed = False


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        kwargs.pop("pin_memory", None)  # pinned memory needs an accelerator
        return fn(*args, **kwargs)

    return factory


class _CudaProxy(types.SimpleNamespace):
    """``torch.cuda`` for the patched modules: device queries answer "cpu"."""

    def __init__(self, cpu_rng: bool) -> None:
        super().__init__()
        self._cpu_rng = cpu_rng

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    def get_rng_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state() if self._cpu_rng else torch.cuda.get_rng_state(*args, **kwargs)

    def set_rng_state(self, state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self._cpu_rng:
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, *args, **kwargs)

    def manual_seed(self, seed: int) -> None:
        if self._cpu_rng:
            torch.manual_seed(seed)
        else:
            torch.cuda.manual_seed(seed)


class TorchProxy(types.SimpleNamespace):
    """Stands for ``torch`` inside a patched megatron module."""

    def __init__(self, cpu_rng: bool = False) -> None:
        super().__init__()
        self.cuda = _CudaProxy(cpu_rng)
        self._factories: dict[str, Callable[..., Any]] = {}

    def __getattr__(self, name: str) -> Any:
        if name in _FACTORIES:
            wrapped = self._factories.get(name)
            if wrapped is None:
                wrapped = self._factories[name] = _cpu_factory(getattr(torch, name))
            return wrapped
        return getattr(torch, name)


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Device-agnostic replacement of megatron's clip (which asserts torch.cuda.FloatTensor)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _with_identity_cuda(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with ``Tensor.cuda`` as identity (only for the duration of the call)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original  # type: ignore[method-assign]

    wrapper.__rlbatch_cpu_compat__ = True  # type: ignore[attr-defined]
    return wrapper


def check_version() -> str:
    """The installed megatron-core version; a clear error when it is not the pinned one."""
    try:
        from megatron.core import package_info
    except ImportError as exc:  # pragma: no cover - dependency missing
        raise RuntimeError(
            f"rlbatch needs megatron-core=={SUPPORTED_MEGATRON_VERSION}: pip install "
            f"'megatron-core=={SUPPORTED_MEGATRON_VERSION}'"
        ) from exc
    version = package_info.__version__
    if version != SUPPORTED_MEGATRON_VERSION:
        raise RuntimeError(
            f"rlbatch's CPU layer (rlbatch.engine.cpu_compat) is written for megatron-core "
            f"{SUPPORTED_MEGATRON_VERSION}, found {version}: pip install "
            f"'megatron-core=={SUPPORTED_MEGATRON_VERSION}' (or run on a CUDA machine)"
        )
    return version


def needed() -> bool:
    """The layer is active only when CUDA is unavailable."""
    return not torch.cuda.is_available()


def is_installed() -> bool:
    return _installed


def install() -> bool:
    """Install the CPU layer (idempotent). Returns True when it is active, False on CUDA."""
    global _installed
    if _installed:
        return True
    if not needed():
        return False
    check_version()
    # megatron's import-time notices about the CUDA-only extras it cannot use here
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        module.torch = TorchProxy(cpu_rng=name.endswith("tensor_parallel.random"))  # type: ignore[attr-defined]

    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[attr-defined]
    random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[attr-defined]

    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(name)
        module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32  # type: ignore[attr-defined]

    lm = importlib.import_module("megatron.core.models.common.language_module.language_module")
    method = lm.LanguageModule.setup_embeddings_and_output_layer
    if not getattr(method, "__rlbatch_cpu_compat__", False):
        lm.LanguageModule.setup_embeddings_and_output_layer = _with_identity_cuda(method)
    _installed = True
    return True
