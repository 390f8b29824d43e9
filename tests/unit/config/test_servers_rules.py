"""rollout.servers checks (rollout.backend=vllm_server) before launch: each bad setting is an
error naming its dotted key, all reported at once; what servers do not run in this release is
refused with its fix."""

from __future__ import annotations

import pytest

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import RolloutBackend, RunConfig, ServerFailure
from rlbatch.config.servers_rules import check_servers


def _errors(**servers) -> dict[str, ConfigError]:
    cfg = RunConfig()
    cfg.rollout.backend = RolloutBackend.vllm_server
    for key, value in servers.items():
        setattr(cfg.rollout.servers, key, value)
    errors: list[ConfigError] = []
    check_servers(cfg, errors)
    return {e.key: e for e in errors}


def test_a_server_run_needs_servers():
    errors = _errors()
    assert set(errors) == {"rollout.servers.urls"}
    assert "rollout.servers.count=N" in errors["rollout.servers.urls"].message


def test_urls_and_count_are_exclusive_and_urls_must_be_http():
    errors = _errors(urls=["http://a:1", "node7:8000"], count=2)
    assert set(errors) == {"rollout.servers.count", "rollout.servers.urls"}
    assert errors["rollout.servers.urls"].value == "node7:8000"


@pytest.mark.parametrize(
    "key, value",
    [("port", 0), ("timeout_s", 0.0), ("start_timeout_s", -1.0), ("max_concurrency", 0),
     ("probe_tokens", -1), ("probe_tolerance", 0.0)],
)  # fmt: skip
def test_ranges_name_their_key(key, value):
    assert f"rollout.servers.{key}" in _errors(urls=["http://a:1"], **{key: value})


def test_async_partial_rollouts_and_lora_are_refused_on_servers():
    cfg = RunConfig()
    cfg.rollout.backend = RolloutBackend.vllm_server
    cfg.rollout.servers.urls = ["http://a:1"]
    cfg.grpo.num_steps_async = 1
    cfg.grpo.partial_rollouts = True
    cfg.model.lora.rank = 8
    errors: list[ConfigError] = []
    check_servers(cfg, errors)
    assert {e.key for e in errors} == {
        "grpo.num_steps_async", "grpo.partial_rollouts", "model.lora.rank"
    }  # fmt: skip


def test_server_keys_on_another_backend_are_errors():
    cfg = RunConfig()
    cfg.rollout.servers.urls = ["http://a:1"]
    errors: list[ConfigError] = []
    check_servers(cfg, errors)
    assert [e.key for e in errors] == ["rollout.servers.urls"]
    assert "rollout.backend=vllm_server" in errors[0].message


def test_on_failure_continue_on_another_backend_is_an_error_with_its_fix():
    """rollout.servers.on_failure=continue would be ignored by the colocated engines: refused,
    with the other server keys, naming the value and both fixes."""
    cfg = RunConfig()
    cfg.rollout.servers.count = 2
    cfg.rollout.servers.on_failure = ServerFailure["continue"]
    errors: list[ConfigError] = []
    check_servers(cfg, errors)
    assert [e.key for e in errors] == ["rollout.servers.count", "rollout.servers.on_failure"]
    assert errors[1].value == "continue"
    assert "rollout.servers.on_failure=stop" in errors[1].message
    assert "rollout.backend=vllm_server" in errors[1].message


def test_a_bad_on_failure_value_names_the_key_and_the_choices():
    from rlbatch.config.load import check_structure

    _, errors = check_structure({"rollout": {"servers": {"on_failure": "retry"}}})
    (error,) = errors
    assert error.key == "rollout.servers.on_failure" and error.value == "retry"
    assert "stop" in error.message and "continue" in error.message
