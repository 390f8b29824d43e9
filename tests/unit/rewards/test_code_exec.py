"""code_exec: what counts as the program, which rows have usable tests, and the reward of a
batch run in the real sandbox (fraction of tests passed or all-or-nothing, every failure's
reason)."""

from __future__ import annotations

import pytest

from rlbatch.config.rewards import CodeExecConfig, CodeSource, Isolation, SandboxLimits
from rlbatch.rewards.code_exec import CodeExecReward, extract_program, row_test_problems
from rlbatch.rewards.sandbox import probe_isolation


def test_namespaces_work_here():
    """CI runs as root with util-linux: the sandbox is always available (never skipped)."""
    isolation, why = probe_isolation(Isolation.auto)
    assert isolation == Isolation.unshare, why


def test_program_is_the_last_python_or_plain_fence_else_the_whole_text():
    text = "try:\n```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\n```text\nnot code\n```"
    assert extract_program(text, CodeSource.last_block) == "print(2)\n"
    assert extract_program("```\nx = 1\n```", CodeSource.last_block) == "x = 1\n"
    assert extract_program("print(3)", CodeSource.last_block) == "print(3)"
    assert extract_program("```python\nunclosed", CodeSource.last_block) == "```python\nunclosed"
    assert extract_program(text, CodeSource.whole) == text


def test_rows_without_usable_tests_are_named():
    assert row_test_problems({"tests": [{"input": "1", "output": "1"}]}) == []
    assert row_test_problems({"test_code": "assert f(1) == 2"}) == []
    assert "no field 'tests' or 'test_code'" in row_test_problems({})[0]
    assert "tests[1]" in row_test_problems({"tests": [{"input": "", "output": ""}, {"in": 1}]})[0]
    assert "does not compile" in row_test_problems({"test_code": "assert ("})[0]
    assert "not a list" in row_test_problems({"tests": "1 -> 2"})[0]


ROW = {
    "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}],
    "test_code": "assert add(2, 2) == 4",
}
RIGHT = "```python\ndef add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    import sys\n    data = sys.stdin.read().split()\n    if data:\n        print(add(*map(int, data)))\n```"
HALF = "def add(a, b):\n    return a * b if a == 5 else a + b\nimport sys\nd = sys.stdin.read().split()\nif d:\n    print(add(*map(int, d)))"


@pytest.mark.parametrize("all_or_nothing", [False, True])
def test_reward_is_the_fraction_of_tests_passed_with_each_failure_reason(all_or_nothing):
    cfg = CodeExecConfig(
        all_or_nothing=all_or_nothing, limits=SandboxLimits(cpu_s=2, wall_s=4), num_workers=2
    )
    reward = CodeExecReward(cfg, Isolation.unshare)
    out = reward.score(
        [RIGHT, HALF, "def add(a, b) return", "```python\nprint('?')\n```"], [ROW] * 4
    )
    assert [s.value for s in out] == (
        [1.0, 0.0, 0.0, 0.0] if all_or_nothing else [1.0, 2 / 3, 0.0, 0.0]
    )
    assert out[0].failures == ()
    assert [f.reason for f in out[1].failures] == ["wrong_answer"]
    assert "test 1: expected '10', got '25" in out[1].failures[0].detail
    assert [f.reason for f in out[2].failures] == ["syntax"] * 3
    # prints '?' for both stdin cases; test_code fails on the undefined add (a NameError: crash)
    assert sorted(f.reason for f in out[3].failures) == ["crash", "wrong_answer", "wrong_answer"]


def test_the_watchdogs_bound_covers_what_the_sandbox_may_take():
    """The batch's bound (the watchdog stops the run past it) was waves x (wall_s + 5) + 60 s,
    while one execution may legitimately take its start-up (60 s) and 10 x wall_s on a busy
    machine: with wall_s=10 one slow wave (up to 165 s) stopped the run at 75 s as a hang."""
    from rlbatch.config.rewards import CodeExecConfig, SandboxLimits
    from rlbatch.rewards.code_exec import CodeExecReward, _Job

    cfg = CodeExecConfig(num_workers=2, limits=SandboxLimits(wall_s=10.0))
    reward = CodeExecReward(cfg, Isolation.unshare)
    jobs = [_Job(0, "", "", "", f"test {i}") for i in range(3)]  # two waves
    assert reward._bound(jobs) >= 2 * (60 + 10 * 10.0 + 5)
