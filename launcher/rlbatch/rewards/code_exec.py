"""``data.reward=code_exec``: the completion's program runs in a sandbox against the row's tests.

A row carries ``tests`` (a list of ``{"input": str, "output": str}``: the program reads
``input`` on stdin and must print ``output``, compared here, outside the sandbox) and/or
``test_code`` (Python with asserts, run in a process of their own against what the program
defines: only the asserts' verdict passes it, never the program's exit status). Every stdin/stdout case and the test_code are one
execution each, each in its own sandbox (rlbatch.rewards.sandbox), all of a batch through a
pool of ``data.code_exec.num_workers``. The reward is the fraction of executions that passed
(or 1/0 with ``data.code_exec.all_or_nothing``); every failure keeps its reason.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlbatch.config.rewards import CodeExecConfig, CodeSource, Isolation
from rlbatch.rewards.base import Failure, Scored, run_bounded
from rlbatch.rewards.sandbox import Execution, Outcome, execute, longest_s
from rlbatch.runtime import progress

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_program(completion: str, source: CodeSource) -> str:
    """The program of a completion: the last fenced block (```python, ```py or a plain ```;
    the whole completion when it has no closed fence), or the whole completion."""
    if CodeSource(source) == CodeSource.whole:
        return completion
    blocks = [body for lang, body in _FENCE.findall(completion) if lang in ("", "python", "py")]
    return blocks[-1] if blocks else completion


def row_test_problems(fields: Mapping[str, Any]) -> list[str]:
    """What is wrong with a row's tests (empty when they are usable)."""
    tests, code = fields.get("tests"), fields.get("test_code")
    if tests is None and code is None:
        return ["no field 'tests' or 'test_code': add stdin/stdout cases or assert code"]
    problems = []
    if tests is not None:
        if not isinstance(tests, list):
            problems.append(f"'tests' is a {type(tests).__name__}, not a list")
        else:
            for i, case in enumerate(tests):
                ok = isinstance(case, dict) and all(
                    isinstance(case.get(k), str) for k in ("input", "output")
                )
                if not ok:
                    problems.append(
                        f"tests[{i}] is {str(case)[:60]!r}: each test is"
                        ' {"input": str, "output": str}'
                    )
    if code is not None:
        if not isinstance(code, str):
            problems.append(f"'test_code' is a {type(code).__name__}, not a string")
        else:
            try:
                compile(code, "test_code", "exec")
            except SyntaxError as err:
                problems.append(f"'test_code' does not compile: {err.msg} (line {err.lineno})")
    if tests == [] and code is None:
        problems.append("'tests' is empty and there is no 'test_code'")
    return problems


@dataclass(frozen=True)
class _Job:
    sample: int
    program: str
    stdin: str
    expected: str | None
    """Expected stdout (None: a test_code execution, judged by the asserts' verdict)."""
    label: str
    test_code: str | None = None


def _jobs(sample: int, program: str, fields: Mapping[str, Any]) -> list[_Job]:
    jobs = [
        _Job(sample, program, case["input"], case["output"], f"test {i}")
        for i, case in enumerate(fields.get("tests") or [])
    ]
    if fields.get("test_code"):
        jobs.append(_Job(sample, program, "", None, "test_code", fields["test_code"]))
    return jobs


def _lines(text: str) -> list[str]:
    """Output compared line by line, trailing whitespace and trailing blank lines ignored."""
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def judge_execution(job: _Job, run: Execution) -> Failure | None:
    """None when the execution passed, else why it failed."""
    if run.outcome != Outcome.ok:
        detail = (
            run.detail or _last_line(run.stderr) or f"exit {run.exit_code}, signal {run.signal}"
        )
        return Failure(run.outcome.value, f"{job.label}: {detail}")
    if job.expected is not None and _lines(run.stdout) != _lines(job.expected):
        return Failure(
            "wrong_answer",
            f"{job.label}: expected {job.expected[:80]!r}, got {run.stdout[:80]!r}",
        )
    return None


class CodeExecReward:
    """Scores a batch of completions by running their programs against their rows' tests."""

    def __init__(self, cfg: CodeExecConfig, isolation: Isolation) -> None:
        self.cfg = cfg
        self.isolation = isolation

    def _run(self, job: _Job) -> Failure | None:
        run = execute(job.program, job.stdin, self.cfg.limits, self.isolation, job.test_code)
        return judge_execution(job, run)

    def score(
        self, completions: Sequence[str], fields: Sequence[Mapping[str, Any]]
    ) -> list[Scored]:
        """One Scored per completion (``fields``: its row's fields, with tests / test_code)."""
        jobs: list[_Job] = []
        failures: list[list[Failure]] = [[] for _ in completions]
        counts = [0] * len(completions)
        for i, (text, row) in enumerate(zip(completions, fields, strict=True)):
            program = extract_program(text, self.cfg.code)
            todo = _jobs(i, program, row)
            counts[i] = len(todo)
            try:
                compile(program, "program.py", "exec")
            except (SyntaxError, ValueError) as err:
                why = f"{getattr(err, 'msg', err)} (line {getattr(err, 'lineno', '?')})"
                failures[i] = [Failure("syntax", f"{j.label}: {why}") for j in todo]
                continue
            jobs.extend(todo)
        with progress.user_call(f"code_exec: {len(jobs)} sandboxed executions", self._bound(jobs)):
            results = run_bounded(self._run, jobs, self.cfg.num_workers)
        for job, failure in zip(jobs, results, strict=True):
            if failure is not None:
                failures[job.sample].append(failure)
        return [self._scored(n, f) for n, f in zip(counts, failures, strict=True)]

    def _bound(self, jobs: Sequence[_Job]) -> float:
        """The longest the batch may take (each wave of num_workers executions at most what
        the host waits for one: the sandbox's start-up and the hard ceiling of a program
        starved on a busy machine): the watchdog's bound instead of trainer.timeout_s."""
        waves = -(-len(jobs) // max(1, self.cfg.num_workers))
        return waves * longest_s(self.cfg.limits) + 60.0

    def _scored(self, num_tests: int, failures: list[Failure]) -> Scored:
        passed = num_tests - len(failures)
        if self.cfg.all_or_nothing:
            value = 1.0 if num_tests and not failures else 0.0
        else:
            value = passed / num_tests if num_tests else 0.0
        return Scored(value, tuple(failures))
