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
    cfg.logging.samples = True  # what each step trained on, compared before the metrics
    for key, value in debug.items():
        setattr(cfg.debug, key, value)
    return cfg


def _metrics(run_dir):
    return [
        {k: v for k, v in r.items() if k not in TIMING}
        for r in read_jsonl(run_dir / "metrics.jsonl")
    ]


def _samples(run_dir):
    """Each step's logged samples (logging.samples), by step."""
    folder = run_dir / "samples"
    return {int(f.stem.split("_")[1]): read_jsonl(f) for f in sorted(folder.glob("step_*.jsonl"))}


PROCESS_THREADS = 2
"""torch threads of this process while the module runs: an overlapped run gives each side
(training, the generation worker) half of them, 1 each."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (generation overlapped, the default; checkpoints every 2 steps),
    shared by the resume and the inline comparisons; also the process's torch threads before
    and after it."""
    import torch

    from rlbatch.train.build import overlaps_generation, run

    found = torch.get_num_threads()
    torch.set_num_threads(PROCESS_THREADS)
    run_dir = tmp_path_factory.mktemp("real") / "ref"
    cfg = _cfg(run_dir)
    assert overlaps_generation(cfg)
    given = torch.get_num_threads()  # what the run finds (after other tests, may differ)
    run(cfg)
    threads = (given, torch.get_num_threads())
    yield run_dir, _metrics(run_dir), threads
    torch.set_num_threads(found)


def test_an_overlapped_run_leaves_the_process_threads_as_it_found_them(reference):
    """The overlapped run halves the process's torch threads for its training side; in-process
    runs (tests, notebooks) one after another compounded it (2 -> 1 -> ...) and ran with other
    thread counts than they were given."""
    before, after = reference[2]
    assert after == before


def test_real_loop_resumes_bit_exactly(tmp_path, reference):
    from rlbatch.train.build import run

    ref_dir, expected, _ = reference
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
    """num_steps_async=1 with generation in its own process on a model copy (weights handed
    over per version) trains on exactly the samples inline generation produces: the same
    tokens, then the same behaviour log-probs, then every metric equal, every sample tagged
    with the version the schedule names. Each premise is checked in that order, so a failure
    says which one broke. The inline run gets the thread count each side of the overlapped run
    had (half the process's): float sums split over another number of threads round
    differently. The overlapped run is the shared reference (its checkpoints change no metric:
    the resume test's premise)."""
    from rlbatch.train.build import overlaps_generation, run

    cfg = _cfg(tmp_path / "inline")
    cfg.trainer.checkpoint.every_steps = 0
    cfg.trainer.num_threads = PROCESS_THREADS // 2
    cfg.grpo.overlap_generation = False
    assert overlaps_generation(cfg) is False
    run(cfg)
    ref_dir, overlapped, _ = reference
    want, got = _samples(ref_dir), _samples(tmp_path / "inline")
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert len(want[step]) == len(got[step]), f"step {step}: another number of samples"
        pairs = list(enumerate(zip(want[step], got[step], strict=True)))
        for i, (a, b) in pairs:
            where = f"step {step}, sample {i}"
            assert (a["prompt_index"], a["policy_version"], a["token_versions"]) == (
                b["prompt_index"], b["policy_version"], b["token_versions"]
            ), f"{where}: another prompt or policy version (the schedule differs)"  # fmt: skip
            assert a["response_ids"] == b["response_ids"], (
                f"{where}: other tokens sampled (overlapped {a['response_ids']}, inline"
                f" {b['response_ids']}): the weights of that version or the seeds differ"
            )
        for i, (a, b) in pairs:
            gaps = map(float.__sub__, a["behaviour_logps"], b["behaviour_logps"])
            gap = max(map(abs, gaps), default=0.0)
            assert a["behaviour_logps"] == b["behaviour_logps"], (
                f"step {step}, sample {i}: same tokens, other behaviour log-probs (largest"
                f" difference {gap:.3g}): the same weights computed otherwise (thread count,"
                " kernels)"
            )
    inline = _metrics(tmp_path / "inline")
    for a, b in zip(overlapped, inline, strict=True):
        differ = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert not differ, (
            f"step {a['step']}: same samples, other metrics (overlapped, inline): {differ}"
        )
    assert [r["staleness_mean"] for r in overlapped] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["is_weight_max"] > 1.0 for r in overlapped[1:])
