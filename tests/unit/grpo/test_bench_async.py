"""rlbatch-bench grpo --async: the workload and variant arguments, the long-tail workload's
configuration and length distribution (the figures docs/benchmarks.md states), and the report
computed from metrics records (no training run here: the bench itself runs minutes)."""

from __future__ import annotations

import pytest

from rlbatch.bench import grpo_async
from rlbatch.bench.grpo import parse_args


def test_workload_defaults_per_benchmark():
    assert parse_args(["--async"]).workload == "default"
    args = parse_args(["--async", "--workload", "longtail", "--variants", "partial,sync"])
    assert (args.workload, args.variants) == ("longtail", "partial,sync")
    assert grpo_async.variant_names("longtail", args.variants) == ["sync", "partial"]
    assert grpo_async.variant_names("longtail", None) == [
        "sync",
        "run_ahead",
        "partial",
        "partial_lead3",
    ]
    assert parse_args(["--against", "trl"]).workload == "issue,longtail"
    assert parse_args(["--against", "trl", "--workload", "issue"]).workload == "issue"
    assert parse_args([]).workload is None  # the per-stage benchmark has no workload


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--async", "--workload", "issue"], "choose one of default, longtail"),
        (["--against", "trl", "--workload", "default"], "a comma list of issue, longtail"),
        (["--workload", "longtail"], "add one of them"),
        (["--async", "--against", "trl"], "choose one"),
        (["--variants", "sync"], "add --async"),
        (["--async", "--variants", "partial"], "workload default has sync,async_inline"),
        (
            ["--async", "--workload", "longtail", "--variants", "x"],
            "sync,run_ahead,partial,partial_lead3",
        ),
    ],
)
def test_wrong_combinations_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["sync", "run_ahead", "partial", "partial_lead3"])
def test_longtail_variants_compose_and_validate(name):
    """The variants' runs are valid configs of the default recipe with the long tail on.
    (``partial`` needs grpo.partial_rollouts, composed by the partial-rollout tests.)"""
    from rlbatch.cli.common import compose

    cfg = compose(grpo_async.variant_overrides("longtail", name, 3, 2), "t")
    assert (cfg.rollout.max_new_tokens, cfg.debug.response_length_median) == (128, 12)
    assert cfg.debug.response_length_sigma == 1.0 and cfg.trainer.num_threads == 2
    assert cfg.grpo.num_steps_async == (0 if name == "sync" else 1)


def test_longtail_lengths_are_the_documented_distribution():
    """Median 12, mean ~19, ~1% of rows at the 128 cap, as the docs say (the caps the
    training engine gets from the composed config)."""
    from rlbatch.cli.common import compose
    from rlbatch.rollout.sampling import SamplingParams, length_caps, row_keys

    cfg = compose(grpo_async.variant_overrides("longtail", "sync", 3, 1), "t")
    params = SamplingParams.from_config(cfg.rollout, eos_id=258, pad_id=256, debug=cfg.debug)
    caps = length_caps(row_keys(cfg.trainer.seed, 50_000), params).double()
    assert float(caps.median()) == 12.0
    assert 18.5 < float(caps.mean()) < 20.0
    assert 0.006 < float((caps == 128).double().mean()) < 0.012


def _records(step_times, occupancy=None):
    out = []
    for i, t in enumerate(step_times):
        rec = {"step": i + 1, "step_time_s": t, "tokens_per_s": 1000.0 / t}
        rec |= {"response_len_mean": 20.0, "samples": 64}
        if occupancy is not None:
            rec["rollout/slot_occupancy"] = occupancy[i]
        out.append(rec)
    return out


def test_longtail_report_and_its_table():
    """Per variant the median over repeats of: mean step time after warm-up, training tokens/s,
    generation tokens/s (response tokens / step time) and the mean occupancy over every step;
    n/a where the records carry no occupancy."""
    runs = {
        "sync": [_records([9.0, 2.0, 2.0]), _records([9.0, 4.0, 4.0]), _records([9.0, 3.0, 3.0])],
        "partial": [
            _records([9.0, 1.0, 1.0], [0.5, 0.9, 1.0]),
            _records([9.0, 1.5, 1.5], [0.6, 0.9, 0.9]),
            _records([9.0, 2.0, 2.0], [0.7, 1.0, 1.0]),
        ],
    }
    result = grpo_async.longtail_report(runs, warmup=1)
    sync, partial = result["variants"]["sync"], result["variants"]["partial"]
    assert sync["step_time_s"] == 3.0 and sync["step_times_s"] == [2.0, 4.0, 3.0]
    assert sync["tokens_per_s"] == pytest.approx(1000.0 / 3.0)
    assert sync["generation_tokens_per_s"] == pytest.approx(20 * 64 / 3.0)
    assert sync["slot_occupancy"] is None
    assert partial["step_time_s"] == 1.5
    assert partial["slot_occupancy"] == pytest.approx((0.6 + 0.9 + 0.9) / 3)
    assert result["ratios"] == {"partial_over_sync": pytest.approx(0.5)}
    table = grpo_async.format_async(result).splitlines()
    assert sync["response_len_mean"] == 20.0
    assert table[1].split()[:6] == ["sync", "3.000", "333", "427", "20.0", "n/a"]
    assert table[2].split()[:6] == ["partial", "1.500", "667", "853", "20.0", "0.800"]
    assert table[-1] == "step time ratios: partial_over_sync=0.50"


