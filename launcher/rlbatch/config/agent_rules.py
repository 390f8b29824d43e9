"""The cross-field rules of agent harnesses (env.harness, env.agent.*; docs/agents.md):
rlbatch.config.validate runs :func:`check_agent`. Pure: no torch.

What runs today is stated by what is refused: the built-in engine's per-row decoding
(rollout.backend=megatron, KV cache on) or the run's vLLM servers (vllm_server), tp = pp = cp =
1, rounds generated in the training process between steps: run-ahead (grpo.num_steps_async)
generates the due rounds inline, at the policy version the schedule names
(grpo.overlap_generation=false: a harness's endpoint and event loop are the trainer
process's), and no partial-rollout stream. Each refusal names its fix.
"""

from __future__ import annotations

from rlbatch.config.enums import ChatTemplate, RewardKind, RolloutBackend
from rlbatch.config.env import harness_key, harness_spec
from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import RunConfig
from rlbatch.config.streaming import per_row_decoder_errors

SERVED_BY = (RolloutBackend.megatron, RolloutBackend.vllm_server)
"""The rollout backends a harness's calls are decoded on."""


def check_agent(cfg: RunConfig, errors: list[ConfigError]) -> None:
    env = cfg.env
    _check_openenv_keys(cfg, errors)
    _check_verifiers_keys(cfg, errors)
    _check_eval_verifiers(cfg, errors)
    if not harness_spec(env):
        return
    key = harness_key(env)
    spec, what = {
        "env.harness": (env.harness, "a harness"),
        "env.agent.openenv_url": (env.agent.openenv_url, "the OpenEnv environment"),
        "env.agent.verifiers": (env.agent.verifiers, "the verifiers environment"),
    }[key]
    if env.path:
        errors.append(
            ConfigError(
                "env.path",
                env.path,
                f"and {key}={spec} are two ways to run episodes: set one of them (env.path=null"
                f" for {what})",
            )
        )
    if ChatTemplate(cfg.data.chat_template) == ChatTemplate.none:
        errors.append(
            ConfigError(
                "data.chat_template",
                "none",
                "renders no chat messages, and a harness sends messages: set"
                " data.chat_template=qwen or model",
            )
        )
    for key, value in (
        ("env.max_turns", env.max_turns),
        ("env.max_concurrency", env.max_concurrency),
        ("env.agent.episode_timeout_s", env.agent.episode_timeout_s),
        ("env.agent.block_timeout_s", env.agent.block_timeout_s),
    ):
        if not value > 0:
            errors.append(ConfigError(key, value, "must be > 0"))
    if not 0 <= env.agent.port <= 65535:
        errors.append(
            ConfigError("env.agent.port", env.agent.port, "must be a TCP port, or 0 for any")
        )
    if env.max_total_tokens <= cfg.data.max_prompt_len:
        errors.append(
            ConfigError(
                "env.max_total_tokens",
                env.max_total_tokens,
                f"leaves no room for a completion after data.max_prompt_len ="
                f" {cfg.data.max_prompt_len}: raise it (a harness's prompt and every call)",
            )
        )
    _check_layout(cfg, errors)


