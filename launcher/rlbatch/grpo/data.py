"""Prompt datasets: built-in tasks, local JSONL or Parquet files (``data.*``).

``load_examples`` reads raw (prompt, answer) pairs; ``build_prompts`` applies the chat template,
tokenizes and rejects prompts longer than ``data.max_prompt_len`` (naming their indices).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlbatch.config.schema import DataConfig, DataSource
from rlbatch.grpo.chat import PromptContent, apply_chat_template
from rlbatch.grpo.tasks import generate_examples
from rlbatch.grpo.types import Prompt

MAX_LISTED_ERRORS = 10
"""Offending indices listed in one error message."""


class TextTokenizer(Protocol):
    """The part of rlbatch.engine.tokenizer's Tokenizer that data loading needs."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class RawExample:
    """One dataset row: a prompt (text or chat messages) and its reference answer."""

    prompt: PromptContent
    answer: str


def load_examples(cfg: DataConfig, seed: int) -> list[RawExample]:
    """The dataset's rows in file order (built-in: generated from `seed`)."""
    source = DataSource(cfg.source)
    if source == DataSource.builtin:
        return [
            RawExample(e.prompt, e.answer)
            for e in generate_examples(cfg.task, cfg.num_prompts, seed)
        ]
    if cfg.path is None:
        raise ValueError(
            f"data.path is null but data.source={source.value}: set data.path to a local"
            f" {source.value} file, or data.source=builtin"
        )
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise ValueError(f"data.path={cfg.path} does not exist or is not a file: fix the path")
    rows = _read_jsonl(path) if source == DataSource.jsonl else _read_parquet(path)
    if not rows:
        raise ValueError(f"data.path={cfg.path} holds no rows: a dataset needs at least one prompt")
    return [_row_to_example(row, i, cfg) for i, row in enumerate(rows)]


def _read_jsonl(path: Path) -> list[Mapping[str, Any]]:
    rows: list[Mapping[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"data.path={path} line {line_no} is not valid JSON: {e}") from e
            if not isinstance(row, dict):
                raise ValueError(f"data.path={path} line {line_no} is not a JSON object")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[Mapping[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(
            f"data.path={path} is Parquet (data.source=parquet) but pyarrow is not installed:"
            " pip install pyarrow, or convert the file to JSONL and set data.source=jsonl"
        ) from e
    return pq.read_table(path).to_pylist()


def _row_to_example(row: Mapping[str, Any], index: int, cfg: DataConfig) -> RawExample:
    missing = [k for k in (cfg.prompt_key, cfg.answer_key) if k not in row]
    if missing:
        raise ValueError(
            f"data.path={cfg.path} row {index} has no field {missing[0]!r} (fields:"
            f" {sorted(row)}): set data.prompt_key / data.answer_key to the file's field names"
        )
    prompt = row[cfg.prompt_key]
    if not isinstance(prompt, (str, list)):
        raise ValueError(
            f"data.path={cfg.path} row {index}: {cfg.prompt_key!r} is {type(prompt).__name__};"
            " it must be a string or a list of {role, content} messages"
        )
    return RawExample(prompt=prompt, answer=str(row[cfg.answer_key]))


def build_prompts(
    cfg: DataConfig, tokenizer: TextTokenizer, examples: Sequence[RawExample]
) -> list[Prompt]:
    """Template and tokenize `examples`; every prompt longer than max_prompt_len is an error."""
    prompts, too_long = [], []
    for i, ex in enumerate(examples):
        text = apply_chat_template(cfg.chat_template, ex.prompt, tokenizer)
        ids = tuple(int(t) for t in tokenizer.encode(text))
        if len(ids) > cfg.max_prompt_len:
            too_long.append((i, len(ids)))
        prompts.append(Prompt(index=i, prompt_ids=ids, answer=ex.answer, text=text))
    if too_long:
        listed = ", ".join(f"index {i} ({n} tokens)" for i, n in too_long[:MAX_LISTED_ERRORS])
        more = (
            f" and {len(too_long) - MAX_LISTED_ERRORS} more"
            if len(too_long) > MAX_LISTED_ERRORS
            else ""
        )
        raise ValueError(
            f"{len(too_long)} prompt(s) are longer than data.max_prompt_len={cfg.max_prompt_len}:"
            f" {listed}{more}. Raise data.max_prompt_len (and the token budgets), or filter the"
            " dataset"
        )
    return prompts


def load_prompts(cfg: DataConfig, tokenizer: TextTokenizer, seed: int) -> list[Prompt]:
    """The tokenized prompt dataset ``data.*`` describes."""
    return build_prompts(cfg, tokenizer, load_examples(cfg, seed))
