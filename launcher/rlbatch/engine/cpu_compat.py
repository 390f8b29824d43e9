"""megatron-core 0.16.1 on a CUDA-less machine: the CPU compatibility layer, in one module.

megatron-core hard-codes CUDA in a handful of places (docs/engine.md lists them). When
CUDA is unavailable, :func:`install` replaces the module-level name ``torch`` **inside those
megatron modules only** with a proxy that forwards everything to torch except:

- ``torch.cuda.current_device()`` -> ``torch.device("cpu")``; ``torch.cuda.synchronize()`` -> no-op;
- tensor factories (``zeros``, ``empty``, ``tensor``, ...) whose ``device`` is ``"cuda"``,
  ``"cuda:N"``, an int or a CUDA ``torch.device`` -> CPU;
- in ``tensor_parallel.random``: the CUDA RNG state is the CPU generator's state (so the RNG
  tracker and activation recomputation restore the right state).

Plus scoped replacements: a device-agnostic ``clip_grad_by_total_norm_fp32`` (megatron's
asserts ``torch.cuda.FloatTensor``), ``Tensor.cuda`` as identity only while
``LanguageModule.setup_embeddings_and_output_layer`` runs (tied embeddings with pp > 1) and
while the DistributedOptimizer gathers its state for a checkpoint, and ``Tensor.type()``
naming CPU tensors as CUDA ones only while a DistributedOptimizer is constructed (it sorts
parameters by those names), a DistributedOptimizer state setter that tolerates torch AdamW's
per-parameter step on checkpoint load and a load_state_dict that gives each parameter its own
step tensor (megatron shares one, which AdamW increments once per parameter), and nothing
else. :class:`SequenceParallelRMSNorm` is the norm rlbatch.engine.model puts in the
local layer spec on CPU (megatron's torch norm refuses sequence parallelism). torch itself is never modified (only while megatron first imports is ``torch.compile`` an identity:
:func:`import_megatron`): user code still gets "Torch not compiled with
CUDA enabled" from ``torch.cuda.current_device()``. On a CUDA machine :func:`install` is a no-op.

The layer patches internals by module name, so it is pinned to megatron-core 0.16.1.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
import warnings
from collections.abc import Callable, Iterator
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
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.shared_experts",
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
_MARK = "__rlbatch_cpu_compat__"  # set on the methods install() wrapped (idempotence)


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


class _CpuEvent:
    """A CUDA event on the CPU: work is synchronous, so it has always completed."""

    def record(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, *args: Any, **kwargs: Any) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """A CUDA stream on the CPU (megatron's MoE all-to-all dispatcher builds a side stream for
    its device-to-host copies, its shared experts one for overlap): one ordered stream of work,
    so waiting and syncing are no-ops."""

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        return None

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        return None

    def record_event(self, *args: Any, **kwargs: Any) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        return None


_MAIN_STREAM = _CpuStream()


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

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _CpuStream:  # noqa: N802 - torch.cuda's name
        return _CpuStream()

    @staticmethod
    def Event(*args: Any, **kwargs: Any) -> _CpuEvent:  # noqa: N802 - torch.cuda's name
        return _CpuEvent()

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _CpuStream:
        return _MAIN_STREAM

    @staticmethod
    def stream(*args: Any, **kwargs: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

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


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """RMSNorm for megatron's local layer spec that supports sequence parallelism the way
    Transformer Engine's norm does.

    megatron-core 0.16.1's local spec builds ``WrappedTorchNorm``, which asserts
    ``not config.sequence_parallel``. RMSNorm is per token, so under sequence parallelism each
    tensor-parallel rank simply normalises its own sequence shard; only the weight gradient is
    partial (each rank saw 1/tp of the tokens). Marking the weight ``sequence_parallel = True``
    makes megatron's ``finalize_model_grads`` all-reduce it across the tensor-parallel group,
    exactly as it does for TE's norms. Without sequence parallelism it is ``torch.nn.RMSNorm``.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm: normalization={config.normalization!r}")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


