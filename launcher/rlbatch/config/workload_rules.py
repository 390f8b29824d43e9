"""The cross-field rules of the long-tailed response-length workload
(debug.response_length_median / response_length_sigma; rlbatch.config.validate runs
:func:`check_response_lengths`); what the caps do is :func:`rlbatch.rollout.sampling.length_caps`.
Pure: no torch.
"""

from __future__ import annotations

import math

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import RolloutBackend, RunConfig


def check_response_lengths(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """The lognormal's median fits in [0, rollout.max_new_tokens] and its sigma is positive;
    only the built-in engine's single-turn decoding honours the caps, so a run that could not
    honour them is refused rather than silently sampling full-length rows."""
    d, r = cfg.debug, cfg.rollout
    median, sigma = d.response_length_median, d.response_length_sigma
    if not 0 <= median <= r.max_new_tokens:
        errors.append(
            ConfigError(
                "debug.response_length_median",
                median,
                f"must be in [0, rollout.max_new_tokens={r.max_new_tokens}]: 0 turns the"
                " long-tailed workload off; raise rollout.max_new_tokens for a longer tail",
            )
        )
    if not (math.isfinite(sigma) and sigma > 0):
        errors.append(
            ConfigError(
                "debug.response_length_sigma",
                sigma,
                "must be a finite number > 0 (the lognormal's spread on the log scale; 1.0 is a"
                " heavy tail)",
            )
        )
    if median <= 0:
        return
    backend = RolloutBackend(r.backend)
    streamed = (
        backend in (RolloutBackend.vllm, RolloutBackend.vllm_server) and cfg.grpo.partial_rollouts
    )
    if backend != RolloutBackend.megatron and not streamed:
        errors.append(
            ConfigError(
                "rollout.backend",
                r.backend,
                "debug.response_length_median caps rows in the built-in engine, and in the"
                " vLLM backends' partial-rollout stream only: set rollout.backend=megatron (or"
                " grpo.partial_rollouts=true with vllm), or debug.response_length_median=0",
            )
        )
    if cfg.env.path:
        errors.append(
            ConfigError(
                "env.path",
                cfg.env.path,
                "debug.response_length_median caps single-turn rollouts only: set env.path=null,"
                " or debug.response_length_median=0",
            )
        )
