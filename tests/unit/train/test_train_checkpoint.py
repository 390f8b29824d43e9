"""Checkpoints: atomic writes, keep_last, resume resolution, exact round trip of every piece."""

from __future__ import annotations

import json
import os
import random
import threading

import numpy as np
import pytest
import torch

from rlbatch.runtime.rng import capture_rng_state, restore_rng_state
from rlbatch.train import checkpoint as ck
from rlbatch.train.checkpoint import (
    TrainState,
    apply_payload,
    build_payload,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)


class Boom:
    """Pickling this raises: a crash in the middle of writing a rank file."""

    def __reduce__(self):
        raise RuntimeError("disk on fire")


def _trainer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps, start):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(16, 4, generator=g)
        loss = (model(x) + torch.rand(16, 1)).pow(2).mean()  # uses the global torch RNG too
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def test_resume_continues_bit_exactly(tmp_path):
    ref = _trainer()
    _train(*ref, steps=6, start=0)

    model, opt, sched = _trainer()
    _train(model, opt, sched, steps=3, start=0)
    state = TrainState(
        step=3,
        policy_version=3,
        rng=capture_rng_state(),
        producer={"queue": ["round-4"], "sampler": {"epoch": 1, "cursor": 5}},
        planner={"pool": [7, 8]},
        aggregator={"pending": [[1, 2]]},
        metrics_history=[{"step": 0, "loss": 1.5}],
    )
    save_checkpoint(tmp_path, 3, build_payload([model], opt, sched, state))
    _train(model, opt, sched, steps=2, start=3)  # diverge, then come back

    fresh = _trainer(seed=99)
    got = apply_payload(load_checkpoint(latest_checkpoint(tmp_path)), [fresh[0]], *fresh[1:])
    restore_rng_state(got.rng)
    assert got.step == 3 and got.policy_version == 3
    assert got.producer == state.producer and got.planner == {"pool": [7, 8]}
    assert got.aggregator == {"pending": [[1, 2]]}
    assert got.metrics_history == [{"step": 0, "loss": 1.5}]
    _train(*fresh, steps=3, start=3)
    for a, b in zip(ref[0].parameters(), fresh[0].parameters(), strict=True):
        assert torch.equal(a, b)
    assert fresh[2].last_epoch == ref[2].last_epoch == 6


def test_rng_states_round_trip():
    state = capture_rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng_state(state)
    second = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


def test_megatron_tracker_states_round_trip():
    import megatron.core.tensor_parallel.random as rnd

    tracker = rnd.get_cuda_rng_tracker()
    saved = (tracker.states_, tracker._is_initialized)
    try:
        tracker.set_states({"model-parallel-rng": torch.tensor([1, 2, 3], dtype=torch.uint8)})
        state = capture_rng_state()
        tracker.states_["model-parallel-rng"][0] = 9
        restore_rng_state(state)
        assert tracker.get_states()["model-parallel-rng"].tolist() == [1, 2, 3]
    finally:
        tracker.states_, tracker._is_initialized = saved


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, {"w": torch.ones(2)})
    with pytest.raises(RuntimeError, match="disk on fire"):
        save_checkpoint(tmp_path, 2, {"w": torch.zeros(2), "bad": Boom()})
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert torch.equal(load_checkpoint(tmp_path / "step_00000001")["w"], torch.ones(2))
    assert not (tmp_path / "step_00000002").exists()
    # the leftover temp dir is never picked up and is cleaned by the next save
    assert (tmp_path / ".tmp-step_00000002").exists()
    save_checkpoint(tmp_path, 3, {"w": torch.full((2,), 3.0)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]


def test_crash_before_rename_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"w": 1})
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("step_00000002"):
            raise OSError("killed before the rename")
        return real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", replace)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, {"w": 2})
    monkeypatch.undo()
    # meta.json of the half directory says complete, but it still has the temp name
    assert json.loads((tmp_path / ".tmp-step_00000002" / "meta.json").read_text())["complete"]
    assert latest_checkpoint(tmp_path).name == "step_00000001"


def test_directory_without_meta_is_ignored(tmp_path):
    save_checkpoint(tmp_path, 4, {"w": 4})
    (tmp_path / "step_00000009").mkdir()
    (tmp_path / "step_00000009" / "rank_00000.pt").write_bytes(b"half")
    assert latest_checkpoint(tmp_path).name == "step_00000004"


def test_keep_last(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"w": step}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]
    assert load_checkpoint(latest_checkpoint(tmp_path))["w"] == 5


def test_resave_same_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 2, {"w": "a"})
    save_checkpoint(tmp_path, 2, {"w": "b"})
    assert load_checkpoint(tmp_path / "step_00000002")["w"] == "b"
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000002"]


def test_resolve_resume(tmp_path):
    assert resolve_resume("none", tmp_path) is None
    assert resolve_resume("auto", tmp_path / "missing") is None
    save_checkpoint(tmp_path, 3, {})
    save_checkpoint(tmp_path, 7, {})
    assert resolve_resume("auto", tmp_path).name == "step_00000007"
    assert resolve_resume(str(tmp_path / "step_00000003"), tmp_path).name == "step_00000003"
    assert resolve_resume(str(tmp_path), tmp_path / "x").name == "step_00000007"
    with pytest.raises(FileNotFoundError, match="trainer.resume="):
        resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_ranks_write_their_own_files_and_world_size_is_checked(tmp_path):
    world = 3
    barrier = threading.Barrier(world)
    errors = []

    def rank_main(rank):
        try:
            save_checkpoint(
                tmp_path,
                5,
                {"rank": rank},
                rank=rank,
                world_size=world,
                meta={"layout": "tp1pp1dp3"},
                barrier=barrier.wait,
            )
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    path = latest_checkpoint(tmp_path)
    assert [load_checkpoint(path, rank=r, world_size=world)["rank"] for r in range(world)] == [
        0,
        1,
        2,
    ]
    assert json.loads((path / "meta.json").read_text())["layout"] == "tp1pp1dp3"
    with pytest.raises(ValueError, match="written by 3 ranks, this run has 2"):
        load_checkpoint(path, rank=0, world_size=2)


def test_train_state_rejects_unknown_fields():
    with pytest.raises(ValueError, match="bogus"):
        TrainState.from_dict({"step": 1, "bogus": 2})


def test_work_in_flight_names_what_a_new_layout_cannot_take():
    """Each kind of per-rank work a TrainState can hold is named by its setting, the rows of a
    partial-rollout stream (whose aggregator state nests the LCM buffer) included; an idle
    state holds none."""
    from rlbatch.train.checkpoint import work_in_flight

    assert work_in_flight({}) == []
    idle_stream = {
        "aggregator": {"buffer": []},
        "stream": {"groups": {}, "pending": [], "running": []},
    }
    assert work_in_flight({"aggregator": idle_stream, "producer": {"queue": []}}) == []
    stream = {
        "aggregator": {"buffer": [1]},
        "stream": {"groups": {}, "pending": [], "running": [(0, 1)]},
    }
    state = {"aggregator": stream, "producer": {"queue": [1], "current": 1, "round_done": False}}
    assert work_in_flight(state) == [
        "producer queue (grpo.num_steps_async > 0)",
        "round being trained (grpo.steps_per_generation > 1)",
        "rows of the partial-rollout stream (grpo.partial_rollouts)",
        "LCM buffer",
    ]
    assert work_in_flight({"aggregator": {"buffer": [1]}, "planner": {"pool": [1]}}) == [
        "LCM buffer", "pool batcher (batching.*.mode=pool)",
    ]  # fmt: skip
