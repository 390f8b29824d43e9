"""rollout.servers checks (rollout.backend=vllm_server) before launch: each bad setting is an
error naming its dotted key, all reported at once; what servers do not run in this release is
refused with its fix."""

from __future__ import annotations

import pytest

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import (
    RolloutBackend,
    RunConfig,
    ServerFailure,
    ServerTransfer,
    ServerUpdate,
)
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


def _server_run(**grpo) -> RunConfig:
    cfg = RunConfig()
    cfg.rollout.backend = RolloutBackend.vllm_server
    cfg.rollout.servers.urls = ["http://a:1"]
    for key, value in grpo.items():
        setattr(cfg.grpo, key, value)
    return cfg


def _keys(cfg: RunConfig) -> dict[str, ConfigError]:
    errors: list[ConfigError] = []
    check_servers(cfg, errors)
    return {e.key: e for e in errors}


def test_a_probe_longer_than_the_servers_sequences_is_an_error_with_its_fix():
    """The probe scores 8 prompt tokens + probe_tokens and samples 1: at max_model_len 64,
    55 tokens fit (64 tokens in all) and 56 do not (vLLM would refuse it with HTTP 400 at the
    first sync, after the first step)."""

    def errors(probe_tokens: int) -> dict[str, ConfigError]:
        cfg = RunConfig()
        cfg.rollout.backend = RolloutBackend.vllm_server
        cfg.rollout.servers.urls = ["http://a:1"]
        cfg.rollout.servers.probe_tokens = probe_tokens
        cfg.rollout.vllm.max_model_len = 64
        out: list[ConfigError] = []
        check_servers(cfg, out)
        return {e.key: e for e in out}

    assert errors(55) == {}
    assert errors(0) == {}
    error = errors(56)["rollout.servers.probe_tokens"]
    assert error.value == 56
    assert "a sequence of 65 tokens" in error.message and "longer than the 64" in error.message
    assert "rollout.servers.probe_tokens<=55" in error.message


@pytest.mark.parametrize(
    "dtype, below, enough", [("bfloat16", 1e-3, 5e-2), ("float16", 1e-3, 5e-3), ("float32", 1e-6, 5e-6)]
)  # fmt: skip
def test_a_probe_tolerance_below_the_engines_noise_is_an_error_with_its_fix(dtype, below, enough):
    """A bfloat16 server of the right weights is ~3e-3 off the trainer: the default 1e-3 would
    stop the run after its first step, blaming the server's model."""

    def errors(tolerance: float, probe_tokens: int = 4) -> dict[str, ConfigError]:
        cfg = RunConfig()
        cfg.rollout.backend = RolloutBackend.vllm_server
        cfg.rollout.servers.urls = ["http://a:1"]
        cfg.rollout.vllm.dtype = dtype
        cfg.rollout.servers.probe_tolerance = tolerance
        cfg.rollout.servers.probe_tokens = probe_tokens
        out: list[ConfigError] = []
        check_servers(cfg, out)
        return {e.key: e for e in out}

    assert errors(enough) == {}
    assert errors(below, probe_tokens=0) == {}
    error = errors(below)["rollout.servers.probe_tolerance"]
    assert error.value == below
    assert f"rollout.servers.probe_tolerance>={enough:g}" in error.message
    assert f"rollout.vllm.dtype={dtype}" in error.message


def test_async_and_partial_rollouts_run_on_servers_lora_is_refused():
    cfg = _server_run(num_steps_async=1, max_staleness=2, partial_rollouts=True)
    cfg.rollout.servers.on_update = ServerUpdate.keep
    assert _keys(cfg) == {}
    cfg.model.lora.rank = 8
    assert set(_keys(cfg)) == {"model.lora.rank"}


def test_overlapping_generation_runs_with_replicas_but_not_with_evaluation():
    """DP rank 0's generation worker pushes and the other replicas' workers wait for its
    label: dp 2 overlaps; the trainer's evaluation would swap the servers' weights under the
    workers, refused naming the inline fix."""
    cfg = _server_run(num_steps_async=1)
    cfg.parallel.dp = 2
    assert _keys(cfg) == {}
    cfg.eval.every_steps = 5
    errors = _keys(cfg)
    assert set(errors) == {"eval.every_steps"}
    assert "grpo.overlap_generation=false" in errors["eval.every_steps"].message
    cfg.grpo.overlap_generation = False  # inline run-ahead: one process, one pusher at a time
    assert _keys(cfg) == {}
    cfg.grpo.overlap_generation = True
    cfg.grpo.num_steps_async = 0  # synchronous: no worker
    assert _keys(cfg) == {}