def test_occupancy_of_a_run_weighs_rounds_by_their_decode_work():
    """A round that decoded nothing (served from groups finished earlier) reports occupancy 1.0
    with zero slot-steps: the run's figure is busy / all slot-steps, not a mean over steps."""
    from rlbatch.train.staleness import rollout_metrics

    idle = rollout_metrics({"rollout/busy_slot_steps": 0.0, "rollout/slot_steps": 0.0})
    assert idle["rollout/slot_occupancy"] == 1.0 and idle["rollout/slot_steps"] == 0.0
    assert "rollout/slot_occupancy" not in rollout_metrics({})  # the engine counts nothing
    busy = rollout_metrics({"rollout/busy_slot_steps": 30.0, "rollout/slot_steps": 40.0})
    records = _records([9.0, 1.0, 1.0], [0.5, 1.0, 0.75])
    first = {"rollout/busy_slot_steps": 10.0, "rollout/slot_steps": 20.0}
    for rec, figs in zip(records, (first, idle, busy), strict=True):
        rec |= {k: v for k, v in figs.items() if k != "rollout/slot_occupancy"}
    assert grpo_async.run_figures(records, warmup=1)["slot_occupancy"] == pytest.approx(40 / 60)


def test_trl_comparison_cells_and_phase_split():
    """--against trl: the tiny model runs every workload x cap, the 0.5B shape the issue
    prompts at its own caps; the report's phase ratios are seconds over TRL's seconds and its
    tokens/s ratios whole-step rates (medians of the steps)."""
    from rlbatch.bench import grpo_trl

    args = parse_args(["--against", "trl", "--completion-tokens", "64,256"])
    assert args.models == "tiny,qwen0.5b" and args.trl_ckpt == "on"
    assert grpo_trl.cells(args) == [
        ("tiny", "issue", 64, None),
        ("tiny", "issue", 256, None),
        ("tiny", "longtail", 64, None),
        ("tiny", "longtail", 256, None),
        ("qwen0.5b", "issue", 64, 2),
    ]
    steps = {
        "trl": [({"gen": 2.0, "train": 2.0}, 400), ({"gen": 3.0, "train": 1.0}, 400)],
        "dynamic": [({"gen": 1.0, "train": 1.0}, 400), ({"gen": 1.0, "train": 1.0}, 400)],
        "packed": [({"gen": 1.0, "train": 0.5}, 300), ({"gen": 1.0, "train": 0.5}, 300)],
    }
    out = grpo_trl.summarize(steps)
    assert out["tokens_per_s"] == {"trl": 100.0, "dynamic": 200.0, "packed": 200.0}
    assert out["dynamic_over_trl"] == 2.0
    assert out["phase_seconds"]["trl"] == {"gen": 2.5, "train": 1.5}
    assert out["phase_over_trl"]["dynamic"] == {"gen": 0.4, "train": pytest.approx(2 / 3)}
    assert "tiny" in grpo_trl.format_report({"cells": [{"model": "tiny", "workload": "issue",
        "completions": 64, "trl_gradient_checkpointing": True} | out]})  # fmt: skip


def test_trl_comparison_unknown_model_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--against", "trl", "--models", "tiny,huge"])
    assert "a comma list of tiny, qwen0.5b" in capsys.readouterr().err


def test_default_report_ignores_what_measures_the_machine():
    """async_overlap and async_inline train the same samples: their records differ only in what
    measures the machine (times, rates, peak memory), so the report calls them identical; a
    trained value that differs makes them not."""
    trained = {"loss": 0.5, "is_weight_mean": 1.0, "is_weight_max": 1.0, "is_capped_fraction": 0.0}
    inline = [r | trained | {"peak_memory_gb": 0.41} for r in _records([2.0, 2.0])]
    overlap = [r | trained | {"peak_memory_gb": 0.47} for r in _records([1.0, 1.0])]
    runs = {"sync": [_records([3.0, 3.0])], "async_inline": [inline], "async_overlap": [overlap]}
    assert grpo_async.default_report(runs, warmup=0)["identical_to_inline"] is True
    overlap[1]["loss"] = 0.25
    assert grpo_async.default_report(runs, warmup=0)["identical_to_inline"] is False
