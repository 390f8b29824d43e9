"""rlbatch-bench grpo --async: step time of the default recipe, synchronous vs asynchronous.

Variants of the real training loop (``rlbatch.train.build.run``, in this process, the default
recipe ``+recipe=grpo_qwen`` composed with Hydra), run in turns (every variant once per
repeat) so that machine noise hits all of them alike. ``--threads`` T: a variant that overlaps
generation and training gets trainer.num_threads = 2T, T per side; the others T.

``--workload default`` (the recipe as it is): async run-ahead against sync.

- ``sync``: grpo.num_steps_async=0;
- ``async_inline``: num_steps_async=1, generation inline (overlap_generation=false): the same
  samples as ``async_overlap``, nothing overlaps;
- ``async_overlap``: num_steps_async=1, the next round generated while the current step trains.

Reported: the median over repeats of each variant's mean step time (steps after the first
``--warmup``), the ratios, and whether async_overlap's metrics equal async_inline's exactly
(same seed: identical results). Figures: docs/benchmarks.md "## Async run-ahead".

``--workload longtail``: the recipe with a long tail of response lengths. The tiny model seldom
samples EOS, so every row stops at its own lognormal-drawn length (debug.response_length_median
=12, debug.response_length_sigma=1.0, rollout.max_new_tokens=128): median 12 tokens, mean
~19, ~1% of rows at the 128 cap, so most rounds wait for a row 5-10x the median.

- ``sync``: grpo.num_steps_async=0;
- ``run_ahead``: num_steps_async=1, max_staleness=1, overlap on: whole rounds one step ahead,
  each round waiting for its longest row;
- ``partial``: num_steps_async=1, max_staleness=2, grpo.partial_rollouts=true, overlap on:
  rows still decoding when the policy advances go on under the new weights; a row may start
  one round before the round that trains it (lead 1);
- ``partial_lead3``: the same with max_staleness=4: rows may start three rounds ahead, enough
  admissible rows to keep the slots busy through a 128-token row.

Reported per variant (medians over repeats): mean step time, training tokens/s (metrics.jsonl
``tokens_per_s``), generation tokens/s (response tokens / step time), mean response length and
decode-slot occupancy (busy over all slot-steps of the run's rounds, from the per-step
``rollout/busy_slot_steps`` / ``rollout/slot_steps``; n/a where a run does not write them).
Figures: docs/benchmarks.md "## Partial rollouts on a long tail".
"""

from __future__ import annotations

import contextlib
import io
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

Variants = dict[str, tuple[list[str], int]]
"""name: (overrides, threads as a multiple of T)."""

DEFAULT_VARIANTS: Variants = {
    "sync": (["grpo.num_steps_async=0"], 1),
    "async_inline": (["grpo.num_steps_async=1", "grpo.overlap_generation=false"], 1),
    "async_overlap": (["grpo.num_steps_async=1", "grpo.overlap_generation=true"], 2),
}
LONGTAIL_OVERRIDES = [
    "rollout.max_new_tokens=128",
    "debug.response_length_median=12",
    "debug.response_length_sigma=1.0",
]
LONGTAIL_VARIANTS: Variants = {
    "sync": (["grpo.num_steps_async=0"], 1),
    "run_ahead": (
        ["grpo.num_steps_async=1", "grpo.max_staleness=1", "grpo.overlap_generation=true"],
        2,
    ),
    "partial": (
        [
            "grpo.num_steps_async=1",
            "grpo.max_staleness=2",
            "grpo.partial_rollouts=true",
            "grpo.overlap_generation=true",
        ],
        2,
    ),
    "partial_lead3": (
        [
            "grpo.num_steps_async=1",
            "grpo.max_staleness=4",
            "grpo.partial_rollouts=true",
            "grpo.overlap_generation=true",
        ],
        2,
    ),
}
WORKLOADS: dict[str, tuple[list[str], Variants]] = {
    "default": ([], DEFAULT_VARIANTS),
    "longtail": (LONGTAIL_OVERRIDES, LONGTAIL_VARIANTS),
}
OCCUPANCY_KEY = "rollout/slot_occupancy"


