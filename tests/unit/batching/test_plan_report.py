"""rlbatch-plan's body (run_plan_command) on a RunConfig built from the schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbatch.cli.plan_report import run_plan_command
from rlbatch.config.schema import BatchingMode, PassKind, RunConfig, Workload


def make_config(**plan) -> RunConfig:  # type: ignore[no-untyped-def]
    cfg = RunConfig()
    cfg.parallel.dp = 4
    cfg.parallel.pp = 2
    cfg.parallel.vpp = 2
    cfg.batching.train.max_tokens = 16384
    cfg.batching.infer.max_tokens = 32768
    for key, value in plan.items():
        setattr(cfg.plan, key, value)
    return cfg


def run_json(cfg: RunConfig, capsys: pytest.CaptureFixture[str]) -> dict:
    cfg.plan.json = True
    assert run_plan_command(cfg) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one document: json.loads rejects trailing text


def test_json_from_a_lengths_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = [7, 6, 8, 5, 1, 3, 8, 6] * 40
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(lengths))
    cfg = make_config(lengths=str(path))
    cfg.batching.train.mode = BatchingMode.packed
    doc = run_json(cfg, capsys)
    assert set(doc) == {
        "mode",
        "dp",
        "num_micro_batches",
        "microbatch_group_size",
        "ranks",
        "stats",
        "cost_model",
    }
    assert doc["mode"] == "packed" and doc["dp"] == 4 and doc["microbatch_group_size"] == 2
    for key in ("lower_bound", "padding_efficiency", "token_imbalance", "cost_imbalance",
                "lockstep_efficiency", "max_computed_tokens", "planner_seconds", "oversize",
                "fillers"):  # fmt: skip
        assert key in doc["stats"]
    seen = sorted(s for r in doc["ranks"] for mb in r["micro_batches"] for s in mb["samples"])
    assert seen == list(range(len(lengths)))
    for r in doc["ranks"]:
        assert len(r["micro_batches"]) == doc["num_micro_batches"]
        for mb in r["micro_batches"]:
            assert set(mb) == {"samples", "padded_len", "computed_tokens", "real_tokens", "filler"}
            assert mb["computed_tokens"] <= 16384


def test_infer_pass_uses_the_infer_budget(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_config(synthetic=Workload.long_cot, num_samples=512, pass_=PassKind.infer)
    doc = run_json(cfg, capsys)
    assert doc["stats"]["max_computed_tokens"] > 16384  # only the infer budget allows it
    assert doc["stats"]["max_computed_tokens"] <= 32768


def test_pool_json_is_one_pass_like_training(capsys: pytest.CaptureFixture[str]) -> None:
    """Pool mode previews one pass, as training plans its first step: plan_pass with
    trainer.seed and step 1; pool_micro_batches_per_step raises the count (3 -> VPP-valid 4)."""
    from rlbatch.batching import GROUP_SIZE, cost_model_for, make_workload, plan_pass

    cfg = make_config(synthetic=Workload.grpo_math, num_samples=96)
    cfg.batching.train.mode = BatchingMode.pool
    cfg.batching.train.pool_micro_batches_per_step = 3
    doc = run_json(cfg, capsys)
    assert doc["mode"] == "pool" and doc["num_micro_batches"] == 4
    train = plan_pass(
        make_workload(Workload.grpo_math, 96, 0), cfg.batching.train, dp=4, pp=2, vpp=2,
        group_size=GROUP_SIZE[Workload.grpo_math], cost=cost_model_for(cfg.model, cfg.batching.train),
        seed=cfg.trainer.seed, step=1,
    ).to_json()  # fmt: skip
    doc["stats"].pop("planner_seconds"), train["stats"].pop("planner_seconds")
    assert doc.pop("cost_model")["b"] == cost_model_for(cfg.model, cfg.batching.train).b
    assert doc == train


@pytest.mark.parametrize("mode", ["dynamic", "pool"])
def test_rich_summary(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_config(synthetic=Workload.bimodal, num_samples=256)
    cfg.batching.train.mode = BatchingMode(mode)
    assert run_plan_command(cfg) == 0
    out = capsys.readouterr().out
    assert "lower bound" in out and "lockstep" in out and "rank" in out


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "no such file"),
        ('[1, 2, "x"]', "item 2"),
        ("[1, 2.5]", "item 1"),
        ('{"a": 1}', "list of ints"),
        ("not json", "not JSON"),
    ],
)
def test_bad_lengths_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, match: str
) -> None:
    path = tmp_path / "lengths.json"
    if content is not None:
        path.write_text(content)
    cfg = make_config(lengths=str(path), json=True)
    assert run_plan_command(cfg) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and match in captured.err


def test_no_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan_command(make_config()) == 2
    assert "plan.lengths" in capsys.readouterr().err


def test_oversize_error_is_a_clean_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([100, 20000]))
    assert run_plan_command(make_config(lengths=str(path))) == 2
    assert "batching.train.max_tokens" in capsys.readouterr().err


def test_cli_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, rlbatch.cli.plan_report; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
