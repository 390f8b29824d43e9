"""rlbatch-bench rollout --occupancy runs end to end (tiny settings): every decoding batch size
and path generates the same rows (caps are keyed by row), each reports its occupancy."""

from __future__ import annotations

import json


def test_bench_rollout_occupancy_json(capsys):
    from rlbatch.bench import rollout as bench

    args = ["--occupancy", "--chunk-prompts", "2,1", "--rounds", "2", "--prompts", "2"]
    args += ["--generations", "2", "--max-new-tokens", "16", "--median", "4", "--json"]
    assert bench.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    cells = doc["cells"]
    assert [(c["slots"], c["path"]) for c in cells] == [
        (4, "continuous"), (4, "lockstep"), (2, "continuous"), (2, "lockstep"),
    ]  # fmt: skip
    assert len({c["tokens_per_round"] for c in cells}) == 1  # the same rows on every path
    for c in cells:
        assert 0 < c["occupancy_min"] <= c["occupancy_mean"] <= c["occupancy_max"] <= 1
        assert c["decode_steps_per_round"] >= c["tokens_per_round"] / c["slots"]
        assert c["tokens_per_decode_step"] <= c["slots"]
