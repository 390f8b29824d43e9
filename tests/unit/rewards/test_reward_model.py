"""data.reward=reward_model: a tiny Qwen2ForSequenceClassification saved by transformers scores
micro-batches planned under batching.infer exactly like transformers scoring each text alone in
float64, whatever the infer mode (padded or packed) and token budget; a text scored on its
last tokens says so (reason truncated); the model reads its own chat template on request and
runs in bfloat16; the checkpoint check names what is wrong."""

from __future__ import annotations

import json

import pytest

from reward_servers import save_tiny_reward_model
from rlbatch.config.rewards import RewardModelConfig, RewardModelDtype, RewardModelTemplate
from rlbatch.config.schema import BatchingMode, BatchingPassConfig, OversizePolicy
from rlbatch.rewards.reward_model import (
    RewardModel,
    check_reward_model,
    resolve_dtype,
    template_problem,
)

TEXTS = [
    "Q: 2+2?\nA: 4",
    "short",
    "a much longer completion that needs more tokens " * 3,
    "x",
    "Q: name a prime\nA: 7",
    "the same length?",
    "the same length!",
]


def _want(model, path, texts):
    """transformers' own forward of each text alone, in float64."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = model.double()
    out = []
    for text in texts:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def test_batched_scores_match_transformers_one_text_at_a_time(tmp_path):
    path = tmp_path / "rm"
    want = _want(save_tiny_reward_model(path), path, TEXTS)
    infer = BatchingPassConfig(max_tokens=200)  # the infer slot's dynamic mode
    out = RewardModel(str(path), RewardModelConfig(), infer).score(TEXTS)
    assert [s.value for s in out] == pytest.approx(want, abs=1e-5)
    assert len({round(s.value, 6) for s in out}) == len(TEXTS)  # not a constant


@pytest.mark.parametrize(
    "infer",
    [
        BatchingPassConfig(mode=BatchingMode.dynamic, max_tokens=152),  # the longest alone
        BatchingPassConfig(mode=BatchingMode.dynamic, max_tokens=1024),  # all in one row set
        BatchingPassConfig(mode=BatchingMode.fixed, micro_batch_size=3, max_tokens=1024),
        BatchingPassConfig(mode=BatchingMode.packed, max_tokens=200),  # several packed rows
        BatchingPassConfig(mode=BatchingMode.packed, max_tokens=1024),  # one packed row
        BatchingPassConfig(mode=BatchingMode.pool, pool_packing=True, max_tokens=256),
    ],
    ids=["dynamic-152", "dynamic-1024", "fixed-3", "packed-200", "packed-1024", "pool-packed"],
)
def test_scores_do_not_depend_on_the_infer_plan(tmp_path, infer):
    from rlbatch.batching import plan_pass

    path = tmp_path / "rm"
    want = _want(save_tiny_reward_model(path), path, TEXTS)
    model = RewardModel(str(path), RewardModelConfig(), infer)
    lengths = [len(model.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in TEXTS]
    plan = plan_pass(lengths, infer, dp=1, pass_name="infer")
    shared = [mb for mb in plan.for_rank(0).micro_batches if len(mb.samples) > 1]
    assert shared  # samples really share forwards (rows of one batch, or one packed row)
    assert all(
        mb.packed == (infer.mode == BatchingMode.packed or infer.pool_packing) for mb in shared
    )
    out = model.score(TEXTS)
    assert [s.value for s in out] == pytest.approx(want, abs=1e-5)


def test_a_text_over_the_infer_budget_names_both_keys(tmp_path):
    path = tmp_path / "rm"
    save_tiny_reward_model(path)
    model = RewardModel(str(path), RewardModelConfig(), BatchingPassConfig(max_tokens=16))
    with pytest.raises(ValueError) as err:
        model.score(["a text longer than sixteen characters"])
    assert "batching.infer.max_tokens" in str(err.value)
    assert "data.reward_model_batching.max_length" in str(err.value)


def test_truncate_policy_keeps_the_last_tokens(tmp_path):
    path = tmp_path / "rm"
    text = "eighteen_characters"  # one token per character, 19 > 16
    want = _want(save_tiny_reward_model(path), path, [text[-16:]])
    infer = BatchingPassConfig(max_tokens=16, oversize=OversizePolicy.truncate)
    out = RewardModel(str(path), RewardModelConfig(), infer).score([text, text[-16:]])
    assert out[0].value == pytest.approx(want[0], abs=1e-5)
    assert [f.reason for f in out[0].failures] == ["truncated"]
    assert "19 tokens, scored on the last 16" in out[0].failures[0].detail
    assert out[1].failures == ()  # exactly at the budget: read whole


def test_a_text_over_max_length_is_scored_on_its_last_tokens_and_says_so(tmp_path):
    path = tmp_path / "rm"
    texts = ["0123456789abcdef", "0123456789", "0123456789a"]
    want = _want(save_tiny_reward_model(path), path, ["6789abcdef", "0123456789", "123456789a"])
    out = RewardModel(str(path), RewardModelConfig(max_length=10), BatchingPassConfig()).score(
        texts
    )
    assert [s.value for s in out] == pytest.approx(want, abs=1e-5)
    assert [[f.reason for f in s.failures] for s in out] == [["truncated"], [], ["truncated"]]
    assert "16 tokens, scored on the last 10 (data.reward_model_batching.max_length=10" in (
        out[0].failures[0].detail
    )


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


def test_the_model_template_renders_turns_in_the_reward_models_own_chat_template(tmp_path):
    path = tmp_path / "rm"
    save_tiny_reward_model(path, chat_template=TEMPLATE)
    cfg, infer = RewardModelConfig(), BatchingPassConfig()
    own = RewardModel(str(path), cfg, infer, template=RewardModelTemplate.model)
    policy = RewardModel(str(path), cfg, infer, template=RewardModelTemplate.policy)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert own.text("2+2?", "Q: 2+2? A:", "4") == "<user>2+2?\n<assistant>4\n"
    assert own.text(chat, "ignored", "4") == "<system>be brief\n<user>2+2?\n<assistant>4\n"
    assert policy.text("2+2?", "Q: 2+2? A:", " 4") == "Q: 2+2? A: 4"
    assert template_problem(str(path)) == ""
    bare = tmp_path / "bare"
    save_tiny_reward_model(bare)
    assert "no chat template" in template_problem(str(bare))
    assert "data.reward_model_template=policy" in template_problem(str(bare))


def test_bfloat16_scores_are_close_to_float32_and_auto_is_float32_on_the_cpu(tmp_path):
    import torch

    path = tmp_path / "rm"
    want = _want(save_tiny_reward_model(path), path, TEXTS)
    for mode in (BatchingMode.dynamic, BatchingMode.packed):
        infer = BatchingPassConfig(mode=mode, max_tokens=1024)
        model = RewardModel(str(path), RewardModelConfig(), infer, RewardModelDtype.bfloat16)
        assert next(model.model.parameters()).dtype == torch.bfloat16
        got = [s.value for s in model.score(TEXTS)]
        assert got == pytest.approx(want, abs=0.05)
    assert resolve_dtype(RewardModelDtype.auto, cuda=False) == "float32"
    assert resolve_dtype(RewardModelDtype.auto, cuda=True) == "bfloat16"
    assert resolve_dtype(RewardModelDtype.float32, cuda=True) == "float32"
    auto = RewardModel(str(path), RewardModelConfig(), BatchingPassConfig())
    assert next(auto.model.parameters()).dtype == torch.float32


def test_checkpoint_check(tmp_path):
    assert "not a directory" in check_reward_model(str(tmp_path / "nope"))
    path = tmp_path / "rm"
    save_tiny_reward_model(path)
    assert check_reward_model(str(path)) == ""
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    assert "ForSequenceClassification" in check_reward_model(str(path))


def test_max_length_over_the_infer_budget_is_refused_before_launch_unless_a_policy_takes_it():
    from rlbatch.rewards.reward_model import budget_errors

    assert (
        budget_errors(RewardModelConfig(max_length=2048), BatchingPassConfig(max_tokens=2048)) == []
    )
    # 1001 tokens round (by 8) to 1008 > 1000: a text that long could not be planned
    (err,) = budget_errors(RewardModelConfig(max_length=1001), BatchingPassConfig(max_tokens=1004))
    assert (err.key, err.value) == ("data.reward_model_batching.max_length", 1001)
    assert "batching.infer.max_tokens=1004" in err.message and "lower it to 1000" in err.message
    for policy in (OversizePolicy.isolate, OversizePolicy.truncate):
        infer = BatchingPassConfig(max_tokens=512, oversize=policy)
        assert budget_errors(RewardModelConfig(max_length=2048), infer) == []
    (err,) = budget_errors(RewardModelConfig(max_length=0), BatchingPassConfig())
    assert err.message == "must be >= 1"