def test_keep_without_partial_rollouts_is_an_error_naming_both_fixes():
    cfg = _server_run(num_steps_async=1)
    cfg.rollout.servers.on_update = ServerUpdate.keep
    error = _keys(cfg)["rollout.servers.on_update"]
    assert error.value == "keep"
    assert "grpo.partial_rollouts=true" in error.message
    assert "rollout.servers.on_update=abort" in error.message


def test_every_servers_key_is_set_from_the_command_line():
    """conf/rollout/default.yaml lists every rollout.servers key: one missing there is refused
    by Hydra ("Key 'max_resubmits' is not in struct") whatever the schema says."""
    import dataclasses
    from pathlib import Path

    import yaml

    from rlbatch.cli.common import compose
    from rlbatch.config.vllm import ServersConfig

    conf = Path(__file__).parents[3] / "conf" / "rollout" / "default.yaml"
    listed = set(yaml.safe_load(conf.read_text())["servers"])
    assert {f.name for f in dataclasses.fields(ServersConfig)} <= listed
    base = [
        "+recipe=grpo_qwen", "model.num_attention_heads=2", "model.num_query_groups=2",
        "rollout.backend=vllm_server", "rollout.servers.urls=[http://a:1]",
    ]  # fmt: skip
    cfg = compose([*base, "rollout.servers.max_resubmits=2"], "t")
    assert cfg.rollout.servers.max_resubmits == 2


def test_on_update_takes_abort_or_keep_from_the_command_line(capsys):
    from rlbatch.cli.common import compose

    base = [
        "+recipe=grpo_qwen", "model.num_attention_heads=2", "model.num_query_groups=2",
        "rollout.backend=vllm_server", "rollout.servers.urls=[http://a:1]",
    ]  # fmt: skip
    partial = ["grpo.partial_rollouts=true", "grpo.num_steps_async=1", "grpo.max_staleness=2"]
    cfg = compose([*base, *partial, "rollout.servers.on_update=keep"], "t")
    assert cfg.rollout.servers.on_update == ServerUpdate.keep
    with pytest.raises(SystemExit):
        compose([*base, "rollout.servers.on_update=drop"], "t")
    assert "rollout.servers.on_update=drop: is not one of: abort, keep" in capsys.readouterr().err


def test_server_keys_on_another_backend_are_errors():
    cfg = RunConfig()
    cfg.rollout.servers.urls = ["http://a:1"]
    errors: list[ConfigError] = []
    check_servers(cfg, errors)
    assert [e.key for e in errors] == ["rollout.servers.urls"]
    assert "rollout.backend=vllm_server" in errors[0].message


@pytest.mark.parametrize(
    "key, value", [("max_resubmits", 2), ("probe_tokens", 0), ("probe_tolerance", 5e-2)]
)  # fmt: skip
def test_resubmit_and_probe_keys_on_another_backend_are_errors(key, value):
    """No server aborts a row or is probed on another backend: the key would be ignored."""
    cfg = RunConfig()
    setattr(cfg.rollout.servers, key, value)
    errors: list[ConfigError] = []
    check_servers(cfg, errors)
    assert [(e.key, e.value) for e in errors] == [(f"rollout.servers.{key}", value)]
    assert "rollout.backend=vllm_server" in errors[0].message
    assert f"not {RunConfig().rollout.backend.value}" in errors[0].message


def test_partial_rollouts_on_servers_at_tp_2_are_refused_with_their_fix():
    """The stream runs one segment loop per data-parallel rank: tp = pp = cp = 1."""
    from rlbatch.config.streaming import check_partial_rollouts

    cfg = _server_run(num_steps_async=1, max_staleness=2, partial_rollouts=True)
    errors: list[ConfigError] = []
    check_partial_rollouts(cfg, errors)
    assert errors == []
    cfg.parallel.tp = 2
    check_partial_rollouts(cfg, errors)
    (error,) = errors
    assert error.key == "parallel.tp" and "parallel.tp=1" in error.message
    assert "grpo.partial_rollouts=false" in error.message


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


