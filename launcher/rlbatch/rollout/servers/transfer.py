"""rlbatch's weight-transfer backend for vLLM servers, loaded into every server process as a
vLLM plugin (entry point group ``vllm.general_plugins``, :func:`register`).

vLLM's RL lifecycle (``init_weight_transfer_engine``, then per update ``start_weight_update`` ->
``update_weights`` -> ``finish_weight_update``) needs a transfer backend; the ones vLLM ships
move tensors over NCCL or CUDA IPC and do not run on its CPU build. This one takes the weights
either way rollout.servers.transfer names, chosen by what the trainer sends:

- ``file``: an empty ``init_info``; each ``update_info`` names a safetensors file the trainer
  wrote (``{"path": ...}``; on one machine a file in /dev/shm, i.e. shared memory; across
  machines a shared filesystem);
- ``broadcast``: ``init_info`` is the rendezvous of one gloo process group of the trainer's
  first rank (rank 0, which hosts the TCP store) and every server's workers (``rank_offset``:
  the first rank of this server's workers); each ``update_info`` lists the tensors' names,
  dtypes and shapes, and the tensors arrive one by one, broadcast from rank 0, in that order:
  the protocol of vLLM's own ``nccl`` backend (unpacked), which GPU servers run instead.

The update runs inside vLLM's layer-wise reload (started by ``start_weight_update``, finished by
``finish_weight_update``): the CPU build repacks linear weights, which only the reload path
rebuilds. The trainer sends ``lm_head.weight`` for a tied model (the CPU head keeps its own
copy).

An update is whole or it fails: vLLM's reload counts the elements each layer received, and a
layer that got fewer than its parameters hold would keep its old weights (or, partly loaded,
a mix) with only a warning in the server's log. ``finish_weight_update`` therefore lists every
such layer before the reload is finalised and fails the update naming them (the reload is
still closed, so the server keeps serving, but it never takes the update's label: the trainer
finds the failed push by the label it set when it started, below). vLLM's own weight checker
cannot stand in for this: it hashes the fused, repacked tensors, which the trainer cannot
compute.

Ending an update someone else left open (a trainer killed mid-sync): ``update_weights`` with
``{"abandon": true}`` closes the reload without the completeness check (layers that received
nothing keep their tensors), and the ``finish_weight_update`` after it ends vLLM's update
session, so the next ``start_weight_update`` is accepted. ``start_weight_update`` also closes
a reload that an update which failed mid-transfer left open (vLLM ends its session on such a
failure, not the reload), so the next update counts every layer afresh.

This module imports vLLM: only a server process loads it (vLLM resolves the backend's class by
name when a server starts with ``--weight-transfer-config '{"backend": "rlbatch"}'``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Optional

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "rlbatch"
"""The name servers are started with (--weight-transfer-config)."""


@dataclass
class TransferInitInfo(WeightTransferInitInfo):
    """Empty for the file transfer; the gloo group's rendezvous for the broadcast."""

    master_address: Optional[str] = None
    master_port: Optional[int] = None
    rank_offset: int = 1
    world_size: int = 0
    timeout_s: float = 300.0


@dataclass
class TransferUpdateInfo(WeightTransferUpdateInfo):
    path: Optional[str] = None
    """file: a safetensors file of Hugging Face-named full tensors the server can read."""
    names: Optional[list[str]] = None
    """broadcast: the tensors' names, dtypes (torch names) and shapes, in broadcast order."""
    dtype_names: Optional[list[str]] = None
    shapes: Optional[list[list[int]]] = None
    abandon: bool = False
    """End the open update without taking its weights (recovering a stale update)."""


