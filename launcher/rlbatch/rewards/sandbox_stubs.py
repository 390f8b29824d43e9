"""Stub programs against a dataset's tests: tests a program passes without solving anything.

A policy trained with ``data.reward=code_exec`` learns whatever its rows' tests reward; a test
that a program returning ``None`` (or NaN, an opaque object), raising ``StopIteration``,
printing nothing or echoing its input passes is where it learns to hack instead. Each stub is
an ordinary program, scored by the same sandbox and the same scoring as the policy's (so
``data.code_exec.all_or_nothing`` applies): for ``test_code`` every name the tests take from
the program is bound to the stub's behaviour; for stdin/stdout cases the stub is the whole
program. ``rlbatch-score`` runs them over every row it scores; ``rlbatch-train`` over a seeded
sample of ``data.code_exec.stub_check_rows`` rows before launch, as a warning.
"""

from __future__ import annotations

import ast
import builtins
import json
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rlbatch.config.rewards import CodeExecConfig, Isolation

STUB_LIMIT_S = 2.0
"""The most CPU and wall seconds a stub execution gets (less when data.code_exec.limits gives
less): a stub computes nothing, so tests still running after that loop on its answer (``while
f(i) != 5``); they would otherwise hold the check for the whole limit, row after row."""

_OPAQUE = """class _Opaque:
    def __call__(self, *args, **kwargs):
        return self
    def __getattr__(self, name):
        return self
_opaque = _Opaque()
"""

FUNCTION_STUBS = {
    "returns None": "lambda *args, **kwargs: None",
    "returns NaN": "lambda *args, **kwargs: float('nan')",
    "returns an opaque object": "_opaque",
    "raises StopIteration": "_stop",
    "echoes its input": "lambda *args, **kwargs: args[0] if args else None",
    "prints nothing": None,
}
"""Stubs of a test_code row: what each name the tests take from the program is bound to (None:
the program defines nothing)."""

IO_STUBS = {
    "returns None": "print(None)",
    "returns NaN": "print(float('nan'))",
    "raises StopIteration": "raise StopIteration",
    "echoes its input": "import sys\nsys.stdout.write(sys.stdin.read())",
    "prints nothing": "pass",
}
"""Stubs of a row with stdin/stdout cases: the whole program."""


def program_names(test_code: str) -> list[str]:
    """The names ``test_code`` reads without binding them, that are neither built-ins nor
    standard modules: what it takes from the program."""
    loaded: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(ast.parse(test_code)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    python = set(dir(builtins)) | set(sys.stdlib_module_names)
    return sorted(loaded - bound - python)


def stub_programs(row: Mapping[str, Any]) -> dict[str, str]:
    """Stub name -> program for one row (test_code stubs when it has test_code, else the
    stdin/stdout ones)."""
    code = row.get("test_code")
    if not isinstance(code, str) or not code:
        return dict(IO_STUBS)
    names = program_names(code)
    programs = {}
    for stub, body in FUNCTION_STUBS.items():
        lines = [_OPAQUE, "def _stop(*args, **kwargs):\n    raise StopIteration\n"]
        if body is not None:
            lines += [f"{name} = {body}\n" for name in names]
        programs[stub] = "".join(lines) if body is not None else "pass\n"
    return programs


@dataclass(frozen=True)
class StubRewards:
    """The stubs that earned a reward on one row."""

    where: str
    """Where the row is ("line 3")."""
    rewards: dict[str, float]
    """Stub name -> its reward, for the stubs scoring above 0."""

    @property
    def passed(self) -> list[str]:
        """The stubs that earned the whole reward."""
        return [s for s, r in self.rewards.items() if r >= 1.0]


def _tests_key(row: Mapping[str, Any]) -> str:
    return json.dumps([row.get("tests"), row.get("test_code")], sort_keys=True, default=str)


def run_stubs(
    cfg: CodeExecConfig,
    isolation: Isolation,
    rows: Sequence[Mapping[str, Any]],
    where: Sequence[str],
) -> list[StubRewards]:
    """Every stub against every row's tests (rows with the same tests scored once): one
    StubRewards per row, in order."""
    from rlbatch.rewards.code_exec import CodeExecReward

    unique: dict[str, Mapping[str, Any]] = {}
    for row in rows:
        unique.setdefault(_tests_key(row), row)
    completions, fields, owners = [], [], []
    for key, row in unique.items():
        for stub, program in stub_programs(row).items():
            completions.append(program)  # no fence: the program under either data.code_exec.code
            fields.append(row)
            owners.append((key, stub))
    limits = replace(
        cfg.limits,
        cpu_s=min(cfg.limits.cpu_s, STUB_LIMIT_S),
        wall_s=min(cfg.limits.wall_s, STUB_LIMIT_S),
    )
    scored = CodeExecReward(replace(cfg, limits=limits), isolation).score(completions, fields)
    earned: dict[str, dict[str, float]] = {key: {} for key in unique}
    for (key, stub), result in zip(owners, scored, strict=True):
        if result.value > 0:
            earned[key][stub] = result.value
    return [StubRewards(w, earned[_tests_key(r)]) for r, w in zip(rows, where, strict=True)]


def sample_rows(num_rows: int, count: int, seed: int) -> list[int]:
    """A seeded sample of ``count`` row indices (all of them when there are fewer), sorted."""
    if count >= num_rows:
        return list(range(num_rows))
    return sorted(random.Random(seed).sample(range(num_rows), count))


def describe(found: Sequence[StubRewards], checked: int, what: str) -> str | None:
    """One line on the rows a stub passes or earns part of the reward on (None: none)."""
    passed = [f for f in found if f.passed]
    partly = [f for f in found if f.rewards and not f.passed]
    if not passed and not partly:
        return None
    parts = []
    if passed:
        listed = "; ".join(f"{f.where}: {', '.join(f.passed)}" for f in passed[:10])
        more = f"; and {len(passed) - 10} more" if len(passed) > 10 else ""
        parts.append(
            f"stub programs pass the tests of {len(passed)} of {checked} {what} ({listed}{more})"
        )
    if partly:
        listed = "; ".join(
            f"{f.where}: " + ", ".join(f"{s} {r:.2f}" for s, r in f.rewards.items())
            for f in partly[:10]
        )
        more = f"; and {len(partly) - 10} more" if len(partly) > 10 else ""
        lead = "and earn" if passed else "stub programs earn"
        tail = "more" if passed else f"of {checked} {what}"
        parts.append(f"{lead} part of the reward on {len(partly)} {tail} ({listed}{more})")
    return (
        " ".join(parts)
        + ": a policy can learn to game these tests instead of solving the task; make them"
        " check the answer (a stub returns None, NaN or an opaque object, raises"
        " StopIteration, prints nothing or echoes its input)"
    )
