"""Partial rollouts through the real rlbatch-train: rows that outlive a round go on under the
next policy version, in the generation worker (overlap) and inline; the first groups to finish
are trained (consumption_granularity=group); a resume from a checkpoint that holds rows in
mid-decode continues exactly (a SIGKILLed run's resume on servers: test_vllm_servers.py); and
the config check before launch."""

from __future__ import annotations

import json

import pytest

from recipe_runs import metrics, run_train

pytestmark = pytest.mark.e2e

STEPS = 4
RUN = (
    "+recipe=grpo_qwen", f"trainer.max_steps={STEPS}", "grpo.num_steps_async=1",
    "grpo.max_staleness=3", "grpo.partial_rollouts=true", "grpo.consumption_granularity=group",
    "debug.response_length_median=5", "logging.samples=true", "logging.plot=false",
    "logging.tensorboard=false", "trainer.checkpoint.export_hf=false",
    "trainer.checkpoint.every_steps=1", "trainer.num_threads=2",
)  # fmt: skip


def _train(bin_dir, env, run_dir, *overrides, check=True):
    return run_train(bin_dir, env, run_dir, *RUN, *overrides, check=check)


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.endswith(("_s", "seconds", "memory_gb")) and "per_s" not in k}
            for r in records]  # fmt: skip


