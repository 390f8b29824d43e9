"""Agent harness checks (env.harness) before launch: what harnesses do not run on is refused
naming its key and fix, all at once; what they run on passes."""

from __future__ import annotations

from rlbatch.config.agent_rules import check_agent
from rlbatch.config.errors import ConfigError
from rlbatch.config.evaluation import EvalDataConfig
from rlbatch.config.schema import ChatTemplate, RewardKind, RolloutBackend, RunConfig


def _errors(**changes) -> dict[str, ConfigError]:
    cfg = RunConfig()
    cfg.env.harness = "harness.py:run"
    cfg.data.chat_template = ChatTemplate.qwen
    cfg.env.max_total_tokens = cfg.data.max_prompt_len + 64
    for key, value in changes.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    errors: list[ConfigError] = []
    check_agent(cfg, errors)
    return {e.key: e for e in errors}


def test_harnesses_run_on_the_built_in_engine_and_on_vllm_servers():
    assert _errors() == {}
    assert _errors(rollout__backend=RolloutBackend.vllm_server) == {}
    # the built-in engine's KV cache is the built-in engine's only
    assert _errors(rollout__backend=RolloutBackend.vllm_server, rollout__kv_cache=False) == {}
    assert set(_errors(rollout__kv_cache=False)) == {"rollout.kv_cache"}


def test_other_backends_and_layouts_are_refused_with_their_fix():
    for backend in (RolloutBackend.vllm, RolloutBackend.megatron_dynamic):
        errors = _errors(rollout__backend=backend)
        assert set(errors) == {"rollout.backend"}
        assert "rollout.backend=megatron or vllm_server" in errors["rollout.backend"].message
    errors = _errors(parallel__tp=2, grpo__partial_rollouts=True)
    assert set(errors) == {"parallel.tp", "grpo.partial_rollouts"}


def test_run_ahead_generates_inline():
    """grpo.num_steps_async > 0 runs with a harness when its rounds generate in the training
    process (grpo.overlap_generation=false), and is refused with that fix otherwise."""
    errors = _errors(grpo__num_steps_async=1)
    assert set(errors) == {"grpo.overlap_generation"}
    assert "grpo.overlap_generation=false" in errors["grpo.overlap_generation"].message
    assert _errors(grpo__num_steps_async=1, grpo__overlap_generation=False) == {}
    assert _errors(grpo__num_steps_async=1, grpo__max_staleness=0) == {}  # no lag: synchronous


def _openenv_errors(**agent) -> dict[str, ConfigError]:
    cfg = RunConfig()
    cfg.data.chat_template = ChatTemplate.qwen
    cfg.env.max_total_tokens = cfg.data.max_prompt_len + 64
    for name, value in agent.items():
        setattr(cfg.env if name == "harness" else cfg.env.agent, name, value)
    cfg.rollout.backend = RolloutBackend.vllm  # a harness's layout rules apply to OpenEnv too
    errors: list[ConfigError] = []
    check_agent(cfg, errors)
    return {e.key: e for e in errors}


def test_openenv_is_a_harness_of_its_own():
    """env.agent.openenv_url runs episodes through the built-in OpenEnv harness: exclusive with
    env.harness, an http(s) address, under the harness's layout rules (its fixes naming
    env.agent.openenv_url); env.agent.openenv_action without it would do nothing."""
    errors = _openenv_errors(openenv_url="http://127.0.0.1:8000")
    assert set(errors) == {"rollout.backend"}
    assert "env.agent.openenv_url=null" in errors["rollout.backend"].message
    errors = _openenv_errors(openenv_url="http://h:1", harness="h.py:run")
    assert set(errors) == {"env.agent.openenv_url", "rollout.backend"}
    assert "env.harness=h.py:run are two ways" in errors["env.agent.openenv_url"].message
    assert "http://" in str(_openenv_errors(openenv_url="localhost:1")["env.agent.openenv_url"])
    errors = _openenv_errors(openenv_action="act.py:act")
    assert set(errors) == {"env.agent.openenv_action"}  # no harness at all: no layout rule
    assert "env.agent.openenv_url is not set" in errors["env.agent.openenv_action"].message


def _verifiers_errors(**changes) -> dict[str, ConfigError]:
    cfg = RunConfig()
    cfg.data.chat_template = ChatTemplate.qwen
    cfg.data.reward = RewardKind.none
    cfg.env.max_total_tokens = cfg.data.max_prompt_len + 64
    cfg.env.agent.verifiers = "sums.py"
    for key, value in changes.items():
        section, name = key.split("__")
        target = {"env": cfg.env, "agent": cfg.env.agent}.get(section) or getattr(cfg, section)
        setattr(target, name, value)
    errors: list[ConfigError] = []
    check_agent(cfg, errors)
    return {e.key: e for e in errors}


def test_verifiers_is_a_harness_whose_taskset_is_the_dataset():
    """env.agent.verifiers runs episodes through the built-in verifiers harness: exclusive with
    env.harness and env.agent.openenv_url, its taskset the dataset (data.path refused, the
    built-in task's reward refused), evaluated on the held-out environment eval.verifiers
    (required with eval.every_steps > 0; it needs env.agent.verifiers, and eval.data.path is not
    read), under the harness's layout rules (their fixes naming env.agent.verifiers)."""
    assert _verifiers_errors() == {}
    errors = _verifiers_errors(env__harness="h.py:run", agent__openenv_url="http://h:1")
    assert set(errors) == {"env.agent.verifiers", "env.agent.openenv_url"}
    assert "are two ways to run episodes" in errors["env.agent.verifiers"].message
    errors = _verifiers_errors(data__path="rows.jsonl", data__reward=RewardKind.task)
    assert set(errors) == {"data.path", "data.reward"}
    assert "set data.path=null" in errors["data.path"].message
    assert "set data.reward=none" in errors["data.reward"].message
    assert _verifiers_errors(data__reward=RewardKind.math) == {}  # a reward of the rows adds
    errors = _verifiers_errors(eval__every_steps=5, rollout__backend=RolloutBackend.vllm)
    assert set(errors) == {"eval.verifiers", "rollout.backend"}
    assert "env.agent.verifiers=null" in errors["rollout.backend"].message
    held_out = errors["eval.verifiers"].message
    assert "eval.every_steps=5 evaluates env.agent.verifiers=sums.py" in held_out
    assert "set eval.verifiers to an environment" in held_out and "eval.every_steps=0" in held_out
    assert _verifiers_errors(eval__every_steps=5, eval__verifiers="held.py") == {}
    errors = _verifiers_errors(eval__verifiers="held.py", agent__verifiers=None)
    assert set(errors) == {"eval.verifiers"}
    assert "env.agent.verifiers is not set" in errors["eval.verifiers"].message
    cfg_errors = _verifiers_errors(eval__verifiers="held.py", eval__data=EvalDataConfig(path="x.jsonl"))  # fmt: skip
    assert set(cfg_errors) == {"eval.data.path"}
    assert "set eval.data.path=null" in cfg_errors["eval.data.path"].message
    errors = _verifiers_errors(env__path="env.py:Env")
    assert "the verifiers environment" in errors["env.path"].message
