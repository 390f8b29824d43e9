"""Per-optimizer-step metrics: metrics.jsonl, trackers (TensorBoard, wandb, MLflow:
rlbatch.train.tracking), rich progress, summary table.

Rank 0 only: on other ranks :class:`MetricsLogger` does nothing (the values it gets are already
reduced by rlbatch.distributed). ``step`` in a record is 1-based: the number of optimizer steps
completed, the same number as the checkpoint that follows it (``step_00000012`` holds the
state after the record with ``"step": 12``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from rlbatch.eval.metrics import PREFIX
from rlbatch.eval.report import eval_columns, eval_table
from rlbatch.train.tracking import Sink, open_sinks

REQUIRED_KEYS = (
    "step",
    "loss",
    "grad_norm",
    "reward_mean",
    "reward_std",
    "kl",
    "clip_fraction",
    "entropy",
    "response_len_mean",
    "tokens",
    "padding_efficiency",
    "dp_imbalance",
    "staleness_mean",
    "step_time_s",
    "tokens_per_s",
    "peak_memory_gb",
)
"""Keys every metrics.jsonl record has (issue 6), except REWARD_KEYS under pure distillation."""

REWARD_KEYS = ("reward_mean", "reward_std")
"""The training reward's figures: absent from the records of pure distillation
(grpo.distill.reward_coef=0), which computes no reward; such a record has TEACHER_KL instead."""

TEACHER_KL = "distill/teacher_kl"
"""A distilling run's mean per-token reverse KL to the teacher: what pure distillation shows where
a run with rewards shows its reward."""


def required_keys(record: dict[str, Any]) -> tuple[str, ...]:
    """The keys a record must have: none but ``step`` in the step-0 evaluation record, every
    REQUIRED_KEYS but the reward's in a pure distillation record (no reward, a teacher KL)."""
    if record.get("step") == 0:
        return ("step",)
    if TEACHER_KL in record and not any(k in record for k in REWARD_KEYS):
        return tuple(k for k in REQUIRED_KEYS if k not in REWARD_KEYS)
    return REQUIRED_KEYS


SUMMARY_KEYS = (
    "reward_mean",
    TEACHER_KL,
    "kl",
    "loss",
    "grad_norm",
    "clip_fraction",
    "entropy",
    "response_len_mean",
    "padding_efficiency",
    "dp_imbalance",
    "staleness_mean",
    "tokens_per_s",
    "step_time_s",
    "peak_memory_gb",
    "turns_mean",
    "env_errors",
    "episodes_truncated",
    "env_episodes",
    "trainable_params",
)
"""The summary's rows (a metric a run does not record, such as the episode metrics of a run
without an environment, has no row)."""


MACHINE_KEYS = ("peak_memory_gb",)
"""Metrics that measure the machine, not the training, besides the timings (``*_s``,
``*_seconds``, ``*per_s*``): two runs that train the same samples the same way (a resumed run
and the uninterrupted one, inline and overlapped generation) differ in these only."""


def measures_machine(key: str) -> bool:
    """Whether a metrics.jsonl key is a timing, a rate or a memory figure: what may differ
    between runs that are otherwise exactly equal."""
    return key.endswith(("_s", "_seconds")) or "per_s" in key or key in MACHINE_KEYS


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a torn last line (crash mid-write) is skipped."""
    records: list[dict[str, Any]] = []
    p = Path(path)
    if not p.exists():
        return records
    for line in p.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def write_jsonl(path: str | Path, records: Sequence[dict[str, Any]]) -> None:
    """Replace ``path`` with ``records`` atomically."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, p)


def _steps(records: Sequence[dict[str, Any]]) -> list[Any]:
    return [r.get("step") for r in records]


def truncate_jsonl(path: str | Path, keep_through_step: int) -> list[dict[str, Any]]:
    """Keep the records with step <= ``keep_through_step`` (resume point); atomic rewrite.

    Records written after the checkpoint that a run resumes from would otherwise appear twice.
    """
    p = Path(path)
    kept = [r for r in read_jsonl(p) if r.get("step", math.inf) <= keep_through_step]
    if p.exists():
        write_jsonl(p, kept)
    return kept


