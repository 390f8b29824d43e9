"""The eval group: null keys take the training values, every bad setting is refused with its
dotted key and fix (all at once), and the driver's checks read the held-out file row by row."""

from __future__ import annotations

import pytest

from rlbatch.cli.common import compose
from rlbatch.config.errors import ConfigErrors
from rlbatch.config.schema import BuiltinTask, DataSource, RewardKind, RunConfig
from rlbatch.config.validate import check
from rlbatch.eval.settings import (
    eval_data,
    eval_data_seed,
    eval_due,
    eval_metric_names,
    eval_pass_k,
    eval_rollout,
)
from rlbatch.grpo.preflight import check_before_launch


def _cfg(*overrides):
    return compose(["+recipe=grpo_qwen", *overrides], "test")


def test_null_keys_take_the_training_values():
    cfg = _cfg("eval.every_steps=10", "eval.data.task=target_length", "eval.top_p=0.9")
    data = eval_data(cfg)
    assert data.task == BuiltinTask.target_length and data.source == DataSource.builtin
    assert data.max_prompt_len == cfg.data.max_prompt_len and data.reward == RewardKind.task
    roll = eval_rollout(cfg)
    assert (roll.temperature, roll.top_p, roll.max_new_tokens) == (1.0, 0.9, 16)
    assert eval_pass_k(cfg) == [1, 8]  # the recipe's num_samples=8
    assert eval_data_seed(cfg.trainer.seed) != cfg.trainer.seed
    cfg.trainer.max_steps = 25
    assert [s for s in range(30) if eval_due(cfg, s)] == [0, 10, 20, 25]
    cfg.eval.at_start = False
    assert not eval_due(cfg, 0)


def test_greedy_and_reward_choices():
    cfg = _cfg("eval.temperature=0", "eval.num_samples=1", "eval.reward=format")
    roll = eval_rollout(cfg)
    assert (roll.temperature, roll.top_k) == (1.0, 1)
    assert eval_data(cfg).reward == RewardKind.format
    assert eval_metric_names(cfg) == [
        "eval/reward_mean",
        "eval/pass@1",
        "eval/mean@1",
        "eval/response_len_mean",
        "eval/num_prompts",
    ]  # fmt: skip  (format grades no answer: no maj@N)
    cfg = _cfg("eval.reward_fn=[math]", "data.reward_fn=[format]")
    assert eval_data(cfg).reward_fn == ["math"] and "eval/maj@8" in eval_metric_names(cfg)


def test_every_bad_setting_at_once(tmp_path):
    overrides = [
        "eval.every_steps=5", "eval.pass_k=[1,9]", "eval.temperature=0", "eval.top_p=1.5",
        "eval.max_new_tokens=600", "eval.data.source=jsonl", "eval.max_prompts=0",
        "trainer.checkpoint.keep_best=eval/pass@3",
    ]  # fmt: skip
    cfg = RunConfig()
    from omegaconf import OmegaConf

    from rlbatch.config.load import check_structure

    composed = OmegaConf.to_container(
        OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(overrides))
    )
    cfg, structural = check_structure(composed)
    with pytest.raises(ConfigErrors) as err:
        check(cfg, structural)
    text = " ".join(str(err.value).split())
    for needle in (
        "eval.pass_k=[1, 9]: each k must be in 1..eval.num_samples=4",
        "eval.num_samples=4: eval.temperature=0 (greedy)",
        "eval.top_p=1.5: must be in (0, 1]",
        "eval.max_new_tokens=600: the longest evaluation sequence",
        "eval.data.path=null: eval.every_steps=5 on a jsonl dataset needs a held-out file",
        "eval.max_prompts=0: must be positive",
        "trainer.checkpoint.keep_best=eval/pass@3: is not a metric of the evaluation",
    ):
        assert needle in text, needle


def test_keep_best_needs_evaluation():
    cfg = _cfg("eval.every_steps=0")
    cfg.trainer.checkpoint.keep_best = "eval/pass@1"
    with pytest.raises(ConfigErrors, match="needs evaluation during training"):
        check(cfg)


def test_driver_lists_every_bad_row_of_the_held_out_file(tmp_path):
    bad = tmp_path / "held_out.jsonl"
    bad.write_text('{"prompt": "2+3?", "answer": 5}\nnot json\n{"question": "x"}\n')
    cfg = _cfg(
        "eval.every_steps=5", "eval.data.source=jsonl", f"eval.data.path={bad}",
        "eval.reward=math", "eval.reward_fn=[nowhere.py:score]",
    )  # fmt: skip
    errors, _ = check_before_launch(cfg)
    text = " ".join(" ".join(str(e).split()) for e in errors)
    assert "eval.data.path=" in text and "2 bad row(s)" in text
    assert "line 2: not valid JSON" in text and "line 3: no field 'prompt'" in text
    assert "eval.reward_fn[0]=" in text


def test_evaluation_without_a_held_out_file_does_not_blame_the_training_rows(tmp_path):
    """Evaluation on a file dataset with no eval.data.path is refused for that alone (the
    validation rule above): the launch checks do not also report the training file's rows
    (here without answers, which pure distillation trains on) as bad rows of eval.data.path."""
    from rlbatch.grpo.preflight import check_eval_inputs

    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "2+3?"}\n{"prompt": "4+4?"}\n')
    cfg = _cfg("data.source=jsonl", f"data.path={train}", "data.reward=none")
    cfg.eval.every_steps = 1
    errors: list = []
    check_eval_inputs(cfg, errors)
    assert errors == []
