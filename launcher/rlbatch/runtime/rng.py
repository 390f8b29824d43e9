"""The process-wide random generators as one state: saved into checkpoints by the training
loop, and kept around third-party code that seeds or draws from them (an in-process vLLM
engine), so the trainer's streams stay the ones it seeded."""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import torch


def _megatron_tracker() -> Any | None:
    """Megatron's model-parallel RNG tracker, only if megatron is already imported."""
    module = sys.modules.get("megatron.core.tensor_parallel.random")
    if module is None:
        return None
    return module.get_cuda_rng_tracker()


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU, CUDA (when present) and Megatron tracker RNG states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _megatron_tracker()
    if tracker is not None and tracker.is_initialized():
        state["megatron"] = {name: s.clone() for name, s in tracker.get_states().items()}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`capture_rng_state`'s states; an empty dict (a resume at another parallel
    layout) keeps the streams this run seeded."""
    if not state:
        return
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "megatron" in state:
        tracker = _megatron_tracker()
        if tracker is None:
            raise RuntimeError("checkpoint has Megatron RNG states but megatron is not loaded")
        tracker.set_states({name: s.clone() for name, s in state["megatron"].items()})