def _clean(value: Any) -> Any:
    """JSON-safe scalar (NaN/inf become null; tensors and numpy scalars become floats)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Sink of per-step records. Use :meth:`log` once per optimizer step, :meth:`close` at end."""

    def __init__(
        self,
        run_dir: str | Path,
        logging_cfg: Any,
        *,
        rank: int,
        max_steps: int,
        resumed_step: int = 0,
        history: Sequence[dict[str, Any]] | None = None,
        console: Console | None = None,
    ) -> None:
        """``resumed_step``: the step of the checkpoint this run resumed from, i.e. the last
        step already done (0: a fresh run). ``history``: the records of steps 1 .. resumed_step
        (TrainState.metrics_history of that checkpoint; metrics.jsonl is rewritten from it when
        it differs, e.g. a resume into a new run directory); None = what metrics.jsonl holds up
        to resumed_step."""
        self.enabled = rank == 0
        self.run_dir = Path(run_dir)
        self.cfg = logging_cfg
        self.max_steps = max_steps
        self.history: list[dict[str, Any]] = []
        self.console = console or Console(stderr=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._sinks: list[Sink] = []
        self._progress: Progress | None = None
        self._task: Any = None
        self._line_every = max(1, max_steps // 20)
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Resume: drop records after the checkpoint; a fresh run (resumed_step 0) starts a new
        # file.
        kept = truncate_jsonl(self.jsonl_path, resumed_step)
        self.history = list(history) if history is not None else kept
        if self.cfg.jsonl and history is not None and _steps(kept) != _steps(self.history):
            write_jsonl(self.jsonl_path, self.history)  # resumed into another run directory
        self._sinks = open_sinks(self.cfg, self.run_dir, resumed_step)
        if self.cfg.progress and self.console.is_terminal:
            self._start_progress(resumed_step)

    def _start_progress(self, resumed_step: int) -> None:
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[latest]}"),
            console=self.console,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "train", total=self.max_steps, completed=resumed_step, latest=""
        )

    def log(self, record: dict[str, Any]) -> None:
        """Write one step's record (must hold every key of :func:`required_keys`: REQUIRED_KEYS,
        less the reward's under pure distillation; the step-0 record of the initial evaluation
        holds only eval/* metrics)."""
        if not self.enabled:
            return
        missing = [k for k in required_keys(record) if k not in record]
        if missing:
            raise ValueError(f"metrics record of step {record.get('step')} lacks {missing}")
        rec = {k: _clean(v) for k, v in record.items()}
        self.history.append(rec)
        if self.cfg.jsonl:
            with open(self.jsonl_path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
        for sink in self._sinks:
            sink.log(rec, rec["step"])
        self._report(rec)

    def _report(self, rec: dict[str, Any]) -> None:
        line = format_eval(rec)
        if line:
            self.console.print(f"eval after step {rec['step']}: {line}", highlight=False)
        if rec["step"] == 0:
            return
        latest = format_latest(rec)
        if self._progress is not None:
            self._progress.update(self._task, completed=rec["step"], latest=latest)
        elif self.cfg.progress and (
            rec["step"] % self._line_every == 0 or rec["step"] == self.max_steps
        ):
            self.console.print(f"step {rec['step']}/{self.max_steps}  {latest}", highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def print_summary(self) -> None:
        if self.enabled and self.history:
            self.console.print(summary_table(self.history))
            table = eval_table(self.history)
            if table is not None:
                self.console.print(table)
            note = unreached_note(self.history)
            if note:
                self.console.print(note, highlight=False)


def format_eval(rec: dict[str, Any]) -> str:
    """'pass@1 0.12  pass@4 0.31  maj@4 0.2' of a record's evaluation ('' when none)."""
    return "  ".join(
        f"{key.removeprefix(PREFIX)} {rec[key]:.3g}"
        for key in eval_columns([rec])
        if isinstance(rec[key], (int, float))
    )


def format_latest(rec: dict[str, Any]) -> str:
    """'reward 0.41  kl 0.002  1.2e+03 tok/s' for the progress bar ('teacher_kl 1.52' in place
    of the reward under pure distillation, which computes none); a run with an environment adds
    'turns 2.31  env_errors 3  truncated 5'."""

    def num(key: str, fmt: str) -> str:
        value = rec.get(key)
        return "-" if value is None else format(value, fmt)

    rewarded = "reward_mean" in rec or TEACHER_KL not in rec
    lead = (
        f"reward {num('reward_mean', '.3f')}"
        if rewarded
        else f"teacher_kl {num(TEACHER_KL, '.3f')}"
    )
    line = f"{lead}  kl {num('kl', '.4f')}  {num('tokens_per_s', '.3g')} tok/s"
    if "turns_mean" in rec:  # episode metrics: a run with env.path set
        line += (
            f"  turns {num('turns_mean', '.2f')}  env_errors {num('env_errors', '.0f')}"
            f"  truncated {num('episodes_truncated', '.0f')}"
        )
    return line


def unreached_note(history: Sequence[dict[str, Any]]) -> str:
    """The end-of-run note of a run with an environment that no episode ever reached ('')."""
    reached = [r["env_episodes"] for r in history if r.get("env_episodes") is not None]
    if not reached or any(reached):
        return ""
    return (
        f"warning: no episode reached the environment in {len(reached)} step(s): every assistant"
        " turn was cut before it ended with EOS (rollout.max_new_tokens, env.max_total_tokens),"
        " so the environment was never called and the rewards are the data rewards alone"
    )


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summary_table(history: Sequence[dict[str, Any]]) -> Table:
    """First / last value and the means of the first and last 10% of steps, per metric (over
    the optimizer steps: the step-0 evaluation record is left out)."""
    history = [r for r in history if r.get("step") != 0]
    n = len(history)
    tenth = max(1, n // 10)
    table = Table(title=f"rlbatch run summary ({n} steps)")
    for col in ("metric", "first", "last", "mean first 10%", "mean last 10%"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for key in SUMMARY_KEYS:
        values = [r.get(key) for r in history]
        finite = [v for v in values if isinstance(v, (int, float))]
        if not finite:
            continue
        head = [v for v in values[:tenth] if isinstance(v, (int, float))]
        tail = [v for v in values[-tenth:] if isinstance(v, (int, float))]
        cells = [finite[0], finite[-1], _mean(head), _mean(tail)]
        table.add_row(key, *("-" if c is None else f"{c:.4g}" for c in cells))
    return table
