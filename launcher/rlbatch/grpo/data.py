"""Prompt datasets: built-in tasks, local JSONL or Parquet files, HF ``save_to_disk``
directories (``data.*``).

``read_examples`` reads raw (prompt, answer, extra fields) rows and collects every bad row (not
UTF-8, not JSON, missing or wrongly typed fields); ``prompt_length_problems`` applies the chat
template, tokenizes and finds every prompt longer than ``data.max_prompt_len``. The driver runs
both before launch (rlbatch.grpo.preflight); workers load through ``load_prompts``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rlbatch.config.schema import AnswerFormat, DataConfig, DataSource
from rlbatch.grpo.chat import PromptContent, apply_chat_template
from rlbatch.grpo.tasks import generate_examples
from rlbatch.grpo.types import Prompt

MAX_LISTED_ERRORS = 20
"""Bad rows listed in one error message (then a count of the rest)."""
GSM8K_MARKER = "####"
"""GSM8K answers end with '#### <final answer>'."""


class TextTokenizer(Protocol):
    """The part of rlbatch.engine.tokenizer's Tokenizer that data loading needs."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class RawExample:
    """One dataset row: a prompt (text or chat messages) and its reference answer."""

    prompt: PromptContent
    answer: str
    fields: dict[str, Any] = field(default_factory=dict, hash=False)
    """The row's other fields."""
    where: str = ""
    """Where the row is in the file ("line 3", "row 7"), for error messages."""


@dataclass(frozen=True)
class RowProblem:
    """One bad row of a dataset file."""

    where: str
    message: str


class DatasetError(ValueError):
    """Every bad row of a dataset (the first MAX_LISTED_ERRORS listed, then a count)."""

    def __init__(self, path: str | None, problems: list[RowProblem]):
        self.path = path
        self.problems = list(problems)
        super().__init__(describe_problems(path, self.problems))


def describe_problems(path: str | None, problems: list[RowProblem]) -> str:
    """'3 bad row(s) in FILE:' then one indented line per row (first 20), then the rest's count."""
    lines = [f"{len(problems)} bad row(s) in {path}:"]
    lines += [f"    {p.where}: {p.message}" for p in problems[:MAX_LISTED_ERRORS]]
    if len(problems) > MAX_LISTED_ERRORS:
        lines.append(f"    ... and {len(problems) - MAX_LISTED_ERRORS} more")
    return "\n".join(lines)


ANSWER_READERS = ("exact_match", "math", "math_verify")
"""Built-in rewards that compare the reply with the row's answer."""


def read_examples(
    cfg: DataConfig, seed: int, *, need_answer: bool = True, verifiers: str | None = None
) -> tuple[list[RawExample], list[RowProblem]]:
    """The dataset's good rows in file order and every bad row (built-in: generated). Without
    ``need_answer`` (pure distillation: no reward) a row without data.answer_key has answer "".
    ``verifiers`` (env.agent.verifiers): the rows are that environment's tasks instead
    (rlbatch.rollout.agent.verifiers_env.taskset_rows; ValueError when it cannot load)."""
    if verifiers:
        from rlbatch.rollout.agent.verifiers_env import VerifiersError, taskset_rows

        try:
            tasks = taskset_rows(verifiers)
        except VerifiersError as err:
            raise ValueError(f"env.agent.verifiers={verifiers}: {err}") from err
        readers = [s for s in cfg.reward_fn or [cfg.reward] if s in ANSWER_READERS] if need_answer else []  # fmt: skip
        return [
            RawExample(prompt, answer or "", fields, where=f"task {fields['verifiers_task']}")
            for prompt, answer, fields in tasks
        ], [
            RowProblem(
                f"task {fields['verifiers_task']}",
                f"has no answer field, and data.reward {readers[0]} compares the reply with the"
                " row's answer (an empty answer would pay an empty reply): set data.reward=none"
                " (the environment's rewards alone) or give the tasks an answer",
            )
            for _, answer, fields in tasks
            if answer is None and readers
        ]
    source = DataSource(cfg.source)
    if source == DataSource.builtin:
        return [
            RawExample(e.prompt, e.answer, where=f"row {i}")
            for i, e in enumerate(generate_examples(cfg.task, cfg.num_prompts, seed))
        ], []
    if cfg.path is None:
        raise ValueError(
            f"data.path is null but data.source={source.value}: set data.path to a local"
            f" {source.value} file, or data.source=builtin"
        )
    path = Path(cfg.path).expanduser()
    if source == DataSource.hf_disk:
        if not path.is_dir():
            raise ValueError(f"data.path={cfg.path} is not a directory (HF datasets save_to_disk)")
        rows, problems = _read_hf_disk(path), list[RowProblem]()
    elif not path.is_file():
        raise ValueError(f"data.path={cfg.path} does not exist or is not a file: fix the path")
    elif source == DataSource.jsonl:
        rows, problems = _read_jsonl(path)
    else:
        rows, problems = _read_parquet(path), list[RowProblem]()
    examples = []
    for where, row in rows:
        if not need_answer and cfg.answer_key not in row:
            row = {**row, cfg.answer_key: ""}
        example = _row_to_example(row, where, cfg, problems)
        if example is not None:
            examples.append(example)
    problems.sort(key=lambda p: row_position(p.where))
    if not rows and not problems:
        problems.append(RowProblem("file", "holds no rows: a dataset needs at least one prompt"))
    return examples, problems


def load_examples(
    cfg: DataConfig, seed: int, *, need_answer: bool = True, verifiers: str | None = None
) -> list[RawExample]:
    """The dataset's rows in file order (``verifiers``: read_examples); DatasetError listing
    every bad row."""
    examples, problems = read_examples(cfg, seed, need_answer=need_answer, verifiers=verifiers)
    if problems:
        raise DatasetError(cfg.path, problems)
    return examples