def _with_tensor_method(
    fn: Callable[..., Any], name: str, replace: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[..., Any]:
    """Run ``fn`` with ``torch.Tensor.<name>`` replaced by ``replace(original)``, only for the
    duration of the call."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        original = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, replace(original))
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(torch.Tensor, name, original)

    return wrapper


def _with_identity_cuda(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with ``Tensor.cuda`` as identity (only for the duration of the call)."""
    return _with_tensor_method(fn, "cuda", lambda original: lambda self, *a, **k: self)


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with ``Tensor.type()`` naming CPU tensors as CUDA ones ("torch.FloatTensor" ->
    "torch.cuda.FloatTensor"; only the no-argument query, only for the duration of the call).
    megatron's DistributedOptimizer sorts its parameters by those names and rejects the rest."""

    def cuda_names(original: Callable[..., Any]) -> Callable[..., Any]:
        def cuda_type(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            name = original(self, *a, **k)
            if a or k or self.device.type != "cpu":
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        return cuda_type

    return _with_tensor_method(fn, "type", cuda_names)


def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: Any) -> None:
    """DistributedOptimizer's per-parameter state setter, copying only the states the
    checkpoint holds. megatron's copies every state of the live optimizer, which for torch's
    AdamW (the optimizer without TE / apex) includes a per-parameter "step" that the checkpoint
    loader leaves out on purpose (it restores the step through the param groups): KeyError."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    destination = {"param": main_param, **self.optimizer.state[main_param]}
    for key, value in tensors.items():
        destination[key].copy_(value)


def _with_unshared_steps(load_state_dict: Callable[..., Any]) -> Callable[..., Any]:
    """DistributedOptimizer.load_state_dict, then one "step" tensor per parameter. megatron's
    loader gives every parameter of torch's AdamW the *same* step tensor, which AdamW then
    increments once per parameter: wrong bias correction from the first step after a resume."""

    @functools.wraps(load_state_dict)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load_state_dict(self, *args, **kwargs)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    return wrapper


def _wrap_once(owner: Any, name: str, wrap: Callable[[Any], Callable[..., Any]]) -> None:
    """``owner.<name> = wrap(owner.<name>)`` unless an earlier install already wrapped it."""
    method = getattr(owner, name)
    if getattr(method, _MARK, False):
        return
    wrapped = wrap(method)
    setattr(wrapped, _MARK, True)
    setattr(owner, name, wrapped)


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


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's router gating in fp32 / fp64 (``moe_router_dtype``) reads
    ``moe_utils.te_general_gemm``, a name bound only when Transformer Engine imports: without
    TE (CPU, or a GPU without it) the router's forward raises NameError. Bound to None, the
    gating takes its own torch.mm path, in the router dtype. A no-op where TE defined it."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's ``maybe_move_tensor_to_cpu`` for tensors already on the CPU. The original
    converts only CUDA tensors, so on the CPU the all-to-all dispatcher's split sizes stay
    tensors, which ``all_to_all_single`` refuses (it takes a list of ints; a NumPy array,
    what the original makes of a CUDA tensor, converts). A copy, as the device-to-host copy is."""
    if isinstance(tensor, torch.Tensor):
        tensor = tensor.detach().clone()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def _eager(fn: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``torch.compile``'s signature, compiling nothing: ``fn`` itself, or a decorator that
    returns its function (``torch.compile(mode=...)`` used as a decorator factory)."""
    return fn if fn is not None else (lambda f: f)


def _quiet_cpu_notices() -> None:
    """megatron's import-time notices about the CUDA-only extras it cannot use here (Apex,
    Transformer Engine), filtered before its first import."""
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")


@contextlib.contextmanager
def _without_wandb() -> Iterator[None]:
    """megatron imports wandb, when it is installed, for its own timers and inference logging,
    which rlbatch never uses (its wandb logger imports the package itself, on rank 0, when
    logging.wandb is set): about 1.5 s of CPU in every worker, mostly wandb's settings model
    reading its own source for field docs. While megatron first imports, ``import wandb``
    fails as for an absent package (megatron then binds ``wandb = None``); afterwards the
    package imports normally for whoever asks."""
    if "wandb" in sys.modules:
        yield
        return
    sys.modules["wandb"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


def import_megatron() -> None:
    """The process's first import of megatron-core: without wandb (:func:`_without_wandb`), and
    on the CPU without ``torch.compile``.

    megatron wraps a dozen small fused functions in ``torch.compile`` (its ``jit_fuser``) as its
    modules import, and the wrapping alone imports torch's compiler stack (dynamo, inductor,
    sympy): about 1.6 s of CPU in every worker on this kind of machine, for functions the CPU
    path never calls (rlbatch's local layer spec, sequential experts). With CUDA unavailable,
    ``torch.compile`` is :func:`_eager` for the duration of this import only, so
    ``megatron.core.jit.jit_fuser`` binds to it, and then megatron's own ``disable_jit_fuser``
    makes it the plain decorator: every such function runs eagerly, as it would uncompiled.
    torch is as it was afterwards. A no-op once megatron is imported."""
    if "megatron.core.jit" in sys.modules:
        return
    if not needed():
        with _without_wandb():
            importlib.import_module("megatron.core")
        return
    _quiet_cpu_notices()
    compile_ = torch.compile
    torch.compile = _eager  # type: ignore[assignment]
    try:
        with _without_wandb():
            jit = importlib.import_module("megatron.core.jit")
            for name in PATCHED_MODULES:
                importlib.import_module(name)
    finally:
        torch.compile = compile_
    jit.disable_jit_fuser()


def install() -> bool:
    """Install the CPU layer (idempotent). Returns True when it is active, False on CUDA
    (where only the missing-TE router name is filled in)."""
    global _installed
    if _installed:
        return True
    if not needed():
        _define_missing_te_gemm()
        return False
    _quiet_cpu_notices()
    import_megatron()
    check_version()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        module.torch = TorchProxy(cpu_rng=name.endswith("tensor_parallel.random"))  # type: ignore[attr-defined]

    _define_missing_te_gemm()
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    dispatcher.maybe_move_tensor_to_cpu = _host_copy  # type: ignore[attr-defined]
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[attr-defined]
    random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[attr-defined]

    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(name)
        module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32  # type: ignore[attr-defined]

    lm = importlib.import_module("megatron.core.models.common.language_module.language_module")
    _wrap_once(lm.LanguageModule, "setup_embeddings_and_output_layer", _with_identity_cuda)
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    cls = distrib.DistributedOptimizer
    _wrap_once(cls, "__init__", _with_cuda_type_names)
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    _wrap_once(cls, "load_state_dict", _with_unshared_steps)
    # its checkpoint gather moves CPU buffers with .cuda() (the default group is gloo here)
    _wrap_once(cls, "get_parameter_state_dp_zero", _with_identity_cuda)
    _installed = True
    return True
