"""rlbatch-bench servers through the real command, at the tiny model: a colocated vLLM run and
a run on a server the launcher starts, each two steps, printed as a table (no timing checked:
the figures are for docs/rollout.md, not a target)."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.optional_extra]


def test_servers_bench_prints_both_backends(bin_dir, subprocess_env, tmp_path):
    pytest.importorskip("vllm")
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-bench"), "servers", "--models", "tiny", "--steps", "2",
         "--warmup", "1", "--", "rollout.vllm.kv_cache_space_gb=0.25"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    header, *rows = proc.stdout.strip().splitlines()
    assert header.split() == ["model", "variant", "step_time_s", "weight_sync_s", "wait_s",
                              "hidden_share"]  # fmt: skip
    assert [r.split()[:2] for r in rows] == [["tiny", "colocated"], ["tiny", "servers"]]
    for row in rows:  # every figure measured: a run that did not train would be refused
        assert "refused" not in row and "n/a" not in row, row
        assert float(row.split()[2]) > 0 and float(row.split()[3]) > 0
