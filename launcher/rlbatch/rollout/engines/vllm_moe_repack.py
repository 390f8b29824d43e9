"""vLLM's CPU build after a weight update of an MoE model: the routed experts' weights are put
back into the layout its MoE kernel computes with.

vLLM's CPU MoE kernel (``CPUUnquantizedExperts``) computes with the experts' weights prepacked
into its grouped-GEMM layout, which ``process_weights_after_loading`` of the kernel's experts
does once the weights are loaded. vLLM 0.32.0's unquantized MoE method runs that step on the
first load only: on a weight update (an RL sync through ``reload_weights`` or the weight-transfer
lifecycle) it copies the new weights in, in the checkpoint's layout, and skips the prepack. The
kernel then reads unpacked weights as packed ones: every token's log-probabilities were about
1e-2 off (a model loaded from the same files directly matched transformers exactly, and the
updated experts' tensors equalled the unpacked checkpoint tensors). No error or warning shows.

:func:`watch` (before an update) notes, for each such experts object, whether vLLM prepacks it
during the update; :func:`repack_skipped` (after it) prepacks the ones it skipped, so a vLLM
that fixes this is not prepacked twice. Dense models have no such layer: both do nothing.
This module imports vLLM: the colocated engine and the servers' transfer plugin call it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

PACKED = "_rlbatch_prepacked"
"""Set on a CPU experts object once vLLM (or :func:`repack_skipped`) has prepacked it in this
update."""


def _cpu_experts(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, Any]]:
    """(layer, experts kernel) of every MoE layer computed by vLLM's CPU unquantized kernel."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a GPU build without the CPU kernels
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            yield module, experts


def watch(model: torch.nn.Module) -> None:
    """Before a weight update: each CPU experts object records whether it is prepacked during
    the update (its ``process_weights_after_loading`` wrapped, once)."""
    for _, experts in _cpu_experts(model):
        if not hasattr(experts, PACKED):
            prepack = experts.process_weights_after_loading

            def recorded(layer: torch.nn.Module, prepack: Any = prepack, e: Any = experts) -> None:
                prepack(layer)
                setattr(e, PACKED, True)

            experts.process_weights_after_loading = recorded
        setattr(experts, PACKED, False)


def repack_skipped(model: torch.nn.Module) -> int:
    """After a weight update: prepack the CPU experts the update left unpacked; how many."""
    done = 0
    for layer, experts in _cpu_experts(model):
        if getattr(experts, PACKED, True) is False:
            experts.process_weights_after_loading(layer)
            done += 1
    return done


def watch_worker(worker: Any) -> None:
    """:func:`watch` on a vLLM worker's model (``LLM.collective_rpc``)."""
    watch(worker.model_runner.get_model())


def repack_worker(worker: Any) -> int:
    """:func:`repack_skipped` on a vLLM worker's model (``LLM.collective_rpc``)."""
    return repack_skipped(worker.model_runner.get_model())
