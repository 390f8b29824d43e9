"""rlbatch-score: score canned completions with the configured reward, no model, no GPU.

    rlbatch-score +recipe=grpo_code score.input=ROWS.jsonl score.output=OUT.jsonl [KEY=VALUE ...]

Each input line is a dataset row (``data.prompt_key``, ``data.answer_key``, any other fields
such as ``tests``) with a ``completion`` (text). The rewards are what a training run with the
same ``data.*`` keys would compute (``data.reward`` or ``data.reward_fn`` with weights, the
sandbox, served rewards, the reward model); the prompt is taken as written (no chat template).
Each output line, in input order: ``{"index", "reward", "parts", "failures"}``; a summary (mean
reward, failures by reason) goes to stdout. Checks before launch are rlbatch-train's.

With code_exec among the rewards, stub programs (returning None, NaN or an opaque object,
raising StopIteration, printing nothing, echoing the input) also run against every row's tests
(``score.stubs=true``, the default): each output line carries ``"stubs"`` (stub -> reward, the
stubs that earned one) and the summary names the rows a stub passes: tests a policy can game.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlbatch.cli.common import compose, fail_config, help_text
from rlbatch.config.errors import ConfigError, ConfigErrors
from rlbatch.config.schema import RunConfig

USAGE = (
    "score completions with the configured reward. rlbatch-score score.input=ROWS.jsonl "
    "score.output=OUT.jsonl [score.stubs=true|false] [+recipe=NAME] [data.reward=...]"
    " [KEY=VALUE ...]"
)
SCORE_SCOPE = frozenset({"data.reward"})
"""The data keys of the rewards (data.reward*, served, judge, ...): the dataset (data.path,
data.source) is not read."""
BATCH = 64
"""Rows scored together (one pool of sandboxes / requests)."""


def split_args(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """(score.* keys, the Hydra overrides)."""
    own = {
        a.split("=", 1)[0][len("score.") :]: a.split("=", 1)[1]
        for a in args
        if a.startswith("score.") and "=" in a
    }
    return own, [a for a in args if not a.startswith("score.")]


def _checks(source: str | None) -> Callable[[RunConfig], tuple[list[ConfigError], list[str]]]:
    """rlbatch-score's checks before scoring: the reward specs and the brought kinds' checks
    over the rows it scores (``score.input``), never the training dataset (data.path), which
    it does not read."""

    def checks(cfg: RunConfig) -> tuple[list[ConfigError], list[str]]:
        from rlbatch.grpo.preflight_rewards import check_brought_rewards, check_reward_specs
        from rlbatch.rewards.kinds import DatasetRows

        errors: list[ConfigError] = []
        check_reward_specs(cfg.data, errors)
        rows = None
        if source and Path(source).is_file():
            found, _ = read_rows(source)
            where = [f"line {n}" for n, _ in found]
            rows = DatasetRows("score.input", source, [r for _, r in found], where)
        check_brought_rewards(
            cfg.data, cfg.trainer.seed, errors, infer=cfg.batching.infer, rows=rows
        )
        return errors, []

    return checks


def read_rows(path: str) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    """The input rows with their line numbers, and every bad line (not JSON, not an object, no
    string completion)."""
    rows, bad = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            bad.append(f"line {n}: not valid JSON ({err})")
            continue
        if not isinstance(row, dict) or not isinstance(row.get("completion"), str):
            bad.append(f"line {n}: needs a JSON object with a string 'completion'")
            continue
        rows.append((n, row))
    return rows, bad


def _inputs(rows: list[dict[str, Any]], cfg: RunConfig, start: int) -> list[Any]:
    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.grpo.rewards import RewardInput

    tokenizer = build_tokenizer(cfg.model)
    out = []
    for i, row in enumerate(rows):
        fields = {
            k: v
            for k, v in row.items()
            if k not in (cfg.data.prompt_key, cfg.data.answer_key, "completion")
        }
        ids = tokenizer.encode(row["completion"])
        prompt = row.get(cfg.data.prompt_key, "")
        out.append(
            RewardInput(
                prompt=prompt if isinstance(prompt, str) else json.dumps(prompt),
                response=row["completion"],
                answer=str(row.get(cfg.data.answer_key, "")),
                num_response_tokens=len(ids),
                response_ids=tuple(ids),
                fields=fields,
                prompt_index=start + i,
                raw_prompt=prompt,
            )
        )
    return out


def score_rows(cfg: RunConfig, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One output record per row: index, total reward, parts by name, failures."""
    from rlbatch.grpo.rewards import build_rewards

    rewards = build_rewards(cfg.data, cfg.batching.infer)
    records = []
    for start in range(0, len(rows), BATCH):
        inputs = _inputs(rows[start : start + BATCH], cfg, start)
        totals, parts, failures = rewards.score_detailed(inputs)
        for j, total in enumerate(totals):
            records.append(
                {
                    "index": start + j,
                    "reward": total,
                    "parts": {name: values[j] for name, values in parts.items()},
                    "failures": [
                        {"part": name, "reason": f.reason, "detail": f.detail}
                        for name, f in failures[j]
                    ],
                }
            )
    return records