def test_on_update_keep_on_another_backend_is_an_error_with_its_fix():
    """rollout.servers.on_update=keep would be ignored by the colocated engines (their partial
    rollouts always recompute a continuing row's prefix): refused, naming the value and both
    fixes, as on_failure is."""
    cfg = RunConfig()
    cfg.rollout.backend = RolloutBackend.vllm
    cfg.grpo.partial_rollouts = True
    cfg.rollout.servers.on_update = ServerUpdate.keep
    errors: list[ConfigError] = []
    check_servers(cfg, errors)
    assert [e.key for e in errors] == ["rollout.servers.on_update"]
    assert errors[0].value == "keep"
    assert "rollout.servers.on_update=abort" in errors[0].message
    assert "rollout.backend=vllm_server" in errors[0].message


def test_a_bad_on_failure_value_names_the_key_and_the_choices():
    from rlbatch.config.load import check_structure

    _, errors = check_structure({"rollout": {"servers": {"on_failure": "retry"}}})
    (error,) = errors
    assert error.key == "rollout.servers.on_failure" and error.value == "retry"
    assert "stop" in error.message and "continue" in error.message


def test_each_transfer_key_belongs_to_its_transfer():
    """transfer_dir is the file transfer's, transfer_host the broadcast's: set with the other
    transfer (or on another backend) it would be ignored, so it is an error naming the key,
    its value and both fixes; the broadcast itself takes no other key."""
    assert _errors(urls=["http://a:1"], transfer=ServerTransfer.broadcast) == {}
    assert _errors(urls=["http://a:1"], transfer_dir="/shared/w") == {}
    errors = _errors(
        urls=["http://a:1"], transfer=ServerTransfer.broadcast, transfer_dir="/shared/w"
    )
    (error,) = errors.values()
    assert error.key == "rollout.servers.transfer_dir" and error.value == "/shared/w"
    assert "rollout.servers.transfer=file" in error.message
    assert "rollout.servers.transfer_dir=null" in error.message
    errors = _errors(urls=["http://a:1"], transfer_host="node3")
    assert set(errors) == {"rollout.servers.transfer_host"}
    assert "rollout.servers.transfer=broadcast" in errors["rollout.servers.transfer_host"].message


def test_transfer_keys_on_another_backend_are_errors():
    cfg = RunConfig()
    cfg.rollout.servers.transfer = ServerTransfer.broadcast
    cfg.rollout.servers.transfer_host = "node3"
    errors: list[ConfigError] = []
    check_servers(cfg, errors)
    assert [e.key for e in errors] == [
        "rollout.servers.transfer_host", "rollout.servers.transfer",
    ]  # fmt: skip
    assert all("rollout.backend=vllm_server" in e.message for e in errors)


def test_transfer_takes_file_or_broadcast_from_the_command_line(capsys):
    from rlbatch.cli.common import compose

    base = [
        "+recipe=grpo_qwen", "model.num_attention_heads=2", "model.num_query_groups=2",
        "rollout.backend=vllm_server", "rollout.servers.urls=[http://a:1]",
    ]  # fmt: skip
    cfg = compose([*base, "rollout.servers.transfer=broadcast"], "t")
    assert cfg.rollout.servers.transfer == ServerTransfer.broadcast
    with pytest.raises(SystemExit):
        compose([*base, "rollout.servers.transfer=nccl"], "t")
    assert (
        "rollout.servers.transfer=nccl: is not one of: file, broadcast" in capsys.readouterr().err
    )


def test_a_sync_fault_needs_the_training_process_to_push_and_takes_fail_kinds_place():
    """debug.fail_sync fires in the training process's sync for debug.fail_at_step: with
    generation overlapping training the generation worker pushes and never meets that step
    (the fault would silently not happen); fail_rank and fail_kind are not used with it."""
    from rlbatch.config.schema import FailKind, SyncFault
    from rlbatch.config.servers_rules import check_sync_fault

    cfg = _server_run(num_steps_async=1, max_staleness=1)
    cfg.debug.fail_sync, cfg.debug.fail_at_step = SyncFault.pause, 2
    errors: list[ConfigError] = []
    check_sync_fault(cfg, "pause", errors)
    assert [(e.key, e.value) for e in errors] == [("debug.fail_sync", "pause")]
    assert "grpo.overlap_generation=false" in errors[0].message
    cfg.grpo.overlap_generation = False
    cfg.debug.fail_rank, cfg.debug.fail_kind = 1, FailKind.kill
    errors = []
    check_sync_fault(cfg, "pause", errors)
    assert [(e.key, e.value) for e in errors] == [
        ("debug.fail_rank", 1),
        ("debug.fail_kind", "kill"),
    ]
    cfg.debug.fail_rank, cfg.debug.fail_kind = 0, FailKind.raise_error
    errors = []
    check_sync_fault(cfg, "pause", errors)
    assert errors == []


