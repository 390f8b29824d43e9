"""The real loop (Megatron engine, rollout, LCM, GRPO step) in one process: a run killed by an
injected failure and resumed reproduces every per-step metric of an uninterrupted run."""

from __future__ import annotations

import pytest

import rlbatch.grpo.step  # noqa: F401  (an import regression fails, never skips)
from rlbatch.config.schema import FailKind, RunConfig
from rlbatch.train.health import InjectedFailure
from rlbatch.train.metrics import read_jsonl

TIMING = (
    "step_time_s",
    "tokens_per_s",
    "train_seconds",
    "train_tokens_per_s",
    "old_logps_seconds",
    "batch_seconds",
    "peak_memory_gb",
)


def _cfg(run_dir, **debug):
    cfg = RunConfig(run_dir=str(run_dir))
    cfg.trainer.max_steps = 4
    cfg.trainer.checkpoint.every_steps = 2
    cfg.trainer.optim.lr = 3e-3
    cfg.grpo.num_generations = 4
    cfg.grpo.global_batch_size = 16
    cfg.grpo.beta = 0.02
    cfg.grpo.num_steps_async = 1
    cfg.rollout.max_new_tokens = 8
    cfg.batching.train.max_tokens = 256
    cfg.logging.tensorboard = False
    cfg.logging.plot = False
    for key, value in debug.items():
        setattr(cfg.debug, key, value)
    return cfg


def _metrics(run_dir):
    return [
        {k: v for k, v in r.items() if k not in TIMING}
        for r in read_jsonl(run_dir / "metrics.jsonl")
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (generation overlapped, the default; checkpoints every 2 steps),
    shared by the resume and the inline comparisons."""
    from rlbatch.train.build import overlaps_generation, run

    run_dir = tmp_path_factory.mktemp("real") / "ref"
    cfg = _cfg(run_dir)
    assert overlaps_generation(cfg)
    run(cfg)
    return run_dir, _metrics(run_dir)


def test_real_loop_resumes_bit_exactly(tmp_path, reference):
    from rlbatch.train.build import run

    ref_dir, expected = reference
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    assert [r["staleness_mean"] for r in expected] == [0.0, 1.0, 1.0, 1.0]
    assert (ref_dir / "hf" / "config.json").exists()

    with pytest.raises(InjectedFailure):
        run(_cfg(tmp_path / "run", fail_at_step=3, fail_kind=FailKind.raise_error))
    cfg = _cfg(tmp_path / "run")
    cfg.trainer.resume = "auto"
    run(cfg)
    assert _metrics(tmp_path / "run") == expected


def test_overlapped_generation_equals_inline(tmp_path, reference):
    """num_steps_async=1 with generation in its own thread on a model copy (weights handed over
    per version) trains on exactly the samples inline generation produces: every metric equal,
    every sample tagged with the version the schedule names. The overlapped run is the shared
    reference (its checkpoints change no metric: the resume test's premise)."""
    from rlbatch.train.build import overlaps_generation, run

    cfg = _cfg(tmp_path / "inline")
    cfg.trainer.checkpoint.every_steps = 0
    cfg.grpo.overlap_generation = False
    assert overlaps_generation(cfg) is False
    run(cfg)
    _, overlapped = reference
    assert overlapped == _metrics(tmp_path / "inline")
    assert [r["staleness_mean"] for r in overlapped] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["is_weight_max"] > 1.0 for r in overlapped[1:])
