"""Whether a model path names a Hugging Face hub id (pure: the validator and the engine's hub
loader both ask, and config/ stays below engine/)."""

from __future__ import annotations

from pathlib import Path


def looks_like_hub_id(value: str) -> bool:
    """org/name (or name) that is not an existing path and has no path-like pieces."""
    if Path(value).exists() or value.startswith((".", "/", "~")):
        return False
    parts = value.split("/")
    return len(parts) <= 2 and all(parts)
