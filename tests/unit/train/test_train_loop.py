"""The loop with small torch fakes: exact resume, fault injection, NaN stop, rank errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlbatch.config.schema import FailKind, RolloutBackend, RunConfig
from rlbatch.grpo.types import Prompt, Sample
from rlbatch.rollout.protocol import RolloutUnavailableError
from rlbatch.rollout.schedule import PromptSampler, derive_schedule
from rlbatch.train.checkpoint import latest_checkpoint
from rlbatch.train.components import Components, LocalDist
from rlbatch.train.health import InjectedFailure, NonFiniteError
from rlbatch.train.loop import (
    RankDisagreementError,
    RankTimeoutError,
    train,
)
from rlbatch.train.metrics import read_jsonl
from rlbatch.train.producer import RunAheadProducer

TIMING = ("step_time_s", "tokens_per_s", "peak_memory_gb")


class Counter:
    """Stands in for the LCM aggregator's resumable state."""

    def __init__(self):
        self.calls = 0

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def _features(prompt_index):
    return torch.tensor([[prompt_index % 3, prompt_index % 5, 1.0, prompt_index / 13]])


def _components(cfg, *, init_seed=0, dist=None, fail_at_call=0):
    torch.manual_seed(init_seed)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    sched_g = derive_schedule(
        num_generations=2, global_batch_size=4, dp=1, steps_per_generation=2, num_iterations=1
    )
    sampler = PromptSampler(13, sched_g, dp_rank=0, seed=cfg.trainer.seed)
    counter = Counter()

    def generate(request, snapshot):
        counter.calls += 1
        if counter.calls == fail_at_call:  # after moving the aggregator's state and the RNG
            torch.rand(())
            raise RolloutUnavailableError("rollout server http://127.0.0.1:9 did not answer")
        out = []
        with torch.no_grad():
            for p, gid in zip(request.prompt_indices, request.group_ids, strict=True):
                for _ in range(request.num_generations):
                    noise = torch.rand(()).item()  # global torch RNG: must be restored
                    reward = float(model(_features(p))) + noise + counter.calls
                    out.append(
                        Sample(
                            Prompt(p, (1, 2, 3), "a"),
                            gid,
                            [4] * (1 + p % 4),
                            [0.0] * (1 + p % 4),
                            False,
                            snapshot.version,
                            reward=reward,
                            advantage=noise,
                        )
                    )
        return out

    producer = RunAheadProducer(
        sampler,
        generate,
        num_steps_async=cfg.grpo.num_steps_async,
        max_staleness=cfg.grpo.max_staleness,
        seed=cfg.trainer.seed,
    )

    def train_step(batch, step, inject_nan):
        # one step number (1-based) from the loop through the producer to the train step
        assert batch.step == step and batch.round_start_version < step
        x = torch.cat([_features(s.prompt.index) for s in batch.samples])
        target = torch.tensor([[s.advantage] for s in batch.samples])
        loss = ((model(x) - target) ** 2).mean()
        if inject_nan:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0))
        if not torch.isfinite(loss):
            return {
                "loss": float(loss.detach()),
                "grad_norm": grad_norm,
                "nonfinite_micro_batch": 0,
            }
        opt.step()
        sched.step()
        return {
            "loss": float(loss.detach()),
            "grad_norm": grad_norm,
            "kl": 0.0,
            "clip_fraction": 0.0,
            "entropy": 1.0,
            "padding_efficiency": 1.0,
            "dp_imbalance": 1.0,
        }

    return Components(
        model=[model],
        optimizer=opt,
        scheduler=sched,
        producer=producer,
        train_step=train_step,
        dist=dist or LocalDist(),
        aggregator=counter,
    )


def _cfg(tmp_path, **debug):
    cfg = RunConfig(run_dir=str(tmp_path))
    cfg.trainer.max_steps = 8
    cfg.trainer.checkpoint.every_steps = 2
    cfg.trainer.checkpoint.keep_last = 2
    cfg.trainer.checkpoint.every_minutes = 0  # the peers below count the collectives per step
    cfg.grpo.num_steps_async = 1
    cfg.logging.tensorboard = False
    for key, value in debug.items():
        setattr(cfg.debug, key, value)
    return cfg


