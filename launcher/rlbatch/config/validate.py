"""Cross-field validation of a typed RunConfig: one pass, every error, each with key and fix.

Runs in the driver before anything heavy is imported (no torch, no megatron here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlbatch.config.agent_rules import check_agent
from rlbatch.config.distill import distill_errors
from rlbatch.config.errors import ConfigError, ConfigErrors
from rlbatch.config.evaluation_rules import check_eval
from rlbatch.config.lengths import longest_sequence, longest_sequence_text
from rlbatch.config.lora_rules import check_lora
from rlbatch.config.model_rules import check_model_paths, check_model_shape, check_model_split
from rlbatch.config.moe_rules import (
    check_expert_layout,
    check_moe,
    check_moe_backend,
    check_moe_model,
    check_moe_scoring,
    check_routing_replay,
)
from rlbatch.config.objectives import objective_errors
from rlbatch.config.parallel_rules import (
    check_gloo_layout,
    check_layout,
    check_world,
    world_size,
)
from rlbatch.config.schema import (
    BatchingMode,
    BatchingPassConfig,
    DataSource,
    OversizePolicy,
    RolloutBackend,
    RunConfig,
    SyncFault,
)
from rlbatch.config.servers_rules import check_sync_fault
from rlbatch.config.streaming import check_partial_rollouts, per_row_decoder_errors
from rlbatch.config.vllm_rules import check_vllm
from rlbatch.config.workload_rules import check_response_lengths

Check = Callable[[RunConfig, list[ConfigError]], None]


@dataclass(frozen=True)
class Rule:
    """A cross-field check and the config sections it reads (``batching.train`` or ``model``)."""

    reads: frozenset[str]
    check: Check


SECTIONS = (
    "model", "data", "rollout", "env", "batching", "normalization", "parallel", "grpo", "trainer",
    "logging", "debug", "plan", "logprobs", "eval",
)  # fmt: skip

TRAIN_SCOPE = frozenset(SECTIONS) - {"plan", "logprobs"}
"""rlbatch-train uses every section but the other commands' inputs."""
PLAN_SCOPE = frozenset({"batching", "parallel", "plan"})
"""rlbatch-plan only plans: no model is built, no data generated, nothing trained."""
LOGPROBS_SCOPE = frozenset({"model", "batching.infer", "parallel", "logprobs"})
"""rlbatch-logprobs builds the model and runs the infer pass over its input file."""
EVAL_SCOPE = frozenset({"model", "rollout", "parallel", "eval"})
"""rlbatch-eval builds the model and samples the eval set (eval.* fills its nulls from data.*)."""
SERVE_SCOPE = frozenset({"model", "data", "rollout", "env", "eval"})
"""rlbatch-serve holds the run's model for its longest sequence: the trainers' layout
(parallel.*: nodes, ranks, the scheduler's variables) is not its own, so a server started on a
rollout node of the trainers' SLURM job composes the trainers' recipe unchanged."""


def _section(key: str) -> str:
    """The scope section of a dotted key: ``data.reward`` for the reward keys (what
    rlbatch-score reads of data), else the key's group."""
    return "data.reward" if key.startswith("data.reward") else key.split(".", 1)[0]


def _in_scope(section: str, scope: frozenset[str]) -> bool:
    """``batching.train`` is in a scope that holds ``batching`` or ``batching.train``."""
    return section in scope or section.split(".", 1)[0] in scope


def generation_batch_size(cfg: RunConfig) -> int:
    """Samples generated per round (global): explicit, or global_batch_size * steps."""
    g = cfg.grpo
    if g.generation_batch_size is not None:
        return g.generation_batch_size
    return g.global_batch_size * (g.steps_per_generation or 1)


def lcm_micro_sizes(cfg: RunConfig) -> int:
    """service_target_bs of the LCM aggregation, in prompts: the runtime's own rule
    (rlbatch.grpo.lcm.AggregationPlan.service_target_bs)."""
    from rlbatch.grpo.lcm import aggregation_plan

    return aggregation_plan(cfg).service_target_bs


def _positive(key: str, value: float | int | None, errors: list[ConfigError]) -> None:
    if value is not None and value <= 0:
        errors.append(ConfigError(key, value, "must be positive"))


