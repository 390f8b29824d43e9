"""rlbatch's weight-transfer backend for vLLM servers, loaded into every server process as a
vLLM plugin (entry point group ``vllm.general_plugins``, :func:`register`).

vLLM's RL lifecycle (``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update``)
needs a transfer backend; the ones vLLM ships move tensors over NCCL or CUDA IPC and do not run
on its CPU build. This one reads the weights from a safetensors file the trainer wrote (on one
machine a file in /dev/shm, i.e. shared memory; across machines a shared filesystem), named in
each ``update_info`` as ``{"path": ...}``. The update runs inside vLLM's layer-wise reload
(started by ``start_weight_update``, finished by ``finish_weight_update``): the CPU build
repacks linear weights, which only the reload path rebuilds. The trainer sends ``lm_head.weight``
for a tied model (the CPU head keeps its own copy).

This module imports vLLM: only a server process loads it (vLLM resolves the backend's class by
name when a server starts with ``--weight-transfer-config '{"backend": "rlbatch_file"}'``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "rlbatch_file"
"""The name servers are started with (--weight-transfer-config)."""


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to set up: every update names its own file."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str
    """A safetensors file of Hugging Face-named full tensors the server can read."""


class FileTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """Weights from a safetensors file into the model, inside vLLM's layer-wise reload."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronises the accelerator (torch.accelerator), which the CPU build
        # lacks; a file read is synchronous
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        from safetensors import safe_open

        with safe_open(update_info.path, framework="pt", device="cpu") as f:
            weights = [(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118
        self.model.load_weights(weights)  # type: ignore[operator]

    def shutdown(self) -> None:
        return None


def register() -> None:
    """The plugin's entry point: make :data:`BACKEND` a transfer backend vLLM knows (vLLM
    calls every general plugin in each of its processes; a second call changes nothing)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, FileTransferEngine)
