"""rlbatch-bench engine runs end to end (tiny model, a handful of samples)."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

import json

from engine_helpers import megatron_world  # noqa: F401

from rlbatch.bench import engine as bench


def test_bench_engine_json(megatron_world, capsys):
    args = ["--models", "tiny", "--num-samples", "12", "--repeats", "1", "--json"]
    assert bench.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in doc["rows"]}
    assert set(rows) == set(bench.MODES)
    assert rows["naive"]["ratio"] == 1.0
    assert all(r["real_tokens"] == rows["naive"]["real_tokens"] for r in rows.values())
    assert rows["packed"]["padding_efficiency"] >= rows["naive"]["padding_efficiency"]
