"""Which keys a resume may change: the fixed set is refused key by key, the rest is listed."""

from __future__ import annotations

import json

from rlbatch.config.load import to_container
from rlbatch.config.resume_check import check_resume, compare
from rlbatch.config.schema import RunConfig


def test_fixed_keys_are_refused_and_the_rest_listed(tmp_path):
    saved = RunConfig()
    new = RunConfig()
    new.trainer.seed = 9
    new.model.hidden_size = 128
    new.grpo.global_batch_size = 32
    new.data.max_prompt_len = 64
    new.trainer.optim.lr = 0.05
    new.trainer.max_steps = 500
    new.parallel.dp = 2
    new.model.hf_path = "/moved/model"
    new.run_dir = "/elsewhere"  # differs between any two launches: not compared
    refused, allowed = compare(to_container(saved), to_container(new))
    assert [k for k, _, _ in refused] == [
        "data.max_prompt_len", "grpo.global_batch_size", "model.hidden_size", "trainer.seed",
    ]  # fmt: skip
    assert ("trainer.seed", 1234, 9) in refused
    assert {k for k, _, _ in allowed} == {
        "model.hf_path", "parallel.dp", "trainer.max_steps", "trainer.optim.lr",
    }  # fmt: skip
    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({"config": to_container(saved)}))
    errors, notes = check_resume(new, ckpt)
    assert str(errors[-1]).startswith(f"trainer.seed=9: was 1234 in {ckpt}: it cannot change")
    assert "trainer.optim.lr: 0.001 -> 0.05" in notes
    (ckpt / "meta.json").write_text(json.dumps({"step": 4}))  # an older checkpoint: no config
    assert check_resume(new, ckpt) == ([], [])


def test_the_expert_parallel_size_may_change():
    """A checkpoint reshards across expert-parallel sizes (tests/e2e/test_moe_cli.py): the
    change is listed, not refused."""
    new = RunConfig()
    new.parallel.ep, new.parallel.dp = 2, 2
    refused, allowed = compare(to_container(RunConfig()), to_container(new))
    assert refused == []
    assert [k for k, _, _ in allowed] == ["parallel.dp", "parallel.ep"]


def test_run_ahead_keys_are_refused_and_with_partial_rollouts_the_stream_keys():
    """The checkpoint's queued rounds depend on grpo.num_steps_async and partial_rollouts; with
    partial rollouts, its stream of rows also on the staleness bound and the decode slots."""
    saved = RunConfig()
    new = RunConfig()
    new.grpo.num_steps_async, new.grpo.max_staleness, new.grpo.partial_rollouts = 1, 4, True
    refused, allowed = compare(to_container(saved), to_container(new))
    assert [k for k, _, _ in refused] == ["grpo.num_steps_async", "grpo.partial_rollouts"]
    assert [k for k, _, _ in allowed] == ["grpo.max_staleness"]  # no stream was saved
    saved.grpo.num_steps_async, saved.grpo.max_staleness, saved.grpo.partial_rollouts = 1, 4, True
    new.grpo.max_staleness, new.rollout.micro_batch_size = 6, 2
    refused, _ = compare(to_container(saved), to_container(new))
    assert [k for k, _, _ in refused] == ["grpo.max_staleness", "rollout.micro_batch_size"]


def test_relative_and_absolute_data_paths_of_one_file_are_the_same(tmp_path, monkeypatch):
    """A checkpoint of an rlbatch that kept data.path as given resumes with the absolute path
    of the same file (from the same launch directory); another file is refused."""
    monkeypatch.chdir(tmp_path)
    saved, new = RunConfig(), RunConfig()
    saved.data.path = "prompts.jsonl"
    new.data.path = str(tmp_path / "prompts.jsonl")
    assert compare(to_container(saved), to_container(new)) == ([], [])
    new.data.path = str(tmp_path / "other.jsonl")
    assert [k for k, _, _ in compare(to_container(saved), to_container(new))[0]] == ["data.path"]


def test_the_routing_replay_mode_is_fixed():
    """A checkpoint's pending samples carry the routing their mode recorded (r2: the old
    pass's, taken at a round's first step): a resume may not switch modes."""
    from rlbatch.config.enums import RoutingReplay

    new = RunConfig()
    new.grpo.routing_replay = RoutingReplay.r3
    refused, _ = compare(to_container(RunConfig()), to_container(new))
    assert [k for k, _, _ in refused] == ["grpo.routing_replay"]


def test_work_in_flight_pins_the_layout_and_nothing_else(tmp_path):
    """meta.json's in_flight (a round half trained) refuses a new parallel layout, one error
    per changed size; the same layout, or a checkpoint with nothing in flight, resumes."""
    saved = RunConfig()
    saved.parallel.tp = 2
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    layout = {"tp": 2, "pp": 1, "vpp": 1, "cp": 1, "dp": 1}
    busy = ["round being trained (grpo.steps_per_generation > 1)"]
    meta = {"config": to_container(saved), "parallel": layout, "in_flight": busy}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    new = RunConfig()
    new.parallel.dp = 2
    errors, _ = check_resume(new, ckpt)
    assert [str(e).split(":")[0] for e in errors] == ["parallel.tp=1", "parallel.dp=2"]
    assert f"was 2 in {ckpt}, which holds per-rank work in flight ({busy[0]})" in str(errors[0])
    assert "Resume with parallel.tp=2" in str(errors[0])
    assert check_resume(saved, ckpt)[0] == []  # its own layout
    (ckpt / "meta.json").write_text(json.dumps({**meta, "in_flight": []}))
    assert check_resume(new, ckpt)[0] == []  # nothing in flight: resharded
