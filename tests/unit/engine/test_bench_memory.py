"""rlbatch-bench memory's arithmetic (the measurements themselves need the 151,936-vocabulary
model and minutes: docs/benchmarks.md has them)."""

from __future__ import annotations

import pytest

from rlbatch.bench import memory as bench


def _run(chunk: int, pass_gb: float, seconds: float) -> dict:
    return {"pass": "train", "tokens": 4096, "chunk": chunk, "pass_gb": pass_gb,
            "peak_rss_gb": pass_gb + 1.0, "seconds": seconds, "cpu_seconds": seconds}  # fmt: skip


def test_summary_attributes_memory_to_the_head_and_takes_medians():
    runs = [
        _run(bench.BODY, 2.0, 5.0),
        _run(0, 12.0, 10.0), _run(1024, 3.0, 9.0),
        _run(0, 14.0, 12.0), _run(1024, 3.0, 11.0),
        _run(0, 13.0, 11.0), _run(1024, 4.0, 10.0),
    ]  # fmt: skip
    rows = {r["chunk"]: r for r in bench.summarize(runs)}
    assert rows[0]["pass_gb"] == 13.0 and rows[1024]["pass_gb"] == 3.0  # medians
    assert rows[0]["head_gb"] == 11.0 and rows[1024]["head_gb"] == 1.0
    assert rows[1024]["head_reduction"] == 11.0
    assert rows[1024]["time_vs_full"] == pytest.approx(10.0 / 11.0)
    assert rows[bench.BODY]["head_gb"] == 0.0


def test_failed_child_is_reported_not_dropped():
    runs = [_run(bench.BODY, 2.0, 5.0), {"pass": "train", "tokens": 4096, "chunk": 0,
            "error": "MemoryError"}, _run(1024, 3.0, 9.0)]  # fmt: skip
    rows = {r["chunk"]: r for r in bench.summarize(runs)}
    assert rows[0]["error"] == "MemoryError" and "seconds" not in rows[0]
    assert rows[1024]["head_gb"] == 1.0 and "time_vs_full" not in rows[1024]


def test_parse_rejects_bad_sizes():
    args = bench.parse(["--tokens", "4096,16384", "--chunks", "0,512"])
    assert args.tokens == [4096, 16384] and args.chunks == [0, 512]
    with pytest.raises(SystemExit):
        bench.parse(["--tokens", "5000"])
    with pytest.raises(SystemExit):
        bench.parse(["--passes", "train,generate"])
