"""rlbatch-eval's and rlbatch-export --best's input errors are configuration errors before any
worker starts; --best picks the checkpoint of the best keep_best value in metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlbatch.cli import eval as eval_cli
from rlbatch.cli.export import select_checkpoint
from rlbatch.config.load import dump_run_config
from rlbatch.config.schema import BestMode, RunConfig
from rlbatch.train import integrity


def _run_dir(tmp_path, steps, records, keep_best=None):
    cfg = RunConfig()
    cfg.run_dir = str(tmp_path)
    cfg.trainer.checkpoint.keep_best = keep_best
    cfg.trainer.checkpoint.keep_best_mode = BestMode.min
    dump_run_config(cfg, tmp_path / "resolved.yaml")
    for step in steps:
        ckpt = tmp_path / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"complete": True, "step": step}))
        names = integrity.checkpoint_files(ckpt)
        integrity.write_manifest(ckpt, integrity.file_entries(ckpt, names))  # an intact one
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return cfg


def _errors(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        eval_cli.main(argv)
    assert exc.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def test_best_checkpoint_by_metrics_jsonl(tmp_path):
    records = [{"step": s, "eval/m": v} for s, v in ((0, 0.0), (2, 0.3), (4, 0.1), (6, 0.1))]
    cfg = _run_dir(tmp_path, [2, 4, 6], records, keep_best="eval/m")
    errors: list = []
    assert select_checkpoint(cfg, None, True, errors).name == "step_00000004"  # min, earliest
    assert select_checkpoint(cfg, 2, True, errors) is None
    assert "excludes --step" in str(errors[0])


def test_rlbatch_eval_refuses_bad_input_before_launch(tmp_path, capsys):
    err = _errors(capsys, [str(tmp_path / "nowhere")])
    assert "RUN_DIR=" in err and "no resolved.yaml" in err
    _run_dir(tmp_path, [2], [{"step": 2, "eval/m": 1.0}])
    err = _errors(capsys, [str(tmp_path), "--best", "eval.pass_k=[9]", "eval.bogus=1"])
    assert "no trainer.checkpoint.keep_best" in err and "eval.pass_k=[9]" in err
    assert "eval.bogus=1: unknown key" in err
    err = _errors(capsys, [str(tmp_path), "--step", "3"])
    assert "--step=3" in err and "available: [2]" in err
    err = _errors(capsys, ["eval.num_samples=2"])
    assert "model.hf_path=null: nothing to evaluate" in err


def test_the_cli_imports_no_torch():
    code = "import sys, rlbatch.cli.eval; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rlbatch_eval_refuses_a_model_without_a_loadable_tokenizer(tmp_path, capsys):
    """A model directory whose tokenizer cannot load is refused before a worker starts, with
    the files found and the fix, never evaluated with the byte tokenizer."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    (model / "tokenizer.model").write_text("not a sentencepiece model")
    err = _errors(capsys, [f"model.hf_path={model}", "eval.num_samples=2"])
    assert f"model.hf_path={model}" in err and "tokenizer.model" in err
    assert "model.tokenizer=bytes" in err  # the deliberate choice, named as a fix


def test_rlbatch_eval_of_a_verifiers_run_needs_its_held_out_environment(tmp_path, capsys):
    """A run on a verifiers environment has no held-out rows of its own: rlbatch-eval names
    eval.verifiers (the environment whose taskset holds them); eval.verifiers on a run without
    env.agent.verifiers names the key it needs."""
    cfg = _run_dir(tmp_path, [2], [])
    cfg.env.agent.verifiers = "sums.py"
    dump_run_config(cfg, tmp_path / "resolved.yaml")
    err = _errors(capsys, [str(tmp_path)])
    assert "eval.verifiers=null: rlbatch-eval evaluates env.agent.verifiers=sums.py" in err
    assert "set eval.verifiers to an environment whose taskset holds them" in err
    err = _errors(capsys, [str(tmp_path), "env.agent.verifiers=null", "eval.verifiers=held.py"])
    assert "eval.verifiers=held.py: evaluates with the built-in verifiers harness" in err
