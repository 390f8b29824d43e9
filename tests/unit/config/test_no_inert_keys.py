"""No inert keys: every schema field is read by code outside rlbatch/config/.

A field is *read* when some module of the package outside config/ (the schema, validator and
loader only describe and check it) accesses it as an attribute (``.field``). The allow-list
names the fields read in another way, each with the reason; an entry that is no longer needed
fails too, so the list stays true.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from rlbatch.config.schema import RunConfig

PACKAGE = Path(__import__("rlbatch").__file__).parent

ALLOWED: dict[str, str] = {
    # "dotted.key": "why no attribute access outside config/ reads it",
}


def _fields(cls: type, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, attribute name) of every field, sections included."""
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.append((key, f.name))
        default = f.default_factory() if callable(f.default_factory) else f.default
        if dataclasses.is_dataclass(default):
            out += _fields(type(default), key + ".")
    return out


def _source_outside_config() -> str:
    return "\n".join(
        p.read_text() for p in PACKAGE.rglob("*.py") if "config" not in p.relative_to(PACKAGE).parts
    )


def test_every_field_is_read_outside_config():
    source = _source_outside_config()
    inert = [
        key
        for key, name in _fields(RunConfig)
        if key not in ALLOWED and not re.search(rf"\.{re.escape(name)}\b", source)
    ]
    assert inert == [], f"schema fields no code reads (remove them, or allow-list why): {inert}"


def test_allow_list_is_current():
    keys = {key for key, _ in _fields(RunConfig)}
    assert set(ALLOWED) <= keys, set(ALLOWED) - keys
