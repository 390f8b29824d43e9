"""The environment protocol's pieces without a model: loading by import path and the checks the
driver runs before launch, what step may return, the safe arithmetic of the calculator, and the
two built-in environments as ordinary users of the protocol."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rlbatch.env.arithmetic import ArithmeticError_, evaluate, format_number
from rlbatch.env.calculator import Calculator
from rlbatch.env.guess_number import GuessNumber
from rlbatch.env.loader import build_environment, check_environment
from rlbatch.env.protocol import EnvCallError, EnvSpecError, StepResult, as_step_result


def test_arithmetic_is_exact_and_refuses_anything_else():
    assert evaluate("1+2*3") == 7 and evaluate("(1+2)*3") == 9
    assert evaluate("-4/3") == Fraction(-4, 3) and evaluate("2*-3") == -6
    assert evaluate(" 1.5 + 2.25 ") == Fraction(15, 4)
    assert format_number(Fraction(7, 2)) == "3.5" and format_number(Fraction(12)) == "12"
    for bad in ("__import__('os').system('x')", "2**3", "1/0", "1+", "(1", "", "a", "1" * 200):
        with pytest.raises(ArithmeticError_):
            evaluate(bad)


def test_calculator_answers_calls_and_scores_the_final_answer():
    env = Calculator(call_reward=0.1)
    state = env.reset({"prompt": "7*5=", "answer": "35"})
    assert env.step(state, "let me <calc>7*5</calc>") == StepResult(
        "<result>35</result>", False, 0.1
    )
    assert env.step(state, "<calc>7/0</calc>") == StepResult(
        "<error>division by zero</error>", False, 0.0
    )
    final = env.step(state, "35")
    assert final.done and final.observation is None and final.reward == 1.0
    assert env.step(state, "53").reward < 1.0  # partial credit (the digit_copy score)
    assert state.calls == ["7*5", "7/0"]


def test_guess_number_gives_feedback_and_pays_the_best_guess_once():
    env = GuessNumber(low=0, high=9)
    state = env.reset({"answer": "6"})
    assert env.step(state, "no idea") == StepResult("say a number", False, 0.0)
    first = env.step(state, "I guess 3")
    assert first.observation == "higher" and first.reward == pytest.approx(0.5 * (1 - 3 / 9))
    assert env.step(state, "9").observation == "lower"
    assert env.step(state, "4").reward == pytest.approx(0.5 * (1 - 2 / 9) - 0.5 * (1 - 3 / 9))
    last = env.step(state, "6!")
    assert last.done and last.observation is None
    assert state.best == 1.0  # the rewards of the episode sum to 1 for a found secret
    assert first.reward + 0.5 * (1 - 2 / 9) - 0.5 * (1 - 3 / 9) + last.reward == pytest.approx(1.0)


def test_step_results_as_dict_object_or_class_and_wrong_types_are_named():
    class Obj:
        observation, done, reward = "x", False, 2

    assert as_step_result({"observation": None, "done": True}, "w") == StepResult(None, True, 0.0)
    assert as_step_result(Obj(), "w") == StepResult("x", False, 2.0)
    for bad, what in (
        (3, "returned int 3"),
        ({"done": True}, "without \\['observation'\\]"),
        ({"observation": 5, "done": False}, "observation is int, expected str or None"),
        ({"observation": "x", "done": "no"}, "done is str 'no', expected bool"),
        ({"observation": "x", "done": False, "reward": "1"}, "reward is str"),
        ({"observation": "x", "done": False, "reward": float("nan")}, "expected a finite"),
    ):
        with pytest.raises(EnvCallError, match=f"^where: .*{what}"):
            as_step_result(bad, "where")


def test_loading_checks_name_the_file_and_what_is_missing(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(
        "class Good:\n"
        "    def __init__(self, level=1): self.level = level\n"
        "    def reset(self, row): return row\n"
        "    async def step(self, state, text): return {'observation': None, 'done': True}\n"
        "class NoStep:\n"
        "    def reset(self, row): return row\n"
        "class BadStep:\n"
        "    def reset(self, row): return row\n"
        "    def step(self, state): return None\n"
    )
    check_environment(f"{path}:Good", {"level": 2})
    assert build_environment(f"{path}:Good", {"level": 2}).level == 2
    assert build_environment("rlbatch.env.guess_number:GuessNumber", {"high": 20}).high == 20
    cases = {
        f"{path}:NoStep": "has no method step\\(state, text\\)",
        f"{path}:BadStep": "step cannot be called as step\\(state, text\\)",
        f"{path}:Missing": f"{path} has no class 'Missing' \\(it defines: \\['BadStep', 'Good', 'NoStep'\\]\\)",
        f"{tmp_path / 'nope.py'}:Env": "no such file",
        "no_such_module_xyz:Env": "no module 'no_such_module_xyz'",
        "Env": "must be PATH.py:class or module.path:class",
    }
    for spec, message in cases.items():
        with pytest.raises(EnvSpecError, match=message):
            check_environment(spec, {})
    with pytest.raises(
        EnvSpecError, match="cannot be constructed with env.kwargs=\\{'levle': 2\\}"
    ):
        check_environment(f"{path}:Good", {"levle": 2})


QWEN25_TOOL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)  # Qwen2.5's rendering of one tool message after an assistant turn


def test_observations_render_by_chat_template(tmp_path):
    """none: the text; qwen: a Qwen2.5 tool turn; model: what the tokenizer's own template adds
    after the assistant turn's EOS (a Qwen2.5-style template gives exactly the qwen form)."""
    import json

    from hf_reference import save_chat_tokenizer
    from rlbatch.config.schema import ChatTemplate
    from rlbatch.engine.tokenizer import ByteTokenizer, HFTokenizer
    from rlbatch.env.render import QWEN_TOOL_TURN, observation_text

    assert observation_text(ChatTemplate.none, "higher", ByteTokenizer()) == "higher"
    qwen = observation_text(ChatTemplate.qwen, "higher", ByteTokenizer())
    assert qwen == (
        "\n<|im_start|>user\n<tool_response>\nhigher\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert observation_text(ChatTemplate.model, "higher", ByteTokenizer()) == qwen  # no template
    path = save_chat_tokenizer(tmp_path / "tok")
    config = {"eos_token": "<|im_end|>", "eos_token_id": 0, "chat_template": QWEN25_TOOL_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert observation_text(ChatTemplate.model, "higher", HFTokenizer(path)) == qwen
    config["eos_token"] = "<|endoftext|>"  # an EOS that does not close the turn: the close stays
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    rendered = observation_text(ChatTemplate.model, "higher", HFTokenizer(path))
    assert rendered == "<|im_end|>" + QWEN_TOOL_TURN.format(observation="higher")
    config["chat_template"] = "{{ messages[-1].content }}"  # does not extend the conversation
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="set data.chat_template=qwen or none"):
        observation_text(ChatTemplate.model, "higher", HFTokenizer(path))


def test_observation_wrapper_and_the_limit_that_cannot_hold_it():
    """The qwen tool turn around an observation's content, and env.max_observation_tokens below
    wrapper + 1 token refused (byte tokenizer: 34 + 50 bytes)."""
    from rlbatch.config.schema import ChatTemplate
    from rlbatch.engine.tokenizer import ByteTokenizer
    from rlbatch.env.render import wrapper_error, wrapper_text

    before, after = wrapper_text(ChatTemplate.qwen, ByteTokenizer())
    assert before == "\n<|im_start|>user\n<tool_response>\n"
    assert after == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert wrapper_text(ChatTemplate.none, ByteTokenizer()) == ("", "")
    error = wrapper_error(ChatTemplate.qwen, ByteTokenizer(), 84)
    assert error is not None and error.key == "env.max_observation_tokens"
    assert "(84 tokens" in error.message and "at least 85" in error.message
    assert wrapper_error(ChatTemplate.qwen, ByteTokenizer(), 85) is None
    assert wrapper_error(ChatTemplate.none, ByteTokenizer(), 1) is None
