"""What an evaluation leaves for a reader: the per-prompt samples file and a rich table.

``<run_dir>/eval/step_NNNNN.jsonl`` has one line per prompt, in evaluation-set order:

    {"index": 3, "prompt": "copy:482=", "reference": "482", "num_correct": 2,
     "majority": "482", "samples": [{"text": "482", "reward": 1.0, "correct": true,
     "num_tokens": 4, "truncated": false, "answer": "482"}, ...]}

(``majority``: the answer maj@N voted for, null when the reward grades no answer.)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlbatch.eval.metrics import PREFIX, PromptResult, majority_answer

MAX_TABLE_ROWS = 12
"""Evaluations shown in the summary's eval table (first, last and evenly spaced between)."""


def result_record(result: PromptResult) -> dict[str, Any]:
    """One line of the samples file."""
    vote = majority_answer(result.samples)
    return {
        "index": result.index,
        "prompt": result.prompt,
        "reference": result.reference,
        "num_correct": result.num_correct,
        "majority": None if vote is None else vote.answer,
        "samples": [dataclasses.asdict(s) for s in result.samples],
    }


def write_samples(path: Path, results: Sequence[PromptResult]) -> None:
    """Write the samples file atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(result_record(r)) + "\n" for r in results))
    os.replace(tmp, path)


def eval_columns(records: Sequence[dict[str, Any]]) -> list[str]:
    """The eval metrics present in ``records`` (without timings and the prompt count)."""
    keys: list[str] = []
    for rec in records:
        for key in rec:
            if key.startswith(PREFIX) and key not in keys:
                keys.append(key)
    return [k for k in keys if k not in (PREFIX + "seconds", PREFIX + "num_prompts")]


def eval_records(history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of ``history`` that hold an evaluation."""
    return [r for r in history if any(k.startswith(PREFIX) for k in r)]


def _spread(records: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    if len(records) <= limit:
        return records
    picks = sorted({round(i * (len(records) - 1) / (limit - 1)) for i in range(limit)})
    return [records[i] for i in picks]


def eval_table(history: Sequence[dict[str, Any]], title: str = "evaluation") -> Any:
    """A rich Table: one row per evaluation (at most MAX_TABLE_ROWS), one column per metric;
    None when ``history`` holds no evaluation."""
    from rich.table import Table

    records = eval_records(history)
    if not records:
        return None
    columns = eval_columns(records)
    prompts = records[-1].get(PREFIX + "num_prompts")
    suffix = f" ({int(prompts)} prompts)" if isinstance(prompts, (int, float)) else ""
    table = Table(title=title + suffix)
    table.add_column("step", justify="right")
    for key in columns:
        table.add_column(key.removeprefix(PREFIX), justify="right")
    for rec in _spread(records, MAX_TABLE_ROWS):
        cells = [rec.get(k) for k in columns]
        table.add_row(
            str(rec.get("step", "-")),
            *("-" if not isinstance(c, (int, float)) else f"{c:.4g}" for c in cells),
        )
    return table
