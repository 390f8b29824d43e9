"""data.reward=reward_model: a tiny Qwen2ForSequenceClassification saved by transformers scores
batches (sorted by length, padded under the token budget) exactly like transformers scoring
each text alone in float64; the checkpoint check names what is wrong."""

from __future__ import annotations

import json

import pytest

from reward_servers import save_tiny_reward_model
from rlbatch.config.rewards import RewardModelConfig
from rlbatch.rewards.reward_model import RewardModel, check_reward_model, token_batches


def test_token_batches_stay_within_the_budget_longest_first():
    lengths = [5, 17, 3, 9, 9, 30, 1]
    batches = token_batches(lengths, 20)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 20
    assert batches[0] == [5]  # longer than the budget: alone


def test_batched_scores_match_transformers_one_text_at_a_time(tmp_path):
    import torch
    from transformers import AutoTokenizer

    path = tmp_path / "rm"
    model = save_tiny_reward_model(path)
    texts = ["Q: 2+2?\nA: 4", "short", "a much longer completion that needs more tokens " * 3, "x"]
    out = RewardModel(str(path), RewardModelConfig(batch_tokens=200)).score(texts)
    tok = AutoTokenizer.from_pretrained(path)
    model = model.double()
    for text, got in zip(texts, out, strict=True):
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            want = float(model(input_ids=ids).logits[0, 0])
        assert got.value == pytest.approx(want, abs=1e-5)
    assert len({round(s.value, 6) for s in out}) == len(texts)  # not a constant


def test_checkpoint_check(tmp_path):
    assert "not a directory" in check_reward_model(str(tmp_path / "nope"))
    path = tmp_path / "rm"
    save_tiny_reward_model(path)
    assert check_reward_model(str(path)) == ""
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    assert "ForSequenceClassification" in check_reward_model(str(path))
