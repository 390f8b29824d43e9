"""rlbatch.batching is pure: no torch, megatron, hydra, omegaconf, logging, rich, environment."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import rlbatch.batching

FORBIDDEN = [
    "torch",
    "torch.distributed",
    "megatron",
    "megatron.core",
    "hydra",
    "omegaconf",
    "logging",
    "rich",
    "numpy",
]


def test_import_leaves_heavy_modules_out() -> None:
    code = "import json, sys; import rlbatch.batching; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert not loaded.intersection(FORBIDDEN), sorted(loaded.intersection(FORBIDDEN))


def test_sources_have_no_forbidden_imports_or_environment_reads() -> None:
    root = Path(rlbatch.batching.__file__).parent
    pattern = re.compile(
        r"^\s*(import|from)\s+(torch|megatron|hydra|omegaconf|logging|rich|numpy)\b|os\.environ|getenv",
        re.MULTILINE,
    )
    sources = sorted(root.rglob("*.py"))
    assert sources
    for path in sources:
        hits = pattern.findall(path.read_text())
        assert not hits, f"{path.name}: {hits}"
