"""Checks of ``rollout.servers`` (``rollout.backend=vllm_server``) before launch, torch-free and
without network access (whether each URL answers is rlbatch-train's pre-launch check,
rlbatch.grpo.preflight): where the servers come from, the ranges, and what this release does
not run on servers (LoRA; generation overlapping training with an evaluation;
rollout.servers.on_update=keep without partial rollouts)."""

from __future__ import annotations

from typing import Optional

from rlbatch.config.env import harness_spec
from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import (
    DebugConfig,
    FailKind,
    RolloutBackend,
    RunConfig,
    ServerFailure,
    ServerRouting,
    ServersConfig,
    ServerTransfer,
    ServerUpdate,
)
from rlbatch.config.streaming import overlaps_generation


def check_servers(
    cfg: RunConfig, errors: list[ConfigError], served_len: Optional[int] = None
) -> None:
    """Every error of rollout.servers (and of the run's settings servers cannot serve)."""
    s = cfg.rollout.servers
    if RolloutBackend(cfg.rollout.backend) != RolloutBackend.vllm_server:
        for key, value, unset in (
            ("rollout.servers.urls", s.urls, "[]"),
            ("rollout.servers.count", s.count, "0"),
            ("rollout.servers.transfer_dir", s.transfer_dir, "null"),
            ("rollout.servers.transfer_host", s.transfer_host, "null"),
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
        for key, choice, default in (
            ("rollout.servers.on_failure", ServerFailure(s.on_failure), ServerFailure["stop"]),
            ("rollout.servers.on_update", ServerUpdate(s.on_update), ServerUpdate.abort),
            ("rollout.servers.transfer", ServerTransfer(s.transfer), ServerTransfer.file),
        ):
            if choice != default:
                errors.append(
                    ConfigError(
                        key,
                        choice.value,
                        f"applies to rollout.backend=vllm_server, not {cfg.rollout.backend}: set"
                        f" rollout.backend=vllm_server, or {key}={default.value}",
                    )
                )
        _check_server_only_numbers(cfg, errors)
        return
    _check_source(cfg, errors)
    _check_restart(cfg, errors)
    _check_routing(cfg, errors)
    _check_ranges(cfg, errors, served_len)
    _check_unsupported(cfg, errors)


def _check_server_only_numbers(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """The servers' numbers changed on another backend, which has no server to start, to wait
    for, to abort a row or to probe: an error rather than a setting ignored without a word."""
    s, default = cfg.rollout.servers, ServersConfig()
    backend = RolloutBackend(cfg.rollout.backend).value
    for name in (
        "host", "port", "devices", "start_timeout_s", "timeout_s", "max_concurrency",
        "max_resubmits", "max_restarts", "probe_tokens", "probe_tolerance", "routing",
    ):  # fmt: skip
        value, unset = getattr(s, name), getattr(default, name)
        if value != unset:
            errors.append(
                ConfigError(
                    f"rollout.servers.{name}",
                    value,
                    f"applies to rollout.backend=vllm_server, not {backend}: set"
                    f" rollout.backend=vllm_server, or leave rollout.servers.{name} unset",
                )
            )


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


def _check_restart(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """on_failure=restart restarts servers the run started itself, over the file transfer;
    max_restarts means nothing without it."""
    s = cfg.rollout.servers
    restart = ServerFailure(s.on_failure) == ServerFailure["restart"]
    if restart and s.urls:
        errors.append(
            ConfigError(
                "rollout.servers.on_failure",
                "restart",
                "restarts servers the run started itself (rollout.servers.count), and"
                " rollout.servers.urls names servers someone else started, which the run"
                " cannot start again: let the run start them (rollout.servers.urls=[]"
                " rollout.servers.count=N), or set rollout.servers.on_failure=continue (go on"
                " without a server that fails) or stop (then trainer.resume=auto once it is"
                " back)",
            )
        )
    if restart and ServerTransfer(s.transfer) == ServerTransfer.broadcast:
        errors.append(
            ConfigError(
                "rollout.servers.on_failure",
                "restart",
                "with rollout.servers.transfer=broadcast is not supported in this release (a"
                " restarted server would have to join the weight group the others formed):"
                " set rollout.servers.transfer=file, or rollout.servers.on_failure=continue",
            )
        )
    if restart and cfg.parallel.dp > 1:
        errors.append(
            ConfigError(
                "rollout.servers.on_failure",
                "restart",
                f"at parallel.dp={cfg.parallel.dp} is not supported yet (a run of tiny_moe at dp"
                " 2 x ep 2 whose server was killed made no progress for 300 s: the replicas that"
                " do not push wait on the restarted server's weight label): set"
                " rollout.servers.on_failure=continue or stop (then trainer.resume=auto), or"
                " parallel.dp=1",
            )
        )
    if not restart and s.max_restarts != ServersConfig().max_restarts:
        errors.append(
            ConfigError(
                "rollout.servers.max_restarts",
                s.max_restarts,
                f"applies to rollout.servers.on_failure=restart, not"
                f" {ServerFailure(s.on_failure).value}: set rollout.servers.on_failure=restart,"
                " or leave rollout.servers.max_restarts unset",
            )
        )


def _check_routing(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """rollout.servers.routing chooses the server of an agent harness episode's calls: other
    requests go to the least loaded server whatever it says."""
    s = cfg.rollout.servers
    if s.routing != ServersConfig().routing and not harness_spec(cfg.env):
        errors.append(
            ConfigError(
                "rollout.servers.routing",
                ServerRouting(s.routing).value,
                "applies to agent harness episodes (env.harness or env.agent.openenv_url);"
                " this run's requests go to the least loaded server anyway: leave"
                " rollout.servers.routing unset",
            )
        )


def _check_ranges(cfg: RunConfig, errors: list[ConfigError], served_len: Optional[int]) -> None:
    s = cfg.rollout.servers
    ranges = {
        "rollout.servers.port": (s.port, 0 < s.port < 65536, "in 1..65535"),
        "rollout.servers.start_timeout_s": (s.start_timeout_s, s.start_timeout_s > 0, "> 0"),
        "rollout.servers.timeout_s": (s.timeout_s, s.timeout_s > 0, "> 0"),
        "rollout.servers.max_concurrency": (s.max_concurrency, s.max_concurrency > 0, "> 0"),
        "rollout.servers.probe_tokens": (s.probe_tokens, s.probe_tokens >= 0, ">= 0"),
        "rollout.servers.probe_tolerance": (
            s.probe_tolerance,
            s.probe_tolerance is None or s.probe_tolerance > 0,
            "> 0 or null",
        ),
        "rollout.servers.max_resubmits": (s.max_resubmits, s.max_resubmits >= 0, ">= 0"),
        "rollout.servers.max_restarts": (s.max_restarts, s.max_restarts >= 0, ">= 0"),
    }
    for key, (value, ok, wanted) in ranges.items():
        if not ok:
            errors.append(ConfigError(key, value, f"must be {wanted}"))
    _check_probe_length(cfg, errors, served_len)
    _check_probe_tolerance(cfg, errors)
    _check_transfer(cfg, errors)


def _check_probe_tolerance(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """The probe's tolerance is at least the engine's numeric noise (by its dtype): a server
    of the right weights in bfloat16 is ~3e-3 off the trainer on the tiny model, so the default
    1e-3 stopped every such run after its first step, blaming the server's model (null takes a
    tolerance by the dtype)."""
    from rlbatch.config.dtypes import PROBE_NOISE, engine_dtype

    s = cfg.rollout.servers
    dtype = engine_dtype(cfg)
    noise = PROBE_NOISE.get(dtype, PROBE_NOISE["float32"])
    if s.probe_tokens > 0 and s.probe_tolerance is not None and 0 < s.probe_tolerance < noise:
        errors.append(
            ConfigError(
                "rollout.servers.probe_tolerance",
                s.probe_tolerance,
                f"is below the numeric noise of a {dtype} engine ({noise:g}: its"
                " log-probabilities of the trainer's own weights may be that far off), so the"
                f" probe would refuse servers that hold the right weights: set"
                f" rollout.servers.probe_tolerance>={noise:g} for rollout.vllm.dtype={dtype},"
                " or rollout.servers.probe_tokens=0",
            )
        )


def _check_probe_length(
    cfg: RunConfig, errors: list[ConfigError], served_len: Optional[int]
) -> None:
    """The probe's sequence fits the servers' length (rollout.vllm.max_model_len, or the run's
    longest sequence when null, as rlbatch-serve starts them): vLLM refuses a longer one with
    HTTP 400 at the first sync, after the first step's compute, and the run would stop as if
    the server had failed. ``served_len``: the run's longest served sequence
    (rlbatch.config.vllm_rules.longest_served), which rlbatch.config.vllm_rules passes in."""
    from rlbatch.rollout.servers.probe import probe_length

    n = cfg.rollout.servers.probe_tokens
    held = cfg.rollout.vllm.max_model_len or served_len
    if held is not None and n > 0 and probe_length(n) > held:
        errors.append(
            ConfigError(
                "rollout.servers.probe_tokens",
                n,
                f"makes the probe a sequence of {probe_length(n)} tokens (its prompt of"
                f" {probe_length(0) - 1}, the fixed tokens and one sampled), longer than the"
                f" {held} the servers hold (rollout.vllm.max_model_len, null: the run's longest"
                f" sequence): set rollout.servers.probe_tokens<={held - probe_length(0)}, or"
                f" raise rollout.vllm.max_model_len to {probe_length(n)}",
            )
        )


def _check_transfer(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """transfer_dir belongs to the file transfer, transfer_host to the broadcast: set with the
    other one, it would be ignored without a word."""
    s = cfg.rollout.servers
    transfer = ServerTransfer(s.transfer)
    for key, value, needs in (
        ("rollout.servers.transfer_dir", s.transfer_dir, ServerTransfer.file),
        ("rollout.servers.transfer_host", s.transfer_host, ServerTransfer.broadcast),
    ):
        if value is not None and transfer != needs:
            errors.append(
                ConfigError(
                    key,
                    value,
                    f"applies to rollout.servers.transfer={needs.value}, not {transfer.value}:"
                    f" set rollout.servers.transfer={needs.value}, or {key}=null",
                )
            )


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
    if overlaps_generation(cfg):
        _check_overlap(cfg, errors)
    if ServerUpdate(cfg.rollout.servers.on_update) == ServerUpdate.keep and not g.partial_rollouts:
        errors.append(
            ConfigError(
                "rollout.servers.on_update",
                "keep",
                "decides what happens to rows still decoding at a weight update, which only"
                " partial rollouts have: set grpo.partial_rollouts=true (with"
                " grpo.num_steps_async >= 1), or rollout.servers.on_update=abort",
            )
        )


def _check_overlap(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """Generation overlapping training runs in one worker process per training rank, and DP
    rank 0's worker pushes the weights (the replicas' generation threads meet before each new
    version, rlbatch.rollout.generation_worker): no other pusher in the run."""
    if cfg.eval.every_steps > 0:
        errors.append(
            ConfigError(
                "eval.every_steps",
                cfg.eval.every_steps,
                "evaluation would push the trainer's weights to the rollout servers while the"
                " generation worker samples there with its own version: set eval.every_steps=0"
                " (evaluate the checkpoints with rlbatch-eval on servers of its own), or"
                " grpo.overlap_generation=false (inline generation, no overlap)",
            )
        )


def check_sync_fault(cfg: RunConfig, fault: str, errors: list[ConfigError]) -> None:
    """debug.fail_sync takes the place of fail_kind on rank 0 (the rank that pushes), in the
    training process: a generation worker (generation overlapping training) does not follow
    the step, so its syncs never meet debug.fail_at_step and the fault never happened."""
    d, default = cfg.debug, DebugConfig()
    if RolloutBackend(cfg.rollout.backend) == RolloutBackend.vllm_server and overlaps_generation(
        cfg
    ):
        errors.append(
            ConfigError(
                "debug.fail_sync",
                fault,
                "faults a sync of the training process, but this run's syncs are made by its"
                " generation worker (generation overlaps training), where the fault never"
                " happens: set grpo.overlap_generation=false, or debug.fail_sync=null",
            )
        )
    if d.fail_rank != default.fail_rank:
        errors.append(
            ConfigError(
                "debug.fail_rank",
                d.fail_rank,
                f"is not used with debug.fail_sync={fault} (the fault is on rank 0, which"
                " pushes the weights): set debug.fail_rank=0",
            )
        )
    if FailKind(d.fail_kind) != FailKind(default.fail_kind):
        errors.append(
            ConfigError(
                "debug.fail_kind",
                FailKind(d.fail_kind).value,
                f"is not used with debug.fail_sync={fault} (the sync's fault takes its place):"
                " leave debug.fail_kind unset, or set debug.fail_sync=null",
            )
        )