def variant_names(workload: str, variants: Optional[str]) -> list[str]:
    """The variants to run, in their table's order; `variants`: a comma list (None = all).
    An unknown name raises ValueError naming the ones this workload has."""
    known = list(WORKLOADS[workload][1])
    if variants is None:
        return known
    names = [v for v in variants.split(",") if v]
    bad = [v for v in names if v not in known]
    if bad or not names:
        raise ValueError(f"--variants {variants}: workload {workload} has {','.join(known)}")
    return [v for v in known if v in names]


def variant_overrides(workload: str, name: str, steps: int, threads: int) -> list[str]:
    """The Hydra overrides of one variant's run."""
    base, variants = WORKLOADS[workload]
    return [
        "+recipe=grpo_qwen", f"trainer.max_steps={steps}", f"trainer.num_threads={threads}",
        "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
        "trainer.checkpoint.export_hf=false", *base, *variants[name][0],
    ]  # fmt: skip


def run_variant(
    name: str, steps: int, per_side: int, run_dir: Path, workload: str = "default"
) -> list[dict[str, Any]]:
    """One training run of the default recipe; its metrics.jsonl records."""
    import torch

    from rlbatch.cli.common import compose
    from rlbatch.train.build import run
    from rlbatch.train.metrics import read_jsonl

    threads = per_side * WORKLOADS[workload][1][name][1]
    cfg = compose(variant_overrides(workload, name, steps, threads), "rlbatch-bench grpo")
    cfg.run_dir = str(run_dir)
    torch.set_num_threads(threads)
    with contextlib.redirect_stderr(io.StringIO()):  # the end-of-run summary table
        run(cfg)
    return read_jsonl(run_dir / "metrics.jsonl")


def run_async(
    steps: int,
    repeats: int,
    per_side: int,
    warmup: int,
    workload: str = "default",
    variants: Optional[str] = None,
) -> dict[str, Any]:
    """Every variant once per repeat, in turns; the workload's report."""
    names = variant_names(workload, variants)
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            for name in names:
                run_dir = Path(tmp) / f"{name}-{rep}"
                runs[name].append(run_variant(name, steps, per_side, run_dir, workload))
    setup = {"workload": workload, "steps": steps, "repeats": repeats,
             "threads_per_side": per_side, "warmup": warmup}  # fmt: skip
    if workload == "longtail":
        return longtail_report(runs, warmup) | {"setup": setup}
    return default_report(runs, warmup) | {"setup": setup}


def _mean_step_time(records: Sequence[dict[str, Any]], warmup: int) -> float:
    timed = [r["step_time_s"] for r in records[warmup:]]
    return sum(timed) / len(timed)


def default_report(runs: dict[str, list[list[dict[str, Any]]]], warmup: int) -> dict[str, Any]:
    """Step times, their ratios, and async_overlap's metrics against async_inline's (all but
    what measures the machine: times, rates, peak memory)."""
    from rlbatch.train.metrics import measures_machine

    step_times = {n: [_mean_step_time(recs, warmup) for recs in rs] for n, rs in runs.items()}
    median = {name: statistics.median(times) for name, times in step_times.items()}
    out: dict[str, Any] = {"step_time_s": median, "step_times_s": step_times, "ratios": {}}
    for name in ("async_overlap", "async_inline"):
        if name in median and "sync" in median:
            out["ratios"][f"{name}_over_sync"] = median[name] / median["sync"]
    if {"async_overlap", "async_inline"} <= set(runs):
        stable = {n: [{k: v for k, v in r.items() if not measures_machine(k)} for r in runs[n][0]]
                  for n in ("async_inline", "async_overlap")}  # fmt: skip
        over = median["async_overlap"] / median["async_inline"]
        out["ratios"]["async_overlap_over_async_inline"] = over
        out["identical_to_inline"] = stable["async_inline"] == stable["async_overlap"]
    if "async_overlap" in runs:
        recs = runs["async_overlap"][0]
        out["is_weight"] = {
            "mean": [r["is_weight_mean"] for r in recs],
            "max": [r["is_weight_max"] for r in recs],
            "capped_fraction_last": recs[-1]["is_capped_fraction"],
        }
    return out


