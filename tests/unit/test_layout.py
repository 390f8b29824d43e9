"""ParallelLayout: the one, pure, validated description of a process's place in the grid."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from conftest import REPO
from rlbatch.layout import ParallelLayout


def test_a_single_process_by_default():
    layout = ParallelLayout()
    assert layout.world_size == 1 and layout.is_first_stage and layout.is_last_stage
    assert layout.sizes() == {"tp": 1, "pp": 1, "vpp": 1, "cp": 1, "dp": 1}


def test_world_size_and_stages_follow_the_degrees():
    layout = ParallelLayout(tp=2, pp=2, vpp=2, dp=2, rank=5, tp_rank=1, pp_rank=1, dp_rank=1)
    assert layout.world_size == 8
    assert layout.is_last_stage and not layout.is_first_stage
    assert layout.sizes() == {"tp": 2, "pp": 2, "vpp": 2, "cp": 1, "dp": 2}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp": 0}, r"tp=0: must be >= 1"),
        ({"dp": 2, "dp_rank": 2}, r"dp_rank=2: not in \[0, 2\)"),
        ({"pp": 2, "rank": 2}, r"rank=2: not in \[0, 2\)"),
    ],
)
def test_an_impossible_layout_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**kwargs)


def test_the_layout_module_is_pure():
    code = "import sys, rlbatch.layout; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_other_layout_type_in_the_package():
    """ParallelConfig is what the user asks for, ParallelLayout what a process got; no third
    shape of the same facts (a per-package Layout, a ParallelState, a dict of sizes)."""
    names = {"Layout", "ParallelState", "ParallelDims"}
    found = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name}"
        for path in (REPO / "launcher" / "rlbatch").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name in names
    ]
    assert found == []
