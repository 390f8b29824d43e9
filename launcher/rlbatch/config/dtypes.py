"""The engine's dtype for a run and what follows from it: the vLLM dtype of each training dtype,
an engine's numeric noise by dtype, and the rollout servers' probe tolerance when
rollout.servers.probe_tolerance is null."""

from __future__ import annotations

from rlbatch.config.schema import RunConfig

TRAINING_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The vLLM dtype of each training dtype (model.params_dtype)."""
PROBE_NOISE = {"float32": 5e-6, "bfloat16": 5e-2, "float16": 5e-3}
"""An engine's numeric noise by its dtype: how far its log-probabilities of the same weights
may be from the float32 trainer's (float32: measured 5e-7 on CPU, kept at ten times that;
bfloat16: ~3e-3 measured on the tiny model)."""
FLOAT32_PROBE_TOLERANCE = 1e-3
"""rollout.servers.probe_tolerance's value for a float32 engine when null."""


def engine_dtype(cfg: RunConfig) -> str:
    """rollout.vllm.dtype, or the training dtype when null."""
    return cfg.rollout.vllm.dtype or TRAINING_DTYPES[cfg.model.params_dtype.value]


def probe_tolerance(cfg: RunConfig) -> float:
    """rollout.servers.probe_tolerance, or its value for the engine's dtype when null."""
    given = cfg.rollout.servers.probe_tolerance
    if given is not None:
        return float(given)
    dtype = engine_dtype(cfg)
    return FLOAT32_PROBE_TOLERANCE if dtype == "float32" else PROBE_NOISE[dtype]
