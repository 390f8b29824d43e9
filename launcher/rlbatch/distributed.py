"""The only module of rlbatch that reduces across ranks.

Every helper is an identity (or a copy) in a single process without torch.distributed, so
pure code can call them unconditionally. Groups come from Megatron's parallel state when it is
initialized (rlbatch.engine.parallel.initialize), else the world.

- ``all_reduce_sum``: many tensors/scalars summed in ONE flattened float64 collective.
- ``reduce_dp`` / ``reduce_step``: the GRPO step's ReduceFn's (1-D float64 vectors; the
  step's bundle summed over the pipeline stages too).
- ``all_gather_object``, ``barrier``, ``check_same_across_ranks`` (plan-hash agreement).
- ``meet``: every rank reaches a point, waiting longer than a collective's timeout allows.
- ``broadcast_from_last_stage``: values computed on the last pipeline stage to every stage.
- ``from_first_in_model_parallel_group``: a call made on one rank of a model-parallel group,
  its result (or its error) on every rank of it.
- ``comm_device``: where a group's backend moves tensors (cuda for nccl, cpu for gloo).
- ``WorldDist``: the training loop's DistOps.
- ``CollectiveTimeoutError`` / ``as_collective_timeout``: a backend's timeout as one type.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import torch
import torch.distributed as dist

Number = Union[int, float]
T = TypeVar("T")


# ---------------------------------------------------------------------------------- timeouts
class CollectiveTimeoutError(RuntimeError):
    """A collective got no answer within the process group's timeout (trainer.timeout_s)."""


# How a backend reports a timed-out collective. NCCL raises torch's DistBackendError (a
# DistError); gloo a plain RuntimeError ("Timed out waiting ...ms for recv", "Application
# timeout caused pair closure") from inside torch.distributed or the work handle Megatron waits
# on. So an error is a collective timeout by its type (a DistError; or exactly RuntimeError
# raised in torch or megatron code, never in rlbatch's or the user's), and only then by its
# wording: a user error that mentions a timeout (an environment's env.timeout_s, a reward
# function's own RuntimeError) is never taken for one. This module is the one place that knows.
_TIMEOUT_WORDS = ("timed out", "timeout")
_MEGATRON = importlib.util.find_spec("megatron")
_BACKEND_DIRS = tuple(
    str(d) + os.sep
    for d in [
        Path(str(torch.__file__)).parent,
        *(Path(str(p)) for p in (_MEGATRON and _MEGATRON.submodule_search_locations) or []),
    ]
)


def _raised_by_backend(exc: BaseException) -> bool:
    """The innermost frame of ``exc``'s traceback is torch's or megatron-core's code."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.startswith(_BACKEND_DIRS)


def as_collective_timeout(exc: BaseException) -> Optional[CollectiveTimeoutError]:
    """``exc`` as a CollectiveTimeoutError when it reports a timed-out collective, else None."""
    if isinstance(exc, CollectiveTimeoutError):
        return exc
    # torch's own error types say where they come from; a plain RuntimeError must come from
    # torch's or megatron-core's code (gloo's), else it is the user's (or rlbatch's) own
    if not isinstance(exc, dist.DistError):
        if type(exc) is not RuntimeError or not _raised_by_backend(exc):
            return None
    text = str(exc).lower()
    if any(word in text for word in _TIMEOUT_WORDS):
        timeout = CollectiveTimeoutError(str(exc))
        timeout.__cause__ = exc
        return timeout
    return None


# ------------------------------------------------------------------------------------ groups
def _megatron_ready() -> bool:
    if not dist.is_initialized():
        return False
    from megatron.core import parallel_state as ps

    return ps.model_parallel_is_initialized()


def is_distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def dp_group(with_context_parallel: bool = True) -> Optional[Any]:
    """Megatron's data-parallel group (x context-parallel by default); None = no group."""
    if not _megatron_ready():
        return None
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=with_context_parallel)


def dp_rank(with_context_parallel: bool = False) -> int:
    if not _megatron_ready():
        return 0
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(with_context_parallel=with_context_parallel)


def dp_size(with_context_parallel: bool = False) -> int:
    if not _megatron_ready():
        return 1
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size(with_context_parallel=with_context_parallel)


def pp_size() -> int:
    if not _megatron_ready():
        return 1
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def pipeline_stage() -> tuple[int, int, Optional[Any]]:
    """(pp rank, pp size, pp group) of this rank; (0, 1, None) without model parallelism."""
    if not _megatron_ready():
        return 0, 1, None
    from megatron.core import parallel_state as ps

    return (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_group(),
    )


def expert_group() -> tuple[int, Optional[Any]]:
    """(size, group) of this rank's expert-parallel group: the ranks whose MoE layers exchange
    tokens by all-to-all, so that each forward of one is a forward of all; (1, None) without
    expert parallelism."""
    if not _megatron_ready():
        return 1, None
    from megatron.core import parallel_state as ps

    size = ps.get_expert_model_parallel_world_size()
    return size, (ps.get_expert_model_parallel_group() if size > 1 else None)