def _check_positive(cfg: RunConfig, errors: list[ConfigError], scope: frozenset[str]) -> None:
    m, r, g, t, p = cfg.model, cfg.rollout, cfg.grpo, cfg.trainer, cfg.parallel
    checks: dict[str, float | int | None] = {
        "model.num_layers": m.num_layers,
        "model.hidden_size": m.hidden_size,
        "model.ffn_hidden_size": m.ffn_hidden_size,
        "model.num_attention_heads": m.num_attention_heads,
        "model.num_query_groups": m.num_query_groups,
        "model.vocab_size": m.vocab_size,
        "model.max_position_embeddings": m.max_position_embeddings,
        "data.num_prompts": cfg.data.num_prompts,
        "data.max_prompt_len": cfg.data.max_prompt_len,
        "rollout.max_new_tokens": r.max_new_tokens,
        "rollout.temperature": r.temperature,
        "rollout.top_p": r.top_p,
        "rollout.micro_batch_size": r.micro_batch_size,
        "grpo.num_iterations": g.num_iterations,
        "grpo.global_batch_size": g.global_batch_size,
        "grpo.steps_per_generation": g.steps_per_generation,
        "grpo.generation_batch_size": g.generation_batch_size,
        "grpo.aggregation.rollout_micro_batch_size": g.aggregation.rollout_micro_batch_size,
        "grpo.aggregation.ref_logps_micro_batch_size": g.aggregation.ref_logps_micro_batch_size,
        "grpo.aggregation.old_logps_micro_batch_size": g.aggregation.old_logps_micro_batch_size,
        "grpo.aggregation.teacher_logps_micro_batch_size": (
            g.aggregation.teacher_logps_micro_batch_size
        ),
        "grpo.aggregation.train_micro_batch_size": g.aggregation.train_micro_batch_size,
        "grpo.aggregation.proceed_num_steps": g.aggregation.proceed_num_steps,
        "trainer.max_steps": t.max_steps,
        "trainer.timeout_s": t.timeout_s,
        "trainer.preempt_timeout_s": t.preempt_timeout_s,
        "data.reward_timeout_s": cfg.data.reward_timeout_s,
        "data.reward_abs_max": cfg.data.reward_abs_max,
        "trainer.num_threads": t.num_threads,
        "trainer.optim.lr": t.optim.lr,
        "trainer.checkpoint.keep_last": t.checkpoint.keep_last,
        "parallel.tp": p.tp,
        "parallel.pp": p.pp,
        "parallel.vpp": p.vpp,
        "parallel.dp": p.dp,
        "parallel.cp": p.cp,
        "parallel.nnodes": p.nnodes,
        "parallel.nproc_per_node": p.nproc_per_node,
        "parallel.microbatch_group_size_per_vp_stage": p.microbatch_group_size_per_vp_stage,
    }
    for key, value in checks.items():
        if not _in_scope(_section(key), scope):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            errors.append(ConfigError(key, value, "must be a finite number"))
        else:
            _positive(key, value, errors)
    non_negative = {
        "rollout.top_k": r.top_k,
        "grpo.beta": g.beta,
        "grpo.epsilon_low": g.epsilon_low,
        "grpo.epsilon_high": g.epsilon_high,
        "grpo.num_steps_async": g.num_steps_async,
        "grpo.max_staleness": g.max_staleness,
        "grpo.max_zero_advantage_steps": g.max_zero_advantage_steps,
        "trainer.optim.warmup_steps": t.optim.warmup_steps,
        "trainer.checkpoint.every_steps": t.checkpoint.every_steps,
        "trainer.checkpoint.every_minutes": t.checkpoint.every_minutes,
        "trainer.optim.clip_grad": t.optim.clip_grad,
    }
    for key, value in non_negative.items():
        if value < 0 and _in_scope(_section(key), scope):
            errors.append(ConfigError(key, value, "must be >= 0"))
    if "rollout" in scope and r.top_p > 1:
        errors.append(ConfigError("rollout.top_p", r.top_p, "must be in (0, 1]"))
    if "grpo" in scope and g.num_generations < 2:
        errors.append(
            ConfigError(
                "grpo.num_generations",
                g.num_generations,
                "GRPO needs >= 2 completions per prompt to form a group advantage: set it to 2+",
            )
        )


def _check_pass(name: str, cfg: RunConfig, errors: list[ConfigError]) -> None:
    key = f"batching.{name}"
    bp: BatchingPassConfig = getattr(cfg.batching, name)
    for field in ("max_tokens", "micro_batch_size", "sequence_length_round", "pool_size"):
        _positive(f"{key}.{field}", getattr(bp, field), errors)
    for field in ("cost_linear", "cost_quadratic"):
        value = getattr(bp, field)
        if value is not None and value < 0:
            errors.append(ConfigError(f"{key}.{field}", value, "must be >= 0 (or null: derived)"))
    tp_cp = cfg.parallel.tp * cfg.parallel.cp
    r = bp.sequence_length_round
    if r > 0 and r % tp_cp:
        fix = math.lcm(r, tp_cp)
        errors.append(
            ConfigError(
                f"{key}.sequence_length_round",
                r,
                f"must be a multiple of parallel.tp * parallel.cp = {tp_cp}: use {fix}",
            )
        )
    if 0 < bp.max_tokens < r:
        errors.append(
            ConfigError(f"{key}.max_tokens", bp.max_tokens, f"is below the round {r}: raise it")
        )