def run_figures(records: Sequence[dict[str, Any]], warmup: int) -> dict[str, Optional[float]]:
    """One run's figures: mean step time and training tokens/s over the timed steps,
    generation tokens/s (response tokens over step time), the mean response length and the
    slot occupancy: busy over all decode slot-steps of the run where the records carry the
    counters (a round that decoded nothing then weighs nothing), else the mean over the steps
    (None where the records carry neither)."""
    timed = records[warmup:]
    seconds = sum(r["step_time_s"] for r in timed)
    generated = sum(r["response_len_mean"] * r["samples"] for r in timed)
    occupancy = [r[OCCUPANCY_KEY] for r in records if OCCUPANCY_KEY in r]
    counted = [r for r in records if "rollout/slot_steps" in r]
    slot_steps = sum(r["rollout/slot_steps"] for r in counted)
    if slot_steps:  # the run's occupancy: rounds weighted by their decode work
        occupancy = [sum(r["rollout/busy_slot_steps"] for r in counted) / slot_steps]
    return {
        "step_time_s": seconds / len(timed),
        "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
        "generation_tokens_per_s": generated / seconds,
        "response_len_mean": sum(r["response_len_mean"] for r in records) / len(records),
        "slot_occupancy": sum(occupancy) / len(occupancy) if occupancy else None,
    }


def longtail_report(runs: dict[str, list[list[dict[str, Any]]]], warmup: int) -> dict[str, Any]:
    """Per variant: the median over repeats of each figure (and the per-repeat step times);
    each variant's step time over sync's."""
    variants: dict[str, Any] = {}
    for name, reps in runs.items():
        figures = [run_figures(recs, warmup) for recs in reps]
        row: dict[str, Any] = {}
        for key in figures[0]:
            values: list[float] = [v for f in figures if (v := f[key]) is not None]
            row[key] = statistics.median(values) if values else None
        row["step_times_s"] = [f["step_time_s"] for f in figures]
        variants[name] = row
    ratios = {}
    if "sync" in variants:
        sync = variants["sync"]["step_time_s"]
        ratios = {f"{n}_over_sync": v["step_time_s"] / sync for n, v in variants.items()}
        del ratios["sync_over_sync"]
    return {"variants": variants, "ratios": ratios}


def format_async(result: dict[str, Any]) -> str:
    if "variants" in result:
        return format_longtail(result)
    lines = ["variant        mean step time (s)   per repeat"]
    for name, t in result["step_time_s"].items():
        each = " ".join(f"{x:.3f}" for x in result["step_times_s"][name])
        lines.append(f"{name:<14} {t:>18.3f}   {each}")
    lines.append("ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in result["ratios"].items()))
    if "identical_to_inline" in result:
        lines.append(f"async_overlap identical to async_inline: {result['identical_to_inline']}")
    if "is_weight" in result:
        w = result["is_weight"]
        mean, top = w["mean"], w["max"]
        lines.append("async_overlap is_weight_mean per step: " + " ".join(f"{x:.4f}" for x in mean))
        lines.append("async_overlap is_weight_max per step: " + " ".join(f"{x:.3f}" for x in top))
    return "\n".join(lines)


def format_longtail(result: dict[str, Any]) -> str:
    lines = [
        "variant    step time (s)  tokens/s  gen tokens/s  mean len  slot occupancy   per repeat"
    ]
    for name, v in result["variants"].items():
        occ = "n/a" if v["slot_occupancy"] is None else f"{v['slot_occupancy']:.3f}"
        each = " ".join(f"{x:.3f}" for x in v["step_times_s"])
        lines.append(
            f"{name:<10} {v['step_time_s']:>13.3f} {v['tokens_per_s']:>9.0f}"
            f" {v['generation_tokens_per_s']:>13.0f} {v['response_len_mean']:>9.1f} {occ:>15}"
            f"   {each}"
        )
    if result["ratios"]:
        lines.append(
            "step time ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in result["ratios"].items())
        )
    return "\n".join(lines)
