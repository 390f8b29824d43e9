"""User-facing configuration errors: dotted key, bad value, and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConfigError:
    key: str
    """Dotted config key, e.g. batching.train.max_tokens."""
    value: Any
    message: str
    """What is wrong and how to fix it."""

    def __str__(self) -> str:
        return f"{self.key}={_show(self.value)}: {self.message}"


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(getattr(value, "name", value))


class ConfigErrors(ValueError):
    """Every error found in one pass over a config."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"{len(self.errors)} configuration error(s):\n{lines}")
