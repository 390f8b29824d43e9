"""rlbatch-bench grpo --async: step time of the default recipe, synchronous vs async run-ahead.

Three variants of the real training loop (``rlbatch.train.loop.run``, in this process, the
default recipe ``+recipe=grpo_qwen`` composed with Hydra), run in turns so that machine noise
hits all of them alike:

- ``sync``: grpo.num_steps_async=0, ``--threads`` torch threads (T);
- ``async_inline``: num_steps_async=1, generation inline (overlap_generation=false), T threads:
  the same samples as ``async_overlap``, nothing overlaps;
- ``async_overlap``: num_steps_async=1, the next round generated in a thread on a model copy
  while the current step trains: trainer.num_threads = 2T, T per side.

Reported: the median over repeats of each variant's mean step time (steps after the first
``--warmup``), the ratios, and whether async_overlap's metrics equal async_inline's exactly
(same seed: identical results). Figures go to docs/benchmarks.md "## Async run-ahead".
"""

from __future__ import annotations

import contextlib
import io
import statistics
import tempfile
from pathlib import Path
from typing import Any

VARIANTS = {  # name: (overrides, threads as a multiple of T)
    "sync": (["grpo.num_steps_async=0"], 1),
    "async_inline": (["grpo.num_steps_async=1", "grpo.overlap_generation=false"], 1),
    "async_overlap": (["grpo.num_steps_async=1", "grpo.overlap_generation=true"], 2),
}


def _is_timing(key: str) -> bool:
    return key.endswith(("_s", "_seconds")) or "per_s" in key


def run_variant(name: str, steps: int, per_side: int, run_dir: Path) -> list[dict[str, Any]]:
    """One training run of the default recipe; its metrics.jsonl records."""
    import torch

    from rlbatch.cli.common import compose
    from rlbatch.train.build import run
    from rlbatch.train.metrics import read_jsonl

    extra, factor = VARIANTS[name]
    threads = per_side * factor
    overrides = [
        "+recipe=grpo_qwen", f"trainer.max_steps={steps}", f"trainer.num_threads={threads}",
        "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
        "trainer.checkpoint.export_hf=false", *extra,
    ]  # fmt: skip
    cfg = compose(overrides, "rlbatch-bench grpo")
    cfg.run_dir = str(run_dir)
    torch.set_num_threads(threads)
    with contextlib.redirect_stderr(io.StringIO()):  # the end-of-run summary table
        run(cfg)
    return read_jsonl(run_dir / "metrics.jsonl")


def run_async(steps: int, repeats: int, per_side: int, warmup: int) -> dict[str, Any]:
    step_times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    records: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            for name in VARIANTS:
                recs = run_variant(name, steps, per_side, Path(tmp) / f"{name}-{rep}")
                timed = [r["step_time_s"] for r in recs[warmup:]]
                step_times[name].append(sum(timed) / len(timed))
                records.setdefault(name, recs)
    median = {name: statistics.median(times) for name, times in step_times.items()}
    stable = {n: [{k: v for k, v in r.items() if not _is_timing(k)} for r in records[n]]
              for n in ("async_inline", "async_overlap")}  # fmt: skip
    last = records["async_overlap"][-1]
    return {
        "step_time_s": median,
        "step_times_s": step_times,
        "ratios": {
            "async_overlap_over_sync": median["async_overlap"] / median["sync"],
            "async_overlap_over_async_inline": median["async_overlap"] / median["async_inline"],
        },
        "identical_to_inline": stable["async_inline"] == stable["async_overlap"],
        "is_weight": {
            "mean": [r["is_weight_mean"] for r in records["async_overlap"]],
            "max": [r["is_weight_max"] for r in records["async_overlap"]],
            "capped_fraction_last": last["is_capped_fraction"],
        },
        "setup": {
            "steps": steps,
            "repeats": repeats,
            "threads_per_side": per_side,
            "warmup": warmup,
        },  # fmt: skip
    }


def format_async(result: dict[str, Any]) -> str:
    lines = ["variant        mean step time (s)   per repeat"]
    for name, t in result["step_time_s"].items():
        each = " ".join(f"{x:.3f}" for x in result["step_times_s"][name])
        lines.append(f"{name:<14} {t:>18.3f}   {each}")
    lines.append("ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in result["ratios"].items()))
    lines.append(f"async_overlap identical to async_inline: {result['identical_to_inline']}")
    w = result["is_weight"]
    lines.append(
        "async_overlap is_weight_mean per step: " + " ".join(f"{x:.4f}" for x in w["mean"])
    )
    lines.append("async_overlap is_weight_max per step: " + " ".join(f"{x:.3f}" for x in w["max"]))
    return "\n".join(lines)
