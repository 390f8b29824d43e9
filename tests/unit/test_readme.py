"""README's quick start is exactly two commands, and CI runs the README's test command."""

from __future__ import annotations

import re

from conftest import REPO


def _quick_start_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_quick_start_is_two_commands():
    commands = _quick_start_commands()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)
    assert "rlbatch-train +recipe=grpo_qwen" in commands[0]
    assert "pytest" in commands[1]
    assert all("torch==2.13.0" in c for c in commands)  # pinned CPU build


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert _quick_start_commands()[1] in ci
    assert "set -euo pipefail" in ci