def _check_openenv_keys(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """env.agent.openenv_url is a harness of its own (exclusive with env.harness), and
    env.agent.openenv_action means nothing without it."""
    agent = cfg.env.agent
    if agent.openenv_url and cfg.env.harness:
        errors.append(
            ConfigError(
                "env.agent.openenv_url",
                agent.openenv_url,
                f"and env.harness={cfg.env.harness} are two ways to run episodes (the OpenEnv"
                " server's episodes run through a built-in harness): set one of them",
            )
        )
    if agent.openenv_url and not agent.openenv_url.startswith(("http://", "https://")):
        errors.append(
            ConfigError(
                "env.agent.openenv_url",
                agent.openenv_url,
                "must be the server's http:// or https:// address (e.g. http://127.0.0.1:8000)",
            )
        )
    if agent.openenv_action and not agent.openenv_url:
        errors.append(
            ConfigError(
                "env.agent.openenv_action",
                agent.openenv_action,
                "turns replies into an OpenEnv environment's actions, and env.agent.openenv_url"
                " is not set: set it, or env.agent.openenv_action=null",
            )
        )


def _check_verifiers_keys(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """env.agent.verifiers is a harness of its own (exclusive with env.harness and
    env.agent.openenv_url), its taskset is the dataset (data.path is not read), and evaluation
    reads the held-out tasks of eval.verifiers (required with eval.every_steps > 0)."""
    name = cfg.env.agent.verifiers
    if not name:
        return
    agent = cfg.env.agent
    for key, seconds, default, what in (
        ("env.agent.verifiers_port_timeout_s", agent.verifiers_port_timeout_s, 90,
         "a tool server has to report its port"),
        ("env.agent.verifiers_check_timeout_s", agent.verifiers_check_timeout_s, 120,
         "the pre-launch check waits for the taskset's tool servers"),
    ):  # fmt: skip
        if not seconds > 0:
            errors.append(
                ConfigError(
                    key,
                    seconds,
                    f"must be > 0 (the seconds {what}): set a positive number of seconds"
                    f" (default {default})",
                )
            )
    for key, value in (("env.harness", cfg.env.harness), ("env.agent.openenv_url", cfg.env.agent.openenv_url)):  # fmt: skip
        if value:
            errors.append(
                ConfigError(
                    "env.agent.verifiers",
                    name,
                    f"and {key}={value} are two ways to run episodes (the verifiers"
                    " environment's episodes run through a built-in harness): set one of them",
                )
            )
    if cfg.data.path is not None:
        errors.append(
            ConfigError(
                "data.path",
                cfg.data.path,
                f"is not read with env.agent.verifiers={name}: the environment's taskset is the"
                " dataset; set data.path=null",
            )
        )
    if RewardKind(cfg.data.reward) == RewardKind.task and not cfg.data.reward_fn:
        errors.append(
            ConfigError(
                "data.reward",
                "task",
                f"is the built-in task's reward, and env.agent.verifiers={name}'s tasks are the"
                " rows: set data.reward=none (the environment's rewards alone) or a reward that"
                " reads the rows",
            )
        )
    if cfg.eval.every_steps > 0 and not cfg.eval.verifiers:
        errors.append(eval_needs_tasks(name, f"eval.every_steps={cfg.eval.every_steps}"))
    if cfg.eval.verifiers and cfg.eval.data.path is not None:
        errors.append(
            ConfigError(
                "eval.data.path",
                cfg.eval.data.path,
                f"is not read with eval.verifiers={cfg.eval.verifiers}: that environment's"
                " taskset is the held-out set; set eval.data.path=null",
            )
        )


def eval_needs_tasks(name: str, why: str) -> ConfigError:
    """The refusal of evaluating env.agent.verifiers=``name`` without eval.verifiers (``why``:
    what asked for the evaluation)."""
    return ConfigError(
        "eval.verifiers",
        None,
        f"{why} evaluates env.agent.verifiers={name} on held-out tasks, and a verifiers 0.4"
        " taskset has none of its own (verifiers evaluates the tasks a taskset loads): set"
        " eval.verifiers to an environment whose taskset holds them (e.g. a copy of the environment"
        " file under another name, its module name differing, whose taskset loads other tasks;"
        " the training taskset's tasks are not held out)"
        + (", or eval.every_steps=0" if why.startswith("eval.every_steps") else ""),
    )


def _check_eval_verifiers(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """eval.verifiers evaluates a verifiers run: it needs env.agent.verifiers (the episodes run
    through the built-in verifiers harness that key selects)."""
    if cfg.eval.verifiers and not cfg.env.agent.verifiers:
        errors.append(
            ConfigError(
                "eval.verifiers",
                cfg.eval.verifiers,
                "evaluates a run that trains on a verifiers environment, and env.agent.verifiers"
                " is not set: set env.agent.verifiers (the training environment), or"
                " eval.verifiers=null to evaluate on eval.data",
            )
        )


def _check_layout(cfg: RunConfig, errors: list[ConfigError]) -> None:
    p, r, g = cfg.parallel, cfg.rollout, cfg.grpo
    key = harness_key(cfg.env)
    backend = RolloutBackend(r.backend)
    if backend not in SERVED_BY:
        errors.append(
            ConfigError(
                "rollout.backend",
                backend.value,
                f"agent harnesses ({key}) run on the built-in engine (megatron) or on vLLM"
                " servers (vllm_server) today: set rollout.backend=megatron or vllm_server, or"
                f" {key}=null",
            )
        )
    needs: dict[str, tuple[object, object]] = {
        "parallel.tp": (p.tp, 1),
        "parallel.pp": (p.pp, 1),
        "parallel.cp": (p.cp, 1),
        "grpo.partial_rollouts": (g.partial_rollouts, False),
        "debug.response_length_median": (cfg.debug.response_length_median, 0),
    }
    if backend == RolloutBackend.megatron:
        needs["rollout.kv_cache"] = (r.kv_cache, True)
    if min(g.num_steps_async, g.max_staleness) > 0:  # run-ahead: inline, in this process
        needs["grpo.overlap_generation"] = (g.overlap_generation, False)
    harness = key
    for key, (got, wanted) in needs.items():
        if got != wanted:
            errors.append(
                ConfigError(
                    key,
                    got,
                    f"agent harnesses ({harness}) run between training steps, one process"
                    f" per model replica, today, which needs {key}={str(wanted).lower()}: set"
                    f" it, or {harness}=null",
                )
            )
    if backend == RolloutBackend.megatron:
        errors += per_row_decoder_errors(cfg, f"agent harnesses ({harness})")
