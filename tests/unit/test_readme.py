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
    assert all("torch==2.13.0" in c for c in commands)  # the pinned version


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert _quick_start_commands()[1] in ci
    assert "set -euo pipefail" in ci


def _common_commands() -> list[list[str]]:
    """Each rlbatch-train / rlbatch-plan line of README's 'Common commands', as argv."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Common commands", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[0].replace("\\\n", " ")
    commands = []
    for line in block.splitlines():
        words = line.split("#", 1)[0].split()
        if words and words[0] in ("rlbatch-train", "rlbatch-plan"):
            commands.append(words)
    return commands


def test_common_commands_compose_and_validate(tmp_path):
    """The README's examples are configs users paste: each one must validate as shown (a sweep
    with its first value of every swept key; a distillation teacher the reader trains first,
    <run_dir>/hf of the line before, stood in for by a directory)."""
    from rlbatch.cli.common import compose
    from rlbatch.config.validate import PLAN_SCOPE

    commands = _common_commands()
    assert len(commands) >= 6
    for command, *args in commands:
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        overrides = [a.split(",")[0] for a in overrides]  # -m sweeps: the first point
        overrides = [
            f"grpo.distill.teacher={tmp_path}"
            if a.startswith("grpo.distill.teacher=") and a != "grpo.distill.teacher=null"
            else a
            for a in overrides
        ]
        scope = PLAN_SCOPE if command == "rlbatch-plan" else None
        try:
            compose(overrides, command, scope)
        except SystemExit as exc:  # compose prints the errors
            raise AssertionError(f"README example does not validate: {command} {args}") from exc


def test_partial_rollouts_are_shown_with_the_settings_they_need():
    """grpo.partial_rollouts=true alone is refused (it needs generation ahead,
    grpo.num_steps_async >= 1, and grpo.max_staleness >= 2): every mention in the README
    carries both, and a Common commands line that validates shows it."""
    assert any("grpo.partial_rollouts=true" in c for c in _common_commands())
    text = " ".join((REPO / "README.md").read_text().split())
    mentions = [m.start() for m in re.finditer(r"grpo\.partial_rollouts=true", text)]
    assert mentions
    for at in mentions:
        before = text[max(0, at - 80) : at]
        assert "grpo.num_steps_async=1" in before and "grpo.max_staleness=2" in before, before


def test_quick_start_gives_the_cpu_index_for_the_pinned_torch():
    """The pin is a version, not a build: where no local CPU wheel is provided, pip resolves
    it to the CUDA build, so the quick start names PyTorch's CPU index for the same version."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    pins = {re.search(r"torch==(\S+)", c).group(1) for c in _quick_start_commands()}  # type: ignore[union-attr]
    assert len(pins) == 1
    index = "--index-url https://download.pytorch.org/whl/cpu"
    assert f"pip install torch=={pins.pop()} {index}" in section
    assert "CUDA build" in section and "Python 3.12 or 3.13" in section