class RlbatchTransferEngine(WeightTransferEngine[TransferInitInfo, TransferUpdateInfo]):
    """Weights from a file, or broadcast over a gloo group, into the model, inside vLLM's
    layer-wise reload."""

    init_info_cls = TransferInitInfo
    update_info_cls = TransferUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None
        self.abandoned = False

    def init_transfer_engine(self, init_info: TransferInitInfo) -> None:
        self.shutdown()  # a new group (the trainer restarted, or left a server out)
        address, port = init_info.master_address, init_info.master_port
        if address is None or port is None:  # the file transfer: nothing to join
            return
        import torch.distributed as dist

        # this worker's rank: as vLLM's nccl backend counts it (data-parallel index, then the
        # worker's rank in its engine, after the trainer's rank_offset ranks)
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(
            address, port, init_info.world_size,
            is_master=False, timeout=timeout,
        )  # fmt: skip
        self.group = dist.ProcessGroupGloo(store, rank, init_info.world_size, timeout)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from rlbatch.rollout.engines.vllm_moe_repack import watch

        self._close_reload()  # one a failed update left open: count every layer afresh
        self.abandoned = False
        watch(self.model)  # the CPU build skips MoE experts' prepack on an update
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        if self.abandoned:  # closed already, without its weights: end vLLM's session only
            self.abandoned = False
            return
        from rlbatch.rollout.engines.vllm_moe_repack import repack_skipped

        short = incomplete_layers(self.model)  # before finalising, which resets the counts
        self._close_reload()
        repack_skipped(self.model)
        if short:
            raise RuntimeError(
                f"the weight update is incomplete: {len(short)} layer(s) of the served model"
                f" received fewer elements than they hold: {'; '.join(short[:8])}"
                f"{' ...' if len(short) > 8 else ''}; the trainer's weights do not cover this"
                " server's model (is it serving another model?); the update's label is not set"
            )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronises the accelerator (torch.accelerator), which the CPU build
        # lacks; a file read and a gloo broadcast are synchronous
        info = self.parse_update_info(update_info)
        if info.abandon:
            self._close_reload()
            self.abandoned = True
            return
        self.receive_weights(info)

    def _close_reload(self) -> None:
        """Finalise the layer-wise reload (a no-op when none is open)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: TransferUpdateInfo) -> None:
        if update_info.path is not None:
            from safetensors import safe_open

            with safe_open(update_info.path, framework="pt", device="cpu") as f:
                weights = [(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118
            self.model.load_weights(weights)  # type: ignore[operator]
            return
        if self.group is None:
            raise RuntimeError(
                "a broadcast weight update arrived before init_weight_transfer_engine joined"
                " the trainer's group"
            )
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        names, dtypes, shapes = update_info.names or [], update_info.dtype_names, update_info.shapes
        for name, dtype, shape in zip(names, dtypes or [], shapes or [], strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            self.group.broadcast([tensor], opts).wait()
            self.model.load_weights([(name, tensor)])  # type: ignore[operator]

    def shutdown(self) -> None:
        self.group = None


def incomplete_layers(model: torch.nn.Module) -> list[str]:
    """Every layer of ``model`` still waiting in vLLM's layer-wise reload for elements of its
    parameters, as 'name (received of held elements)': vLLM processes a layer as soon as all
    of its elements arrived, so the ones still open at the end of an update are short.
    Attention layers, which vLLM processes only when the reload is finalised and whose tensors
    are not checkpoint weights, are left out."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

    short = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or is_deferred_attention_layer(layer):
            continue
        held = sum(
            _held(layer, p, get_tensor_load_numel(p))
            for key, p in layer._parameters.items()
            if p is not None and key not in SKIP_LOAD_TENSORS
        )
        if info.load_numel < held:
            short.append(f"{name} ({info.load_numel} of {held} elements)")
    return short


def _held(layer: torch.nn.Module, param: torch.Tensor, numel: int) -> int:
    """The elements of ``param`` a checkpoint fills: a vocabulary layer (embedding, output
    layer) pads its rows to a multiple vLLM chooses, and no checkpoint has the padding rows."""
    rows = getattr(layer, "shard_indices", None)
    if rows is None or param.dim() < 1 or param.shape[0] != rows.num_elements_padded:
        return numel
    return numel // param.shape[0] * (rows.num_org_elements + rows.num_added_elements)


def register() -> None:
    """The plugin's entry point: make :data:`BACKEND` a transfer backend vLLM knows (vLLM
    calls every general plugin in each of its processes; a second call changes nothing)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, RlbatchTransferEngine)