def _strip(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_uninterrupted_run_writes_metrics_checkpoints_and_plot(tmp_path):
    cfg = _cfg(tmp_path)
    history = train(cfg, _components(cfg))
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 9)) and _strip(recs) == _strip(history)
    assert [r["staleness_mean"] for r in recs] == [0, 0, 1, 1, 1, 1, 1, 1]  # rounds of 2 steps
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in recs)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000006",
        "step_00000008",
    ]
    assert (tmp_path / "metrics.png").stat().st_size > 0


@pytest.mark.parametrize("fail_at", [5, 6])
def test_resume_after_failure_matches_uninterrupted_run(tmp_path, fail_at):
    ref_cfg = _cfg(tmp_path / "ref")
    ref = _components(ref_cfg)
    train(ref_cfg, ref)
    expected = _strip(read_jsonl(tmp_path / "ref" / "metrics.jsonl"))

    cfg = _cfg(tmp_path / "run", fail_at_step=fail_at, fail_kind=FailKind.raise_error)
    with pytest.raises(InjectedFailure, match=f"step {fail_at} on rank 0"):
        train(cfg, _components(cfg))
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_00000004"
    cfg = _cfg(tmp_path / "run")
    cfg.trainer.resume = "auto"
    resumed = _components(cfg, init_seed=123)  # different init: everything comes from the ckpt
    train(cfg, resumed)
    assert _strip(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == expected
    for a, b in zip(ref.model[0].parameters(), resumed.model[0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_failed_generation_saves_the_last_step_and_resumes_exactly(tmp_path):
    """Generation fails (a rollout server down) at step 5 of a run that saves only every 6
    steps: step 4 is saved before the error reaches the caller, from the state taken before
    the failed generation moved the aggregator and the RNG, so trainer.resume=auto continues
    there with the uninterrupted run's metrics and weights."""

    def cfg_of(path):
        cfg = _cfg(path)
        cfg.grpo.num_steps_async = 0
        cfg.trainer.checkpoint.every_steps = 6
        cfg.rollout.backend = RolloutBackend.vllm_server  # the backend whose servers can fail
        return cfg

    ref_cfg = cfg_of(tmp_path / "ref")
    ref = _components(ref_cfg)
    train(ref_cfg, ref)
    expected = _strip(read_jsonl(tmp_path / "ref" / "metrics.jsonl"))

    cfg = cfg_of(tmp_path / "run")
    with pytest.raises(RolloutUnavailableError, match="step 5: .*http://127.0.0.1:9"):
        train(cfg, _components(cfg, fail_at_call=3))  # rounds of two steps: step 5's round
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_00000004"
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
    cfg = cfg_of(tmp_path / "run")
    cfg.trainer.resume = "auto"
    resumed = _components(cfg, init_seed=123)
    train(cfg, resumed)
    assert _strip(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == expected
    for a, b in zip(ref.model[0].parameters(), resumed.model[0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_nan_loss_stops_with_named_step_and_keeps_last_good_checkpoint(tmp_path):
    cfg = _cfg(tmp_path, fail_at_step=3, fail_kind=FailKind.nan_loss)
    with pytest.raises(NonFiniteError, match=r"step 3: micro-batch 0 on rank 0"):
        train(cfg, _components(cfg))
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000002"
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize(("minutes", "kept"), [(1e-9, [6, 7, 8]), (60.0, [8])])
def test_every_minutes_saves_when_overdue_and_keeps_the_last(tmp_path, minutes, kept):
    cfg = _cfg(tmp_path)
    cfg.trainer.checkpoint.every_steps = 0
    cfg.trainer.checkpoint.every_minutes = minutes
    cfg.trainer.checkpoint.keep_last = 3
    train(cfg, _components(cfg))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [f"step_{step:08d}" for step in kept]


class TwoRankView(LocalDist):
    """Rank 0 of a 2-rank world whose peer misbehaves in all_gather_object."""

    def __init__(self, peer):
        super().__init__(rank=0, world_size=2)
        self.peer = peer
        self.calls = 0

    def all_gather_object(self, obj):
        self.calls += 1
        return [obj, self.peer(obj, self.calls)]


def test_rank_disagreeing_on_the_step_is_named(tmp_path):
    cfg = _cfg(tmp_path)
    # the peer answers the step's plan digest (a str) wrongly from step 2 on (call 4: calls are
    # resume, step 1's digest, step 1's save/stop decision, step 2's digest)
    dist = TwoRankView(lambda obj, n: obj if n < 4 or not isinstance(obj, str) else "deadbeef")
    with pytest.raises(RankDisagreementError, match=r"rank\(s\) \[1\] disagree"):
        train(cfg, _components(cfg, dist=dist))


def test_silent_rank_is_named_on_timeout(tmp_path):
    cfg = _cfg(tmp_path)

    def peer(obj, n):
        if n >= 4:  # step 2's digest (after resume, step 1's digest and decision)
            # what NCCL raises (torch's own error type; gloo's plain RuntimeError counts only when
            # raised inside torch: tests/dist/test_collective_timeout.py)
            raise torch.distributed.DistBackendError("Watchdog caught collective operation timeout")
        (tmp_path / "heartbeat").mkdir(exist_ok=True)
        (tmp_path / "heartbeat" / "rank1.json").write_text(
            '{"rank": 1, "step": 1, "phase": "train", "time": 0}'
        )
        return obj

    with pytest.raises(
        RankTimeoutError, match=r"step 2 \(agree\).*rank 1 \(last seen step 1 train"
    ):
        train(cfg, _components(cfg, dist=TwoRankView(peer)))


def test_kill_injection_kills_the_process():
    code = (
        "from rlbatch.config.schema import DebugConfig, FailKind\n"
        "from rlbatch.train.health import inject_fault\n"
        "inject_fault(DebugConfig(fail_at_step=2, fail_rank=0, fail_kind=FailKind.kill), 2, 0)\n"
        "print('survived')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9 and "survived" not in proc.stdout


def _with_eval(cfg, comps, calls, values):
    """An evaluate that draws from the global torch RNG (the loop must restore it) and reports
    eval/reward_mean from ``values`` (by step)."""

    def evaluate(step):
        calls.append(step)
        torch.rand(5)
        return {"eval/reward_mean": values[step], "eval/pass@1": 0.5}

    comps.evaluate = evaluate
    return comps


def test_evaluation_steps_leave_training_unchanged_and_keep_the_best(tmp_path):
    ref_cfg = _cfg(tmp_path / "ref")
    train(ref_cfg, _components(ref_cfg))
    cfg = _cfg(tmp_path / "run")
    cfg.eval.every_steps = 3
    cfg.trainer.checkpoint.every_steps = 0
    cfg.trainer.checkpoint.keep_last = 1
    cfg.trainer.checkpoint.keep_best = "eval/reward_mean"
    values = {0: 9.0, 3: 0.7, 6: 0.4, 8: 0.2}  # step 0 is no checkpoint: 3 is the best one
    calls: list[int] = []
    train(cfg, _with_eval(cfg, _components(cfg), calls, values))
    assert calls == [0, 3, 6, 8]  # the baseline, every 3 steps, the last step
    recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(9))
    assert recs[0] == {"step": 0, "eval/reward_mean": 9.0, "eval/pass@1": 0.5}
    assert {r["step"]: r.get("eval/reward_mean") for r in recs if "eval/pass@1" in r} == values
    training = [{k: v for k, v in r.items() if "eval/" not in k} for r in recs[1:]]
    assert _strip(training) == _strip(read_jsonl(tmp_path / "ref" / "metrics.jsonl"))
    # a new best is saved when evaluated; it outlives keep_last=1; steps 6 and 8 are no best
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_00000003",
        "step_00000008",
    ]


def _with_server_figures(comps, restarts, resubmits):
    """generate answers with a rollout server round's figures: ``restarts`` / ``resubmits``
    by round index (one server, alive)."""
    from rlbatch.rollout.streaming import RoundOutput

    inner = comps.producer.generate_fn

    def generate(request, snapshot):
        out = inner(request, snapshot)
        figures = {
            "rollout/servers_alive": 1.0, "rollout/server_pools": 1.0,
            "rollout/kv_cache_age": 0.0,
            "rollout/server_restarts": float(restarts.get(request.round_index, 0)),
            "rollout/server_resubmits": float(resubmits.get(request.round_index, 0)),
            # dynamic sampling's draws of the round: two draws of 4 prompts, 3 groups dropped
            "generation_rounds": 2.0, "prompts_drawn": 8.0, "groups_filtered": 3.0,
            "groups_unused": 1.0,
        }  # fmt: skip
        return RoundOutput(request, out, figures)

    comps.producer.generate_fn = generate
    return comps


RESTARTS, RESUBMITS = {1: 1, 4: 1}, {2: 3}


def _servers(records):
    keys = ("rollout/server_restarts", "rollout/server_resubmits", "rollout/servers_alive")
    return {r["step"]: tuple(r[k] for k in keys) for r in records}


def test_a_round_counts_its_server_events_once_and_the_last_step_counts_the_rounds_ahead(
    tmp_path,
):
    """8 steps in rounds of 2 steps, generated one step ahead: a round's server restarts and
    resubmits (and dynamic sampling's draws) are counted on its first step only (not once per step of the round), and a
    restart seen while generating round 4 (at step 8, for steps 9-10, which the run never
    trains) is counted by the last step; a run resumed from its step-4 checkpoint reports the
    same, and the finished run resumed with 2 more steps (training round 4) does not count that
    restart again."""
    cfg = _cfg(tmp_path / "ref")
    train(cfg, _with_server_figures(_components(cfg), RESTARTS, RESUBMITS))
    recs = read_jsonl(tmp_path / "ref" / "metrics.jsonl")
    expected = {s: (0.0, 0.0, 1.0) for s in range(1, 9)}
    expected.update({3: (1.0, 0.0, 1.0), 5: (0.0, 3.0, 1.0), 8: (1.0, 0.0, 1.0)})
    assert _servers(recs) == expected
    assert sum(r["rollout/server_restarts"] for r in recs) == 2  # rounds 1 and 4
    # dynamic sampling's draws likewise: once per round (round 4's at step 8), not per step
    assert [r["prompts_drawn"] for r in recs] == [8.0, 0.0] * 3 + [8.0, 8.0]
    assert sum(r["generation_rounds"] for r in recs) == 2 * 5  # rounds 0-4, two draws each

    run_cfg = _cfg(tmp_path / "run", fail_at_step=6, fail_kind=FailKind.raise_error)
    with pytest.raises(InjectedFailure):
        train(run_cfg, _with_server_figures(_components(run_cfg), RESTARTS, RESUBMITS))
    run_cfg = _cfg(tmp_path / "run")
    run_cfg.trainer.resume = "auto"
    train(run_cfg, _with_server_figures(_components(run_cfg), RESTARTS, RESUBMITS))
    assert _strip(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == _strip(recs)

    cfg.trainer.resume = "auto"
    cfg.trainer.max_steps = 10
    train(cfg, _with_server_figures(_components(cfg), RESTARTS, RESUBMITS))
    more = read_jsonl(tmp_path / "ref" / "metrics.jsonl")
    assert _servers(more) == expected | {9: (0.0, 0.0, 1.0), 10: (0.0, 0.0, 1.0)}


def test_every_step_of_a_round_reports_the_rounds_slot_occupancy():
    """A round trained over two steps counts its decode slot-steps once (its first step) but
    reports its occupancy on both, from its own counts; a round generated ahead for steps past
    trainer.max_steps adds its slot-steps to the last step, not its occupancy."""
    from types import SimpleNamespace

    from rlbatch.train.staleness import ROLLOUT_COUNTERS, rollout_metrics, step_figures

    counts = {"rollout/busy_slot_steps": 35.0, "rollout/slot_steps": 100.0}

    def metrics(new_round, ahead=None):
        figures = step_figures(SimpleNamespace(filter_metrics=dict(counts), new_round=new_round), ahead)  # fmt: skip
        return rollout_metrics({k: figures[k] for k in ROLLOUT_COUNTERS if k in figures})

    first, later = metrics(True), metrics(False)
    assert first["rollout/slot_occupancy"] == later["rollout/slot_occupancy"] == 0.35
    assert (first["rollout/slot_steps"], later["rollout/slot_steps"]) == (100.0, 0.0)
    last = metrics(False, {"rollout/busy_slot_steps": 10.0, "rollout/slot_steps": 10.0})
    assert last["rollout/slot_occupancy"] == 0.35 and last["rollout/slot_steps"] == 10.0
