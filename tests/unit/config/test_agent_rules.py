"""Agent harness checks (env.harness) before launch: what harnesses do not run on is refused
naming its key and fix, all at once; what they run on passes."""

from __future__ import annotations

from rlbatch.config.agent_rules import check_agent
from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import ChatTemplate, RolloutBackend, RunConfig


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
