"""rlbatch-bench rollout --backend runs the backends side by side (tiny settings): one report
with each backend's tokens per CPU-second, start-up and weight-sync time, on the same rows."""

from __future__ import annotations

import json

import pytest


@pytest.mark.optional_extra
@pytest.mark.slow  # one vLLM start
def test_bench_rollout_backends_reports_both(capsys):
    pytest.importorskip("vllm")
    from rlbatch.bench import rollout as bench
    from rlbatch.bench.rollout_backends import format_report

    args = ["--backend", "vllm,megatron", "--models", "tiny", "--prompts", "2"]
    args += ["--generations", "2", "--max-new-tokens", "4", "--repeats", "1", "--json"]
    assert bench.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    (cell,) = doc["cells"]
    assert cell["model"] == "tiny" and cell["rows"] == 4
    figures = cell["backends"]
    assert set(figures) == {"vllm", "megatron"}
    for f in figures.values():
        assert 0 < f["tokens"] <= 4 * 4 and f["tokens_per_cpu_s"] > 0 and f["start_s"] > 0
    assert figures["vllm"]["weight_sync_s"] > 0  # the policy's weights streamed in
    assert figures["megatron"]["weight_sync_s"] == 0  # decodes on the policy's own weights
    report = format_report(doc["cells"])
    assert "vllm" in report and "megatron" in report and "tok/CPU-s" in report


def test_unknown_backend_is_refused():
    from rlbatch.bench.rollout_backends import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--backend", "sglang"])