def stub_report(
    cfg: RunConfig, rows: list[dict[str, Any]], lines: list[int], records: list[dict[str, Any]]
) -> str | None:
    """code_exec's stub programs against every row's tests: ``records[i]["stubs"]`` (stub ->
    reward above 0) and the summary line (None without code_exec or a finding)."""
    from rlbatch.config.enums import RewardKind
    from rlbatch.grpo.rewards import brought_kinds
    from rlbatch.rewards.code_exec import row_test_problems
    from rlbatch.rewards.sandbox import probe_isolation
    from rlbatch.rewards.sandbox_stubs import describe, run_stubs

    if RewardKind.code_exec not in brought_kinds(cfg.data):
        return None
    isolation, _ = probe_isolation(cfg.data.code_exec.isolation)
    usable = [i for i, row in enumerate(rows) if not row_test_problems(row)]
    if isolation is None or not usable:
        return None
    where = [f"line {lines[i]}" for i in usable]
    found = run_stubs(cfg.data.code_exec, isolation, [rows[i] for i in usable], where)
    for i, result in zip(usable, found, strict=True):
        records[i]["stubs"] = result.rewards
    return describe(found, len(usable), "rows")


def _score_or_exit(cfg: RunConfig, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """score_rows, or the reason a reward stopped it as one message (exit 1, no traceback): a
    served request that failed with data.served.on_error=raise_error, a reward function that
    raised or returned something unusable."""
    from rlbatch.grpo.user_rewards import RewardCallError
    from rlbatch.rewards.served import ServedError

    try:
        return score_rows(cfg, rows)
    except (ServedError, RewardCallError) as err:
        print(f"rlbatch-score: error: {err}", file=sys.stderr)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in args):
        print(help_text("rlbatch-score", USAGE))
        return
    own, overrides = split_args(args)
    source = own.get("input")
    cfg = compose(overrides, "rlbatch-score", SCORE_SCOPE, extra=_checks(source))
    errors = []
    unknown = sorted(set(own) - {"input", "output", "stubs"})
    errors += [
        ConfigError(
            f"score.{k}", own[k], "unknown key; valid: score.input, score.output, score.stubs"
        )
        for k in unknown
    ]
    stubs = own.get("stubs", "true").lower()
    if stubs not in ("true", "false"):
        why = "true (run stub programs against every row's tests, with code_exec) or false"
        errors.append(ConfigError("score.stubs", own["stubs"], why))
    if not source or not Path(source).is_file():
        errors.append(
            ConfigError("score.input", source, "set an existing JSONL of rows with a 'completion'")
        )
    if not own.get("output"):
        errors.append(ConfigError("score.output", None, "set the output JSONL path"))
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    if source and Path(source).is_file():
        found, bad = read_rows(source)
        rows = [r for _, r in found]
        lines = [n for n, _ in found]
        if bad:
            errors.append(
                ConfigError(
                    "score.input", source, f"{len(bad)} bad line(s): " + "; ".join(bad[:20])
                )
            )
    if errors:
        fail_config(ConfigErrors(errors), "rlbatch-score")
    records = _score_or_exit(cfg, rows)
    weak = stub_report(cfg, rows, lines, records) if stubs == "true" else None
    Path(own["output"]).write_text("".join(json.dumps(r) + "\n" for r in records))
    reasons = Counter(f["reason"] for r in records for f in r["failures"])
    mean = sum(r["reward"] for r in records) / max(len(records), 1)
    print(f"rlbatch-score: {len(records)} rows, mean reward {mean:.4f}, failures {dict(reasons)}")
    if weak is not None:
        print(f"rlbatch-score: warning: {weak}")
    print(f"rlbatch-score: wrote {own['output']}")


if __name__ == "__main__":
    main()
