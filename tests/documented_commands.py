"""The commands users copy: every ``rlbatch-*`` command line that a recipe's header comment or a
page of docs/ (and README.md) shows, with where it is written.

A markdown command is a line of a fenced ``bash`` / ``sh`` / ``shell`` / ``console`` block or of
an indented block that starts with a command name (after an optional ``$ `` prompt and
``VAR=value`` environment assignments); a recipe command is one in the header's comment lines.
Continuation lines (a trailing backslash) are joined and trailing ``# comments`` dropped.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

COMMANDS = (
    "rlbatch-train", "rlbatch-plan", "rlbatch-score", "rlbatch-eval", "rlbatch-export",
    "rlbatch-logprobs", "rlbatch-bench",
)  # fmt: skip
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
_FENCE = re.compile(r"^\s*```([\w-]*)\s*$")


@dataclass(frozen=True)
class Command:
    where: str
    """file:line of the command's first line."""
    text: str
    """The command as written (continuations joined, comment dropped)."""

    @property
    def argv(self) -> list[str]:
        """The words from the command name on (environment assignments dropped)."""
        words = shlex.split(self.text)
        while words and _ENV.match(words[0]):
            words = words[1:]
        return words

    @property
    def name(self) -> str:
        return self.argv[0]


def _strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote == ch else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _commands_in(lines: list[tuple[int, str]], where: str) -> list[Command]:
    """Commands among (line number, text) lines of one block."""
    out, i = [], 0
    while i < len(lines):
        number, text = lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i][1].strip()
        text = _strip_comment(text.strip().removeprefix("$ "))
        i += 1
        try:
            words = shlex.split(text)
        except ValueError:
            continue
        while words and _ENV.match(words[0]):
            words = words[1:]
        if words and words[0] in COMMANDS:
            out.append(Command(f"{where}:{number}", text))
    return out


def markdown_commands(path: Path, root: Path) -> list[Command]:
    where = str(path.relative_to(root))
    out: list[Command] = []
    block: list[tuple[int, str]] | None = None
    shell = False
    indented: list[tuple[int, str]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fence = _FENCE.match(line)
        if block is None and fence:
            block, shell = [], fence.group(1) in ("bash", "sh", "shell", "console")
            continue
        if block is not None:
            if fence:
                out += _commands_in(block, where) if shell else []
                block = None
            else:
                block.append((number, line))
            continue
        if line.startswith("    ") and line.strip():
            indented.append((number, line))
        elif indented and line.strip():
            out += _commands_in(indented, where)
            indented = []
    return out + _commands_in(indented, where)


def recipe_commands(path: Path, root: Path) -> list[Command]:
    header = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.startswith("#"):
            break
        text = line[1:]
        start = text.find("rlbatch-")
        if start >= 0:
            text = text[start:]
        header.append((number, text))
    return _commands_in(header, str(path.relative_to(root)))


def documented_commands(root: Path) -> list[Command]:
    """Every command of recipes/*.yaml headers, docs/*.md and README.md, in that order."""
    out = []
    for path in sorted((root / "recipes").glob("*.yaml")):
        out += recipe_commands(path, root)
    for path in [*sorted((root / "docs").glob("*.md")), root / "README.md"]:
        out += markdown_commands(path, root)
    return out
