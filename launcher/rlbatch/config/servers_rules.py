"""Checks of ``rollout.servers`` (``rollout.backend=vllm_server``) before launch, torch-free and
without network access (whether each URL answers is rlbatch-train's pre-launch check,
rlbatch.grpo.preflight): where the servers come from, the ranges, and what this release does
not run on servers."""

from __future__ import annotations

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import RolloutBackend, RunConfig, ServerFailure


def check_servers(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """Every error of rollout.servers (and of the run's settings servers cannot serve)."""
    s = cfg.rollout.servers
    if RolloutBackend(cfg.rollout.backend) != RolloutBackend.vllm_server:
        for key, value, unset in (
            ("rollout.servers.urls", s.urls, "[]"),
            ("rollout.servers.count", s.count, "0"),
        ):
            if value:
                errors.append(
                    ConfigError(
                        key,
                        value,
                        f"applies to rollout.backend=vllm_server, not {cfg.rollout.backend}:"
                        f" set rollout.backend=vllm_server, or {key}={unset}",
                    )
                )
        if ServerFailure(s.on_failure) != ServerFailure["stop"]:
            errors.append(
                ConfigError(
                    "rollout.servers.on_failure",
                    ServerFailure(s.on_failure).value,
                    f"applies to rollout.backend=vllm_server, not {cfg.rollout.backend}: set"
                    " rollout.backend=vllm_server, or rollout.servers.on_failure=stop",
                )
            )
        return
    _check_source(cfg, errors)
    _check_ranges(cfg, errors)
    _check_unsupported(cfg, errors)


def _check_source(cfg: RunConfig, errors: list[ConfigError]) -> None:
    s = cfg.rollout.servers
    if s.urls and s.count:
        errors.append(
            ConfigError(
                "rollout.servers.count",
                s.count,
                "rollout.servers.urls already names the servers: set rollout.servers.count=0"
                " (use the running servers) or rollout.servers.urls=[] (rlbatch starts them)",
            )
        )
    elif not s.urls and s.count <= 0:
        errors.append(
            ConfigError(
                "rollout.servers.urls",
                [],
                "rollout.backend=vllm_server needs servers: name running ones"
                " (rollout.servers.urls=[http://HOST:PORT,...], started with rlbatch-serve) or"
                " let rlbatch start them (rollout.servers.count=N)",
            )
        )
    for url in s.urls:
        if not str(url).startswith(("http://", "https://")):
            errors.append(
                ConfigError(
                    "rollout.servers.urls",
                    url,
                    "is not an http:// or https:// URL: write it as http://HOST:PORT",
                )
            )
    if s.count and cfg.parallel.nnodes > 1:
        errors.append(
            ConfigError(
                "rollout.servers.count",
                s.count,
                f"starts servers on node 0's 127.0.0.1, which the other nodes of a"
                f" {cfg.parallel.nnodes}-node run cannot reach: start them with rlbatch-serve"
                " and name them in rollout.servers.urls",
            )
        )
    if s.devices and s.count and len(s.devices) != s.count:
        errors.append(
            ConfigError(
                "rollout.servers.devices",
                s.devices,
                f"needs one entry per server (rollout.servers.count={s.count}): give"
                f" {s.count} entries, or [] for the CPU build",
            )
        )


def _check_ranges(cfg: RunConfig, errors: list[ConfigError]) -> None:
    s = cfg.rollout.servers
    ranges = {
        "rollout.servers.port": (s.port, 0 < s.port < 65536, "in 1..65535"),
        "rollout.servers.start_timeout_s": (s.start_timeout_s, s.start_timeout_s > 0, "> 0"),
        "rollout.servers.timeout_s": (s.timeout_s, s.timeout_s > 0, "> 0"),
        "rollout.servers.max_concurrency": (s.max_concurrency, s.max_concurrency > 0, "> 0"),
        "rollout.servers.probe_tokens": (s.probe_tokens, s.probe_tokens >= 0, ">= 0"),
        "rollout.servers.probe_tolerance": (s.probe_tolerance, s.probe_tolerance > 0, "> 0"),
    }
    for key, (value, ok, wanted) in ranges.items():
        if not ok:
            errors.append(ConfigError(key, value, f"must be {wanted}"))


def _check_unsupported(cfg: RunConfig, errors: list[ConfigError]) -> None:
    g = cfg.grpo
    if cfg.model.lora.rank > 0:
        errors.append(
            ConfigError(
                "model.lora.rank",
                cfg.model.lora.rank,
                "LoRA policies are not served by rollout servers in this release: set"
                " rollout.backend=vllm (vLLM's own LoRA), or model.lora.rank=0",
            )
        )
    if g.num_steps_async > 0:
        errors.append(
            ConfigError(
                "grpo.num_steps_async",
                g.num_steps_async,
                "rollout servers generate a round while training waits in this release: set"
                " grpo.num_steps_async=0, or rollout.backend=vllm",
            )
        )
    if g.partial_rollouts:
        errors.append(
            ConfigError(
                "grpo.partial_rollouts",
                True,
                "is not run on rollout servers in this release: set"
                " grpo.partial_rollouts=false, or rollout.backend=vllm",
            )
        )
