"""rlbatch-bench distill's bookkeeping without running anything: the held-out reward curve of a
run's records (training seconds up to each evaluation), the mean over seeds, the table."""

from __future__ import annotations

import pytest

from rlbatch.bench.distill import ARMS, curve, format_report, mean_curves, parse_args


def _records(rewards, step_time):
    out = [{"step": 0, "eval/reward_mean": rewards[0], "eval/seconds": 9.0}]
    for step in (1, 2):
        rec = {"step": step, "loss": 0.1, "step_time_s": step_time}
        if step == 2:
            rec["eval/reward_mean"] = rewards[1]
        out.append(rec)
    return out


def test_curve_counts_training_seconds_up_to_each_evaluation():
    assert curve(_records([0.1, 0.3], 2.5)) == [(0, 0.0, 0.1), (2, 5.0, 0.3)]


def test_mean_over_seeds_and_the_table():
    curves = [curve(_records([0.1, 0.3], 2.0)), curve(_records([0.2, 0.5], 4.0))]
    mean = mean_curves(curves)
    assert mean[1] == pytest.approx(
        {"step": 2.0, "seconds": 6.0, "reward": 0.4, "reward_min": 0.3, "reward_max": 0.5}
    )
    with pytest.raises(AssertionError, match="different steps"):
        mean_curves([curves[0], [(0, 0.0, 0.1), (3, 1.0, 0.2)]])
    table = format_report({"teacher": "T", "seeds": [0, 1], "arms": {"distill": {"mean": mean}}})
    assert "distill      2      6.0   0.400  0.300  0.500" in table


def test_arms_and_defaults():
    args = parse_args(["--teacher", "T"])
    assert args.arms.split(",") == list(ARMS) == ["distill", "grpo", "both"]
    assert (args.seeds, args.steps, args.eval_every) == ("0,1", 20, 10)
    assert "+recipe=distill_qwen" in ARMS["both"] and "grpo.distill.reward_coef=1.0" in ARMS["both"]