def any_in_expert_group(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the expert-parallel group (``flag`` itself
    without expert parallelism). Every rank of the group calls."""
    size, group = expert_group()
    if size == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item() > 0)


def any_in_expert_group_each(flags: Sequence[bool]) -> list[bool]:
    """Per flag, whether it holds on any rank of the expert-parallel group, in one all-reduce
    (``flags`` themselves without expert parallelism). Every rank of the group calls."""
    size, group = expert_group()
    if size == 1:
        return list(flags)
    values = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64)
    values = values.to(comm_device(group))
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return [v > 0 for v in values.tolist()]


def max_in_expert_group(value: int) -> int:
    """The largest ``value`` over the ranks of the expert-parallel group (``value`` itself
    without expert parallelism). Every rank of the group calls."""
    size, group = expert_group()
    if size == 1:
        return value
    most = torch.tensor([float(value)], dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return int(most.item())


def model_parallel_group() -> tuple[int, int, Optional[Any]]:
    """(rank in, size of, group) of this rank's model-parallel group: the tp x pp ranks that
    hold one replica of the model; (0, 1, None) without model parallelism."""
    if not _megatron_ready():
        return 0, 1, None
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group()
    return dist.get_rank(group), dist.get_world_size(group), group


def broadcast_object_in_model_parallel_group(obj: Any) -> Any:
    """A picklable object from the first rank of this rank's model-parallel group to every rank
    of it (the others pass anything, e.g. None)."""
    _, size, group = model_parallel_group()
    if size == 1 or group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def from_first_in_model_parallel_group(call: Optional[Callable[[], T]]) -> T:
    """``call()`` run on the first rank of this rank's model-parallel group (which passes it;
    the others pass None) and its result on every rank of the group; an exception it raises
    is raised on every rank (none is left waiting in the broadcast)."""
    outcome: Any = None
    if call is not None:
        try:
            outcome = ("ok", call())
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            outcome = ("error", err)
    kind, value = broadcast_object_in_model_parallel_group(outcome)
    if kind == "error":
        raise value
    result: T = value
    return result


def is_last_stage() -> bool:
    if not _megatron_ready():
        return True
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)


def _group_size(group: Optional[Any]) -> int:
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def device_for_backend(backend: str) -> torch.device:
    """The device whose tensors a torch.distributed backend moves: CUDA (the current device)
    for nccl, including a mixed "cpu:gloo,cuda:nccl" group; the CPU for gloo."""
    return torch.device("cuda") if "nccl" in str(backend) else torch.device("cpu")


def comm_device(group: Optional[Any] = None) -> torch.device:
    """Where tensors sent over ``group`` (None = the world) must live; the CPU without
    torch.distributed."""
    if not dist.is_initialized():
        return torch.device("cpu")
    device = device_for_backend(dist.get_backend(group))
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _device() -> torch.device:
    return comm_device()


# ------------------------------------------------------------------------------ reductions
def all_reduce_sum(
    values: Sequence[Union[torch.Tensor, Number]], group: Optional[Any] = "dp"
) -> list[torch.Tensor]:
    """Sum each value over ``group`` ("dp" = Megatron's DP x CP group, None = the world, or a
    process group) with ONE flattened float64 collective. Returns tensors with the inputs'
    shapes and dtypes (floats/ints -> 0-d float64 tensors), on the inputs' devices."""
    if isinstance(group, str):
        group = dp_group()
    tensors = [
        v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64)
        for v in values
    ]
    if not tensors:
        return []
    if _group_size(group) == 1:
        return [t.detach().clone() for t in tensors]
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64).to(_device()) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    out, offset = [], 0
    for t in tensors:
        n = t.numel()
        out.append(flat[offset : offset + n].reshape(t.shape).to(dtype=t.dtype, device=t.device))
        offset += n
    return out


def all_reduce_floats(values: Sequence[Number], group: Optional[Any] = "dp") -> list[float]:
    """all_reduce_sum for plain Python numbers (one collective)."""
    if not values:
        return []
    vec = torch.tensor([float(v) for v in values], dtype=torch.float64)
    return all_reduce_sum([vec], group)[0].tolist()


def reduce_dp(x: torch.Tensor) -> torch.Tensor:
    """Sum of a 1-D float64 vector over the DP x CP replicas (the GRPO step's reduce_dp)."""
    return all_reduce_sum([x])[0]


def reduce_step(x: torch.Tensor) -> torch.Tensor:
    """Sum over DP x CP and over the pipeline stages, returned on every stage (the end-of-step
    bundle: losses and counts are computed on the last stage, and an earlier stage passes
    zeros there; it adds only the terms it computes itself, an MoE policy's load-balancing
    loss of its own routers)."""
    summed = all_reduce_sum([x])[0]
    _, size, group = pipeline_stage()
    if size == 1:
        return summed
    return all_reduce_sum([summed], group)[0]