@pytest.mark.parametrize(
    "dtype, expected", [("float32", 1e-3), ("bfloat16", 5e-2), ("float16", 5e-3)]
)
def test_the_default_probe_tolerance_follows_the_engines_dtype(dtype, expected):
    """rollout.servers.probe_tolerance null: float32 engines 1e-3, the others their noise floor
    (a fixed 1e-3 refused every bfloat16 server run before launch, the GPU default)."""
    from rlbatch.config.dtypes import probe_tolerance
    from rlbatch.config.schema import RunConfig

    cfg = RunConfig()
    cfg.rollout.vllm.dtype = dtype
    assert cfg.rollout.servers.probe_tolerance is None
    assert probe_tolerance(cfg) == expected
    cfg.rollout.servers.probe_tolerance = 0.2
    assert probe_tolerance(cfg) == 0.2


def test_on_failure_restart_is_for_servers_the_run_starts_over_the_file_transfer():
    """rollout.servers.on_failure=restart starts a dead server again, which the run can do only
    for the servers it started (rollout.servers.count), and a restarted server cannot join the
    broadcast group the others formed: both refused at once, naming the key and the fixes."""
    errors: list[ConfigError] = []
    cfg = RunConfig()
    cfg.rollout.backend = RolloutBackend.vllm_server
    cfg.rollout.servers.urls = ["http://node7:8000"]
    cfg.rollout.servers.on_failure = ServerFailure["restart"]
    cfg.rollout.servers.transfer = ServerTransfer.broadcast
    check_servers(cfg, errors)
    assert [e.key for e in errors] == ["rollout.servers.on_failure"] * 2
    assert all(e.value == "restart" for e in errors)
    assert "rollout.servers.count=N" in errors[0].message
    assert "rollout.servers.on_failure=continue" in errors[0].message
    assert "rollout.servers.transfer=file" in errors[1].message
    assert _errors(count=1, on_failure=ServerFailure["restart"]) == {}
    cfg = RunConfig()  # restart at dp > 1 hung (no progress for 300 s): refused for now
    cfg.rollout.backend, cfg.parallel.dp = RolloutBackend.vllm_server, 2
    cfg.rollout.servers.count, cfg.rollout.servers.on_failure = 1, ServerFailure["restart"]
    errors = []
    check_servers(cfg, errors)
    assert [e.key for e in errors] == ["rollout.servers.on_failure"]
    assert "parallel.dp=1" in errors[0].message


def test_max_restarts_needs_on_failure_restart_and_is_not_negative():
    errors = _errors(count=1, max_restarts=2)
    assert set(errors) == {"rollout.servers.max_restarts"}
    assert "rollout.servers.on_failure=restart" in errors["rollout.servers.max_restarts"].message
    errors = _errors(count=1, on_failure=ServerFailure["restart"], max_restarts=-1)
    assert set(errors) == {"rollout.servers.max_restarts"}
    assert "must be >= 0" in errors["rollout.servers.max_restarts"].message


def test_routing_applies_to_agent_harness_episodes_on_servers(capsys):
    """rollout.servers.routing chooses the server of a harness episode's calls: least_loaded
    without a harness (every request goes to the least loaded server anyway), or on another
    backend, would be ignored; with a harness it composes from the command line."""
    from rlbatch.cli.common import compose
    from rlbatch.config.schema import ServerRouting

    errors = _errors(urls=["http://a:1"], routing=ServerRouting.least_loaded)
    assert set(errors) == {"rollout.servers.routing"}
    assert errors["rollout.servers.routing"].value == "least_loaded"
    assert "env.harness or env.agent.openenv_url" in errors["rollout.servers.routing"].message
    cfg = RunConfig()
    cfg.rollout.servers.routing = ServerRouting.least_loaded
    other: list[ConfigError] = []
    check_servers(cfg, other)
    assert [e.key for e in other] == ["rollout.servers.routing"]
    assert "rollout.backend=vllm_server" in other[0].message
    cfg = _server_run()
    cfg.env.harness = "h.py:run"
    cfg.rollout.servers.routing = ServerRouting.least_loaded
    assert "rollout.servers.routing" not in _keys(cfg)
    base = [
        "+recipe=grpo_qwen", "model.num_attention_heads=2", "model.num_query_groups=2",
        "rollout.backend=vllm_server", "rollout.servers.urls=[http://a:1]",
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        compose([*base, "rollout.servers.routing=random"], "t")
    assert "is not one of: affine, least_loaded" in capsys.readouterr().err