def _check_budget_fits(name: str, cfg: RunConfig, errors: list[ConfigError]) -> None:
    """The longest sequence training can produce fits the budget (or oversize says what to do).
    The other commands read their lengths from input; the planner names an oversize sample."""
    key = f"batching.{name}"
    bp: BatchingPassConfig = getattr(cfg.batching, name)
    r = max(bp.sequence_length_round, 1)
    longest = longest_sequence(cfg)
    padded_longest = -(-longest // r) * r
    if bp.mode != BatchingMode.fixed and bp.oversize == OversizePolicy.error:
        if 0 < bp.max_tokens < padded_longest:
            errors.append(
                ConfigError(
                    f"{key}.max_tokens",
                    bp.max_tokens,
                    f"is smaller than the longest possible sequence {longest_sequence_text(cfg)}"
                    f" = {longest} (rounded to {padded_longest}): raise "
                    f"it, or set {key}.oversize=isolate or truncate",
                )
            )


def _check_debug(cfg: RunConfig, errors: list[ConfigError]) -> None:
    total = world_size(cfg)
    if not 0 <= cfg.debug.fail_rank < max(total, 1):
        errors.append(ConfigError("debug.fail_rank", cfg.debug.fail_rank, f"must be < {total}"))
    d = cfg.debug
    if d.fail_sync is not None:
        fault = SyncFault(d.fail_sync).value
        if RolloutBackend(cfg.rollout.backend) != RolloutBackend.vllm_server:
            errors.append(
                ConfigError(
                    "debug.fail_sync",
                    fault,
                    "is a fault in a weight sync to rollout servers: set"
                    " rollout.backend=vllm_server, or debug.fail_sync=null",
                )
            )
        if d.fail_at_step is None:
            errors.append(
                ConfigError(
                    "debug.fail_sync",
                    fault,
                    "needs the step whose sync fails: set debug.fail_at_step",
                )
            )
        elif not 1 <= d.fail_at_step <= cfg.trainer.max_steps:
            errors.append(  # the run would end without the fault, and a test pass for nothing
                ConfigError(
                    "debug.fail_at_step",
                    d.fail_at_step,
                    f"names no step of this run (1 to trainer.max_steps={cfg.trainer.max_steps}),"
                    f" so debug.fail_sync={fault} would never fire: set a step in that range",
                )
            )
        check_sync_fault(cfg, fault, errors)


def _check_grpo(cfg: RunConfig, errors: list[ConfigError]) -> None:
    g, dp = cfg.grpo, cfg.parallel.dp
    if g.steps_per_generation is not None and g.generation_batch_size is not None:
        errors.append(
            ConfigError(
                "grpo.generation_batch_size",
                g.generation_batch_size,
                "is exclusive with grpo.steps_per_generation: set one of them to null",
            )
        )
    if g.num_generations >= 2:
        for key, size in (
            ("grpo.global_batch_size", g.global_batch_size),
            ("grpo.generation_batch_size", g.generation_batch_size),
        ):
            if size is not None and size > 0 and size % (g.num_generations * dp):
                errors.append(
                    ConfigError(
                        key,
                        size,
                        f"must be a multiple of grpo.num_generations * parallel.dp = "
                        f"{g.num_generations * dp} (whole groups on every DP rank)",
                    )
                )
    gen = generation_batch_size(cfg)
    if g.global_batch_size > 0 and gen > 0 and gen % g.global_batch_size:
        errors.append(
            ConfigError(
                "grpo.generation_batch_size",
                gen,
                f"must be a multiple of grpo.global_batch_size = {g.global_batch_size}",
            )
        )
    if g.num_generations >= 2 and dp > 0 and gen > 0:
        prompts_per_rank = gen // g.num_generations // dp
        target = lcm_micro_sizes(cfg)
        if prompts_per_rank and target > prompts_per_rank:
            errors.append(
                ConfigError(
                    "grpo.aggregation",
                    f"lcm({target})",
                    f"the LCM of the rollout/train (and fixed-size ref/old) micro sizes ({target} "
                    "prompts) exceeds "
                    f"the {prompts_per_rank} prompts each DP rank generates per round: choose "
                    f"micro sizes whose LCM divides {prompts_per_rank}",
                )
            )
    if g.num_steps_async > g.max_staleness:
        errors.append(
            ConfigError(
                "grpo.max_staleness",
                g.max_staleness,
                f"is below grpo.num_steps_async = {g.num_steps_async}: the producer could never "
                f"run ahead; raise max_staleness to >= {g.num_steps_async}",
            )
        )


def _check_positions(cfg: RunConfig, errors: list[ConfigError]) -> None:
    longest = longest_sequence(cfg)
    if cfg.model.max_position_embeddings < longest:
        errors.append(
            ConfigError(
                "model.max_position_embeddings",
                cfg.model.max_position_embeddings,
                f"is below {longest_sequence_text(cfg)} = {longest}",
            )
        )


def _check_env(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """Multi-turn limits, and a layout whose rollout keeps each row's KV cache across turns."""
    env = cfg.env
    if not env.path:
        return
    for key, value in (
        ("env.max_turns", env.max_turns),
        ("env.max_observation_tokens", env.max_observation_tokens),
        ("env.timeout_s", env.timeout_s),
        ("env.max_concurrency", env.max_concurrency),
    ):
        _positive(key, value, errors)
    if not 0.0 <= env.max_error_fraction <= 1.0:
        errors.append(
            ConfigError(
                "env.max_error_fraction",
                env.max_error_fraction,
                "is a fraction of the episodes: set it in [0, 1]",
            )
        )
    if env.max_total_tokens <= cfg.data.max_prompt_len:
        errors.append(
            ConfigError(
                "env.max_total_tokens",
                env.max_total_tokens,
                f"leaves no room for a response after data.max_prompt_len ="
                f" {cfg.data.max_prompt_len}: raise it (prompt + every turn and observation)",
            )
        )
    p, r = cfg.parallel, cfg.rollout
    if RolloutBackend(r.backend) in (RolloutBackend.vllm, RolloutBackend.vllm_server):
        return  # a full vLLM engine takes each turn as a new request, at any layout
    needs: dict[str, tuple[object, object]] = {
        "parallel.tp": (p.tp, 1),
        "parallel.pp": (p.pp, 1),
        "parallel.cp": (p.cp, 1),
        "rollout.kv_cache": (r.kv_cache, True),
        "rollout.backend": (r.backend.name, "megatron"),
    }
    for key, (got, wanted) in needs.items():
        if got != wanted:
            errors.append(
                ConfigError(
                    key,
                    got,
                    f"multi-turn rollouts (env.path set) run on the built-in engine's per-row KV"
                    f" cache, which needs {key}={str(wanted).lower()}: set it, or"
                    " rollout.backend=vllm (any layout), or env.path=null",
                )
            )
    errors += per_row_decoder_errors(cfg, "multi-turn rollouts (env.path)", records_routing=True)


def _check_data(cfg: RunConfig, errors: list[ConfigError]) -> None:
    # env.agent.verifiers: its taskset is the dataset, data.source is not read
    if cfg.data.source != DataSource.builtin and not cfg.env.agent.verifiers:
        if not cfg.data.path:
            errors.append(
                ConfigError(
                    "data.path",
                    None,
                    f"data.source={cfg.data.source.name} needs a file: set data.path=FILE",
                )
            )
        elif cfg.data.source == DataSource.hf_disk:
            if not Path(cfg.data.path).is_dir():
                errors.append(
                    ConfigError("data.path", cfg.data.path, "no such directory (HF save_to_disk)")
                )
        elif Path(cfg.data.path).is_dir():
            errors.append(
                ConfigError(
                    "data.path",
                    cfg.data.path,
                    f"is a directory: data.source={cfg.data.source.name} reads one file (a "
                    "Hugging Face save_to_disk directory needs data.source=hf_disk)",
                )
            )
        elif not Path(cfg.data.path).is_file():
            errors.append(ConfigError("data.path", cfg.data.path, "no such file"))


TRACKING_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
"""logging.<sink> -> the package it needs (each an optional extra of the same name)."""


def _check_tracking(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """An enabled tracking sink needs its package (TensorBoard only warns: rlbatch-train)."""
    import importlib.util

    for sink, package in TRACKING_PACKAGES.items():
        if getattr(cfg.logging, sink).enabled and importlib.util.find_spec(package) is None:
            errors.append(
                ConfigError(
                    f"logging.{sink}.enabled",
                    True,
                    f"needs the {package} package: pip install 'rlbatch[{sink}]', or set"
                    f" logging.{sink}.enabled=false",
                )
            )


def _check_resume(cfg: RunConfig, errors: list[ConfigError]) -> None:
    resume = cfg.trainer.resume
    if resume not in ("none", "auto") and not Path(resume).exists():
        errors.append(
            ConfigError("trainer.resume", resume, "must be none, auto, or an existing checkpoint")
        )


RULES: tuple[Rule, ...] = (
    Rule(frozenset({"batching.train", "parallel"}), lambda c, e: _check_pass("train", c, e)),
    Rule(frozenset({"batching.infer", "parallel"}), lambda c, e: _check_pass("infer", c, e)),
    Rule(
        frozenset({"batching.train", "data", "rollout", "env"}),
        lambda c, e: _check_budget_fits("train", c, e),
    ),
    Rule(
        frozenset({"batching.infer", "data", "rollout", "env"}),
        lambda c, e: _check_budget_fits("infer", c, e),
    ),
    Rule(frozenset({"parallel"}), check_layout),
    Rule(frozenset({"parallel"}), check_world),
    Rule(frozenset({"model"}), check_model_shape),
    Rule(frozenset({"model", "parallel"}), check_model_split),
    Rule(frozenset({"parallel"}), check_expert_layout),
    Rule(frozenset({"model", "parallel"}), check_gloo_layout),
    Rule(frozenset({"model"}), check_moe_model),
    Rule(frozenset({"model", "rollout"}), check_moe_backend),
    Rule(frozenset({"model", "logprobs"}), check_moe_scoring),
    Rule(frozenset({"model", "parallel", "rollout", "env", "grpo"}), check_moe),
    Rule(frozenset({"model", "grpo", "parallel", "rollout"}), check_routing_replay),
    Rule(frozenset({"debug", "grpo", "parallel", "rollout"}), _check_debug),
    Rule(frozenset({"debug", "rollout", "env"}), check_response_lengths),
    Rule(frozenset({"grpo", "parallel", "rollout"}), _check_grpo),
    Rule(frozenset({"grpo", "rollout"}), lambda c, e: e.extend(objective_errors(c))),
    Rule(frozenset({"grpo", "parallel", "rollout"}), lambda c, e: e.extend(distill_errors(c))),
    Rule(frozenset({"grpo", "rollout", "parallel", "env"}), check_partial_rollouts),
    Rule(frozenset({"model", "data", "rollout", "env"}), _check_positions),
    Rule(frozenset({"env", "data", "rollout", "parallel"}), _check_env),
    Rule(frozenset({"env", "data", "rollout", "parallel", "grpo", "eval", "debug"}), check_agent),
    Rule(
        frozenset({"model", "data", "rollout", "env", "eval"}),
        lambda c, e: check_vllm(c, e, (longest_sequence(c), longest_sequence_text(c))),
    ),
    Rule(frozenset({"data"}), _check_data),
    Rule(frozenset({"model"}), check_model_paths),
    Rule(frozenset({"model", "rollout"}), check_lora),
    Rule(frozenset({"trainer"}), _check_resume),
    Rule(frozenset({"logging"}), _check_tracking),
    Rule(frozenset({"eval"}), check_eval),
)


def validate(cfg: RunConfig, scope: frozenset[str] = TRAIN_SCOPE) -> list[ConfigError]:
    """Every cross-field error of ``cfg`` (empty when valid) among the rules whose sections are
    all in ``scope``: a command checks what it uses (rlbatch-plan builds no model)."""
    errors: list[ConfigError] = []
    _check_positive(cfg, errors, scope)
    for rule in RULES:
        if all(_in_scope(section, scope) for section in rule.reads):
            rule.check(cfg, errors)
    return errors


def check(
    cfg: RunConfig,
    structural: list[ConfigError] | None = None,
    scope: frozenset[str] = TRAIN_SCOPE,
    found: list[ConfigError] | None = None,
) -> RunConfig:
    """Raise ConfigErrors listing every error; return ``cfg`` when valid.

    ``structural`` errors (from rlbatch.config.load.check_structure, and those that likewise
    leave a key at its default: the job scheduler's environment, a checkpoint's architecture)
    come first; a cross-field error on such a key is not repeated (its value fell back to the
    default, so the rule would judge a value the user did not give). ``found`` are errors other
    checks made of the user's own values (rlbatch-train's dataset, reward and environment
    checks): they hide nothing, since a rule on the same key may name another problem; only
    an exact repeat is dropped.
    """
    errors = list(structural or [])
    fell_back = {e.key for e in errors}
    for e in [*(found or []), *(e for e in validate(cfg, scope) if e.key not in fell_back)]:
        if e not in errors:
            errors.append(e)
    if errors:
        raise ConfigErrors(errors)
    return cfg
