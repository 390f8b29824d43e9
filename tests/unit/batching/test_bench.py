"""rlbatch-bench batching on a small grid: rows, figures and the naive baseline's overflow."""

from __future__ import annotations

import json

import pytest

from rlbatch.bench.batching import main


def test_small_grid_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--sizes", "256", "--dp", "2,8", "--workloads", "grpo_math,bimodal", "--json"]
    assert main(argv + ["--repeats", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 5
    for row in rows:
        assert row["k"] >= row["lower_bound"]
        if row["mode"] != "naive":
            assert row["over_budget"] == 0
    naive = [r for r in rows if r["mode"] == "naive"]
    assert any(r["over_budget"] > 0 for r in naive)  # the baseline ignores the budget


def test_table_and_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--sizes", "128", "--dp", "4", "--workloads", "uniform", "--repeats", "1"]
    assert main(argv) == 0
    assert "lockstep" in capsys.readouterr().out
    assert main(argv + ["--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| workload |") and "Target misses" in out