def reduce_max(value: float) -> float:
    """The largest of one float over every rank of the world (stages without it pass -inf)."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def barrier(group: Optional[Any] = None) -> None:
    if dist.is_initialized() and _group_size(group) > 1:
        dist.barrier(group=group)


def meet(tag: str, timeout_s: float) -> None:
    """Wait until every rank of the world has called ``meet(tag, ...)``, for up to ``timeout_s``
    seconds, through the rendezvous store rather than a collective: a collective gives up after
    trainer.timeout_s (the process group's timeout), and ranks that wait for a peer still running
    a round of user code bounded longer than that (agent harness episodes, each with its own
    deadline) must wait as long as the peer's bound. Each rank calls it with the same tags in
    the same order. Raises TimeoutError naming the ranks that did not come."""
    from datetime import timedelta

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    prefix = f"rlbatch/meet/{tag}/"
    store.set(prefix + str(dist.get_rank()), "1")
    keys = [prefix + str(r) for r in range(dist.get_world_size())]
    try:
        store.wait(keys, timedelta(seconds=max(timeout_s, 1.0)))
    except (RuntimeError, dist.DistError) as err:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise TimeoutError(
            f"rank {dist.get_rank()} waited {timeout_s:.0f} s at {tag} for ranks {missing}"
        ) from err
    # every rank has passed the previous meet (each set this one's key after it): its key can go,
    # so a long run does not fill the store with a key per rank per round
    _MET.append(prefix + str(dist.get_rank()))
    if len(_MET) > 1:
        store.delete_key(_MET.pop(0))


_MET: list[str] = []
"""This rank's key of its latest meet (and, briefly, the one before)."""


def all_gather_object(obj: Any, group: Optional[Any] = None) -> list[Any]:
    """One object per rank of ``group`` (None = the world), in rank order."""
    size = _group_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def dp_gather_object(obj: Any) -> list[Any]:
    """One object per DP rank (without context parallel), in DP-rank order."""
    return all_gather_object(obj, dp_group(with_context_parallel=False))


def _digest(value: Any) -> str:
    data = value if isinstance(value, bytes) else pickle.dumps(value, protocol=4)
    return hashlib.sha256(data).hexdigest()[:16]


def check_same_across_ranks(value: Any, what: str, group: Optional[Any] = None) -> None:
    """Raise RuntimeError naming the ranks whose ``value`` (e.g. a plan's JSON) differs from
    rank 0's. Compares a hash; one all_gather_object."""
    digests = all_gather_object(_digest(value), group)
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(len(digests)))
        )
        names = ", ".join(f"rank {ranks[r]}" for r in bad)
        raise RuntimeError(
            f"{what} differs across ranks: {names} disagree with rank {ranks[0]} "
            f"(hash {digests[0]} vs {', '.join(digests[r] for r in bad)})"
        )


# ------------------------------------------------------------------------- pipeline stages
def broadcast_from_last_stage(
    tensor: Optional[torch.Tensor], shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """The last pipeline stage's ``tensor`` on every stage (others pass None and the shape and
    dtype they expect)."""
    if pp_size() == 1:
        assert tensor is not None
        return tensor
    from megatron.core import parallel_state as ps

    buf = (
        tensor.detach().to(_device())
        if tensor is not None
        else torch.empty(tuple(shape), dtype=dtype, device=_device())
    )
    dist.broadcast(
        buf,
        src=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    return buf


def broadcast_object_from_last_stage(obj: Any) -> Any:
    """A picklable object from the last pipeline stage to every stage."""
    if pp_size() == 1:
        return obj
    from megatron.core import parallel_state as ps

    box = [obj if is_last_stage() else None]
    dist.broadcast_object_list(
        box,
        src=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    return box[0]


# ----------------------------------------------------------------------------- peak memory
def reset_peak_memory() -> None:
    """Start a new peak-memory window (on a GPU; a CPU process has one mark for its life)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def local_peak_memory_gb() -> float:
    """This process's peak memory in GiB: on a GPU what torch allocated on the device since
    :func:`reset_peak_memory`; on a CPU the process's peak resident set so far (the kernel keeps
    no per-step mark that other processes cannot disturb)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ---------------------------------------------------------------------------- loop facade
class WorldDist:
    """The training loop's DistOps on a torch.distributed world (DP sums, world gathers)."""

    def __init__(self) -> None:
        self.rank = rank()
        self.world_size = world_size()

    def barrier(self) -> None:
        barrier()

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        return all_reduce_floats(values)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return all_gather_object(obj)

    def reset_peak_memory(self) -> None:
        reset_peak_memory()

    def peak_memory_gb(self) -> float:
        return reduce_max(local_peak_memory_gb())
