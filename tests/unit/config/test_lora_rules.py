"""model.lora checks before launch: every error at once, each with key, value and fix."""

from __future__ import annotations

from rlbatch.config.schema import RunConfig
from rlbatch.config.validate import validate


def _errors(**fields):
    cfg = RunConfig()
    for k, v in fields.items():
        setattr(cfg.model.lora, k, v)
    return {e.key: str(e) for e in validate(cfg) if e.key.startswith("model.lora")}


def test_defaults_and_a_usual_setting_are_valid():
    assert _errors() == {}
    assert _errors(rank=16, alpha=32.0, target_modules=["q_proj", "v_proj"]) == {}
    assert _errors(rank=0, dropout=0.05) == {}  # no adapters: nothing drops out


def test_dropout_is_refused_with_adapters():
    """Dropout on in the training forward and off in the log-prob passes makes the first
    on-policy ratio differ from 1: refused, with the fix."""
    errors = _errors(rank=16, dropout=0.05)
    assert set(errors) == {"model.lora.dropout"}
    message = errors["model.lora.dropout"]
    assert message.startswith("model.lora.dropout=0.05: ")
    assert "ratio is not 1" in message and "set model.lora.dropout=0" in message


def test_every_bad_value_is_reported_with_its_fix():
    errors = _errors(rank=-2, alpha=0.0, dropout=1.0, target_modules=["qkv", "all-linear"])
    assert set(errors) == {
        "model.lora.rank", "model.lora.alpha", "model.lora.dropout", "model.lora.target_modules",
    }  # fmt: skip
    assert "model.lora.rank=-2: must be >= 0" in errors["model.lora.rank"]
    assert "null (= model.lora.rank" in errors["model.lora.alpha"]
    assert "in [0, 1)" in errors["model.lora.dropout"]
    assert "['qkv']" in errors["model.lora.target_modules"]
    assert "q_proj" in errors["model.lora.target_modules"]


def test_adapters_need_a_target():
    errors = _errors(rank=8, target_modules=[])
    assert "name the projections to adapt" in errors["model.lora.target_modules"]