Rows = list[tuple[str, Mapping[str, Any]]]


def row_position(where: str) -> int:
    """'line 12' / 'row 3' -> 12 / 3 (file order of the problems)."""
    tail = where.rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _read_jsonl(path: Path) -> tuple[Rows, list[RowProblem]]:
    rows: Rows = []
    problems: list[RowProblem] = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"line {line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                problems.append(
                    RowProblem(
                        where,
                        f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}):"
                        " re-encode the file as UTF-8",
                    )
                )
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(RowProblem(where, f"not valid JSON ({e.msg} at column {e.colno})"))
                continue
            if not isinstance(row, dict):
                problems.append(RowProblem(where, f"is a JSON {type(row).__name__}, not an object"))
                continue
            rows.append((where, row))
    return rows, problems


def _read_parquet(path: Path) -> Rows:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(
            f"data.path={path} is Parquet (data.source=parquet) but pyarrow is not installed:"
            " pip install pyarrow, or convert the file to JSONL and set data.source=jsonl"
        ) from e
    return [(f"row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]


def _read_hf_disk(path: Path) -> Rows:
    try:
        from datasets import Dataset, load_from_disk
    except ImportError as e:
        raise ValueError(
            f"data.path={path} is an HF datasets directory (data.source=hf_disk) but datasets"
            " is not installed: pip install 'rlbatch[datasets]'"
        ) from e
    ds = load_from_disk(str(path))
    if not isinstance(ds, Dataset):
        splits = list(ds.keys())
        raise ValueError(
            f"data.path={path} holds the splits {splits}: save one split"
            f" (ds[{splits[0]!r}].save_to_disk(PATH)) and point data.path at it"
        )
    return [(f"row {i}", row) for i, row in enumerate(ds)]


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt
    )


def _row_to_example(
    row: Mapping[str, Any], where: str, cfg: DataConfig, problems: list[RowProblem]
) -> RawExample | None:
    missing = [k for k in (cfg.prompt_key, cfg.answer_key) if k not in row]
    if missing:
        problems.append(
            RowProblem(
                where,
                f"no field {missing[0]!r} (fields: {sorted(row)}): set data.prompt_key /"
                " data.answer_key to the file's field names",
            )
        )
        return None
    prompt, answer = row[cfg.prompt_key], row[cfg.answer_key]
    if not isinstance(prompt, str) and not _is_messages(prompt):
        problems.append(
            RowProblem(
                where,
                f"{cfg.prompt_key!r} is {type(prompt).__name__}: it must be a string or a list"
                " of {role, content} messages",
            )
        )
        return None
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        problems.append(
            RowProblem(
                where,
                f"{cfg.answer_key!r} is {type(answer).__name__}: it must be a string or number",
            )
        )
        return None
    answer = str(answer)
    if AnswerFormat(cfg.answer_format) == AnswerFormat.gsm8k:
        if GSM8K_MARKER not in answer:
            problems.append(
                RowProblem(
                    where,
                    f"{cfg.answer_key!r} has no '{GSM8K_MARKER} <answer>' (data.answer_format=gsm8k):"
                    " fix the row, or set data.answer_format=raw",
                )
            )
            return None
        answer = extract_gsm8k_answer(answer)
    extra = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.answer_key)}
    return RawExample(prompt=prompt, answer=answer, fields=extra, where=where)


def extract_gsm8k_answer(text: str) -> str:
    """The final answer of a GSM8K solution: after its last '####', thousands commas removed."""
    return text.rsplit(GSM8K_MARKER, 1)[1].strip().replace(",", "")


def prompt_length_problems(
    cfg: DataConfig, tokenizer: TextTokenizer, examples: Sequence[RawExample]
) -> tuple[list[Prompt], list[RowProblem]]:
    """Templated, tokenized prompts and every prompt longer than data.max_prompt_len."""
    prompts, too_long = [], []
    for i, ex in enumerate(examples):
        text = apply_chat_template(cfg.chat_template, ex.prompt, tokenizer)
        ids = tuple(int(t) for t in tokenizer.encode(text))
        if len(ids) > cfg.max_prompt_len:
            too_long.append(
                RowProblem(
                    ex.where or f"index {i}",
                    f"prompt is {len(ids)} tokens (chat template included), over"
                    f" data.max_prompt_len={cfg.max_prompt_len}: raise data.max_prompt_len (and"
                    " the token budgets), or filter the dataset",
                )
            )
        prompts.append(
            Prompt(
                index=i,
                prompt_ids=ids,
                answer=ex.answer,
                text=text,
                fields=ex.fields,
                raw=ex.prompt,
            )
        )
    return prompts, too_long


def build_prompts(
    cfg: DataConfig, tokenizer: TextTokenizer, examples: Sequence[RawExample]
) -> list[Prompt]:
    """Template and tokenize `examples`; every prompt longer than max_prompt_len is an error."""
    prompts, too_long = prompt_length_problems(cfg, tokenizer, examples)
    if too_long:
        raise DatasetError(cfg.path if cfg.path else f"data.task={cfg.task.value}", too_long)
    return prompts


def load_prompts(
    cfg: DataConfig,
    tokenizer: TextTokenizer,
    seed: int,
    *,
    need_answer: bool = True,
    verifiers: str | None = None,
) -> list[Prompt]:
    """The tokenized prompt dataset ``data.*`` describes (``need_answer``, ``verifiers``:
    read_examples)."""
    examples = load_examples(cfg, seed, need_answer=need_answer, verifiers=verifiers)
    return build_prompts(cfg, tokenizer, examples)
