"""The stub check's pure parts (rlbatch.rewards.sandbox_stubs): which names the tests take from
the program, the sample of rows, and the line that reports what the stubs earned."""

from __future__ import annotations

from rlbatch.rewards.sandbox_stubs import (
    StubRewards,
    describe,
    program_names,
    sample_rows,
    stub_programs,
)


def test_the_tests_take_from_the_program_what_they_neither_bind_nor_get_from_python():
    code = (
        "import math\nfrom collections import Counter\n"
        "def test_a(self, x=1):\n    assert solve(x) == Counter(y for y in helper())\n"
        "class T:\n    pass\n"
        "assert math.isclose(area(1), 3.14) and len(sorted(items)) == 2\n"
    )
    assert program_names(code) == ["area", "helper", "items", "solve"]


def test_each_stub_binds_every_name_the_tests_take():
    programs = stub_programs({"test_code": "assert f(1) == g(2)"})
    assert set(programs) == {"returns None", "returns NaN", "returns an opaque object",
                             "raises StopIteration", "echoes its input", "prints nothing"}  # fmt: skip
    scope: dict = {}
    exec(programs["returns None"], scope)
    assert scope["f"](1) is None and scope["g"](2) is None
    exec(programs["echoes its input"], scope)
    assert scope["f"](7) == 7
    assert "def" not in programs["prints nothing"] and "f" not in programs["prints nothing"]
    io = stub_programs({"tests": [{"input": "1\n", "output": "1\n"}]})
    assert "sys.stdin.read()" in io["echoes its input"] and io["prints nothing"] == "pass"


def test_the_sample_is_seeded_sorted_and_whole_when_small():
    assert sample_rows(5, 8, seed=1) == [0, 1, 2, 3, 4]
    picked = sample_rows(100, 8, seed=3)
    assert picked == sorted(picked) and len(set(picked)) == 8
    assert sample_rows(100, 8, seed=3) == picked
    assert sample_rows(100, 8, seed=4) != picked


def test_the_report_counts_rows_passed_and_rows_partly_rewarded():
    found = [
        StubRewards("line 1", {}),
        StubRewards("line 2", {"returns None": 1.0, "echoes its input": 1.0}),
        StubRewards("line 3", {"echoes its input": 0.5}),
    ]
    line = describe(found, 3, "rows")
    assert line is not None
    assert (
        "stub programs pass the tests of 1 of 3 rows (line 2: returns None, echoes its input)"
        in line
    )
    assert "and earn part of the reward on 1 more (line 3: echoes its input 0.50)" in line
    assert describe([StubRewards("line 1", {})], 1, "rows") is None


def test_a_negative_sample_is_refused_naming_the_key():
    from rlbatch.config.schema import DataConfig
    from rlbatch.rewards.kinds import _check_code_exec

    data = DataConfig()
    data.code_exec.stub_check_rows = -1
    errors = [str(e) for e in _check_code_exec(data, None)]
    assert any(e.startswith("data.code_exec.stub_check_rows=-1: must be >= 0") for e in errors)