def _samples(run_dir, step):
    lines = (run_dir / "samples" / f"step_{step:05d}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def overlapped(bin_dir, subprocess_env, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("partial") / "overlap"
    _train(bin_dir, subprocess_env, run_dir)
    return run_dir, metrics(run_dir)


def test_rows_continue_under_newer_versions_with_exact_batches(overlapped):
    run_dir, records = overlapped
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    continued = 0
    for r in records:
        assert r["samples"] == 64  # grpo.global_batch_size, every step
        assert 0.0 < r["rollout/slot_occupancy"] <= 1.0
        assert r["rollout/untrained_fraction"] == 0.0
        assert r["staleness_mean"] <= 3.0 and r["staleness_token_mean"] <= r["staleness_mean"]
        assert -1.0 <= r["length_staleness_corr"] <= 1.0
        trained = r["step"] - 1  # the version the step trains
        for s in _samples(run_dir, r["step"]):
            versions = s["token_versions"]
            assert len(versions) == len(s["response_ids"]) == len(s["behaviour_logps"])
            assert versions == sorted(versions)
            assert trained - 3 <= versions[0] and versions[-1] <= trained
            continued += len(set(versions)) > 1
    assert continued > 0, "no row outlived a round"
    assert records[2]["rollout/carried_rows"] > 0  # the step-3 checkpoint holds rows in flight
    assert max(r["length_staleness_corr"] for r in records) > 0.0


def test_inline_generation_and_a_killed_run_match_the_overlapped_one(
    overlapped, bin_dir, subprocess_env
):
    """Same seed, same results: the stream decoded in the trainer's thread gives the same
    metrics as in the generation worker; the last step again, resumed in a new run directory
    from the step-3 checkpoint (unfinished rows with their tokens, versions and log-probs;
    finished groups not yet trained), trains exactly the same samples; the same checkpoint at
    dp 2 is refused before launch, naming the rows in flight."""
    ref_dir, expected = overlapped
    inline_dir = ref_dir.parent / "inline"
    # the overlapped run gives each side half of its 2 threads: the inline one runs on 1
    _train(bin_dir, subprocess_env, inline_dir, "grpo.overlap_generation=false",
           "trainer.num_threads=1")  # fmt: skip
    assert _untimed(metrics(inline_dir)) == _untimed(expected)

    resumed_dir = ref_dir.parent / "resumed"
    step_3 = ref_dir / "checkpoints" / "step_00000003"
    _train(bin_dir, subprocess_env, resumed_dir, f"trainer.resume={step_3}")
    assert _untimed(metrics(resumed_dir)) == _untimed(expected)
    for step in range(4, STEPS + 1):
        assert _samples(resumed_dir, step) == _samples(ref_dir, step)
    # at another layout that checkpoint's rows (and its round generated ahead) would be dealt
    # to the wrong ranks: refused before launch
    refused = _train(bin_dir, subprocess_env, ref_dir.parent / "dp2", "parallel.dp=2",
                     f"trainer.resume={step_3}", check=False)  # fmt: skip
    message = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 2, message[-3000:]
    assert "parallel.dp=2: was 1" in message, message[-3000:]
    assert "rows of the partial-rollout stream (grpo.partial_rollouts)" in message
    assert "producer queue (grpo.num_steps_async > 0)" in message


def test_partial_rollouts_without_staleness_room_fail_before_launch(
    bin_dir, subprocess_env, tmp_path
):
    proc = _train(bin_dir, subprocess_env, tmp_path / "bad", "grpo.max_staleness=2",
                  "parallel.tp=2", check=False)  # fmt: skip
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "grpo.max_staleness" in out and "set grpo.max_staleness >= 3" in out
    assert "parallel.tp" in out and "Traceback" not in out
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_batch_granularity_trains_each_round_its_own_prompts(bin_dir, subprocess_env, tmp_path):
    """consumption_granularity=batch (the default): rows of later draws start early and continue
    under newer weights, but round r trains exactly the prompts of its own draw (group ids are
    stream positions: 8 prompts per round)."""
    run_dir = tmp_path / "batch"
    _train(bin_dir, subprocess_env, run_dir, "grpo.consumption_granularity=batch",
           "trainer.max_steps=3", "trainer.checkpoint.every_steps=0")  # fmt: skip
    continued = 0
    for step in (1, 2, 3):
        samples = _samples(run_dir, step)
        assert sorted({s["group_id"] for s in samples}) == list(range(8 * (step - 1), 8 * step))
        continued += sum(len(set(s["token_versions"])) > 1 for s in samples)
    assert continued > 0
    assert all(r["rollout/untrained_fraction"] == 0.0 for r in metrics(run_dir))


VLLM = (
    "rollout.backend=vllm", "model=tiny_moe", "model.head_dim=32",
    "rollout.vllm.kv_cache_space_gb=0.25", "rollout.vllm.segment_tokens=3", "trainer.max_steps=3",
)  # fmt: skip
"""The stream on vLLM in segments of 3 tokens, of an MoE policy (tiny_moe with heads of width
32, the CPU build's smallest): the same stream as a dense model's, whose every weight swap also
carries the experts (and the built-in engine's stream runs dense above)."""


@pytest.mark.slow
@pytest.mark.optional_extra
def test_vllm_stream_continues_rows_across_swaps_and_resumes_exactly(
    bin_dir, subprocess_env, tmp_path
):
    """rollout.backend=vllm: rows still decoding at a weight swap keep their tokens, log-probs
    and versions and go on as prompt + tokens so far under the new weights (a new request per
    segment, seeded by the row and the segment), so a row's tokens carry mixed versions; step 3
    again, resumed in a new run directory from the step-2 checkpoint (which holds rows in
    mid-decode), trains exactly the uninterrupted run's samples and metrics."""
    pytest.importorskip("vllm")
    ref_dir = tmp_path / "ref"
    _train(bin_dir, subprocess_env, ref_dir, *VLLM)
    expected = metrics(ref_dir)
    continued = 0
    for r in expected:
        assert r["samples"] == 64
        trained = r["step"] - 1
        for s in _samples(ref_dir, r["step"]):
            versions = s["token_versions"]
            assert len(versions) == len(s["response_ids"]) == len(s["behaviour_logps"])
            assert versions == sorted(versions) and trained - 3 <= versions[0] <= trained
            continued += len(set(versions)) > 1
    assert continued > 0, "no row outlived a round"
    assert sum("rollout/weight_sync_s" in r for r in expected) >= 2  # a round per new version

    resumed_dir = tmp_path / "resumed"
    step_2 = ref_dir / "checkpoints" / "step_00000002"
    _train(bin_dir, subprocess_env, resumed_dir, *VLLM, f"trainer.resume={step_2}")
    assert _untimed(metrics(resumed_dir)) == _untimed(expected)
    assert _samples(resumed_dir, 3) == _samples(ref_dir, 3)
