"""rlbatch-bench rollout and rlbatch-bench grpo --against trl run end to end (tiny settings):
every cell reports both frameworks' tokens/s on the same workload."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_bench_rollout_json(capsys):
    from rlbatch.bench import rollout as bench

    args = ["--models", "tiny", "--batch-sizes", "4", "--spreads", "uniform,longtail"]
    args += ["--rows", "8", "--max-new-tokens", "4", "--repeats", "1", "--json"]
    assert bench.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(c["batch"], c["spread"]) for c in doc["cells"]] == [(4, "uniform"), (4, "longtail")]
    for cell in doc["cells"]:
        assert set(cell["tokens_per_s"]) == {"hf", "rlbatch", "rlbatch_lockstep"}
        assert all(v > 0 for v in cell["tokens_per_s"].values())


@pytest.mark.optional_extra
def test_bench_grpo_against_trl_json(capsys):
    pytest.importorskip("trl")  # the optional bench extra
    from rlbatch.bench import grpo_main as bench

    args = ["--against", "trl", "--models", "tiny", "--workload", "issue"]
    args += ["--completion-tokens", "4", "--trl-ckpt", "both"]
    assert bench.main(args + ["--repeats", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["trl_gradient_checkpointing"] for c in doc["cells"]] == [True, False]
    for cell in doc["cells"]:
        assert set(cell["tokens_per_s"]) == {"trl", "dynamic", "packed"}
        assert all(v > 0 for v in cell["tokens_per_s"].values())
        for phases in cell["phase_seconds"].values():  # generation + reference, train
            assert phases["gen"] > 0 and phases["train"] > 0


@pytest.mark.slow
def test_bench_rollout_env_json(capsys):
    """rlbatch-bench rollout --env: multi-turn episodes through the built-in environment, with
    the slots' occupancy while rows wait."""
    from rlbatch.bench import rollout as bench

    args = ["--env", "guess_number", "--rows", "8", "--slots", "4", "--max-new-tokens", "6"]
    assert bench.main(args + ["--repeats", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["env"] == "guess_number" and doc["rows"] == 8
    assert doc["sampled_tokens_per_s"] > 0 and doc["tokens_per_s"] >= doc["sampled_tokens_per_s"]
    assert doc["turns_mean"] > 1.0  # the game answers and rows come back
    assert 0.0 < doc["busy_fraction_while_waiting"] <= 1.0


def test_bench_grpo_rollouts_stop_at_the_runs_whole_eos_set():
    """rlbatch-bench grpo decodes with the run's end ids (the tokenizer's and
    model.extra_eos_token_ids), as a training run does: with the primary EOS alone its rows ran
    past an end-of-turn token, so its generation figures measured longer responses than the
    run it stands for."""
    from rlbatch.bench.grpo import bench_sampling
    from rlbatch.cli.common import compose
    from rlbatch.engine.tokenizer import build_tokenizer

    cfg = compose(["+recipe=grpo_qwen", "model.extra_eos_token_ids=[10,32]"], "t")
    params = bench_sampling(cfg, build_tokenizer(cfg.model))
    assert params.eos_ids == (258, 10, 32)
    assert all(params.ends(t) for t in (258, 10, 32)) and not params.ends(11)
