"""The harness docs/agents.md gives users to copy: its calculator tool evaluates arithmetic and
nothing a policy could write to run long or reach outside it."""

from __future__ import annotations

import re
import types

from conftest import REPO


def _harness():
    text = (REPO / "docs" / "agents.md").read_text()
    code = re.search(r"```python\n(# harness\.py.*?)```", text, re.S).group(1)
    module = types.ModuleType("harness")
    exec(compile(code, "harness.py", "exec"), module.__dict__)
    return module


def test_the_calculator_computes_arithmetic_and_refuses_the_rest_at_once():
    calc = _harness().calc
    assert calc("2 * (3 + 4) - 10 / 4") == "11.5"
    assert calc("-3*-3") == "9"
    for hostile in ["9**9**9**9", "__import__('os').system('true')", "(1).__class__",
                    "[1]*10**9", "1/0", "1" + "+1" * 5000, "(" * 500 + "1" + ")" * 500, ""]:  # fmt: skip
        assert calc(hostile) == "bad expression", hostile
