"""PNG plot of a run's metrics: reward (the teacher KL under pure distillation), KL and tokens/s
against optimizer step.

matplotlib is a dependency; should it be missing (a stripped environment) :func:`plot_metrics`
warns and returns None. Always the non-interactive Agg backend (workers have no display).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PANELS = (
    ("reward_mean", "reward (mean ± std)"),
    ("kl", "KL to reference"),
    ("tokens_per_s", "tokens / s"),
)

TEACHER_PANEL = ("distill/teacher_kl", "reverse KL to teacher")
"""The first panel of pure distillation (grpo.distill.reward_coef=0), which computes no reward."""


def _panels(records: Sequence[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    """PANELS; a run whose records have no reward but a teacher KL (pure distillation) plots
    that KL in the reward's place."""
    steps = [r for r in records if r.get("step") != 0]
    if steps and not any("reward_mean" in r for r in steps):
        if any(TEACHER_PANEL[0] in r for r in steps):
            return (TEACHER_PANEL, *PANELS[1:])
    return PANELS


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for rec in records:
        value = rec.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            xs.append(rec["step"])
            ys.append(float(value))
    return xs, ys


def _plot_eval(ax: Any, records: Sequence[dict[str, Any]], keys: Sequence[str]) -> None:
    """pass@k, mean@N and maj@N of every evaluation (held-out prompts) against step."""
    for key in keys:
        if "@" in key:
            xs, ys = _series(records, key)
            ax.plot(xs, ys, marker=".", linewidth=1.4, label=key.split("/", 1)[1])
    ax.set_ylabel("eval (held-out)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)


def plot_metrics(
    records: Sequence[dict[str, Any]], path: str | Path, title: str = ""
) -> Path | None:
    """Write the plot to ``path``; None (with a warning) when matplotlib or data is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn(
            "matplotlib is not installed: no metrics plot (pip install matplotlib)", stacklevel=2
        )
        return None
    if not records:
        warnings.warn("no metrics recorded: no plot", stacklevel=2)
        return None
    from rlbatch.eval.report import eval_columns, eval_records

    evals = eval_columns(eval_records(records))
    chosen = _panels(records)
    panels = len(chosen) + (1 if evals else 0)
    fig, axes = plt.subplots(panels, 1, figsize=(7, 2.5 * panels), sharex=True)
    if evals:
        _plot_eval(axes[-1], records, evals)
    for ax, (key, label) in zip(axes, chosen, strict=False):
        xs, ys = _series(records, key)
        ax.plot(xs, ys, marker="." if len(xs) < 40 else None, linewidth=1.4)
        if key == "reward_mean":
            _, std = _series(records, "reward_std")
            if len(std) == len(ys):
                lo = [y - s for y, s in zip(ys, std, strict=True)]
                hi = [y + s for y, s in zip(ys, std, strict=True)]
                ax.fill_between(xs, lo, hi, alpha=0.2)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("optimizer step")
    if title:
        axes[0].set_title(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
