"""rlbatch-bench grpo --async --workload longtail through the real command: the variants train
the default recipe on the long tail of response lengths and report their figures."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.e2e


def test_longtail_bench_reports_every_variant(bin_dir, subprocess_env, tmp_path):
    argv = ["grpo", "--async", "--workload", "longtail", "--variants", "sync,run_ahead"]
    argv += ["--steps", "2", "--warmup", "1", "--repeats", "1", "--json"]
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-bench"), *argv],
        capture_output=True,
        text=True,
        env=subprocess_env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["setup"]["workload"] == "longtail" and list(doc["variants"]) == ["sync", "run_ahead"]
    for name, v in doc["variants"].items():
        assert v["step_time_s"] > 0 and v["tokens_per_s"] > 0, name
        assert v["generation_tokens_per_s"] > 0, name
        # the lognormal caps reach the engine of both the inline and the overlapped generation
        # (mean ~19 tokens of 128; uncapped, the tiny model averages ~95: EOS is rare)
        assert 10 < v["response_len_mean"] < 40, name
        occupancy = v["slot_occupancy"]
        assert occupancy is not None and 0 < occupancy <= 1, name
    assert set(doc["ratios"]) == {"run_ahead_over_sync"}
