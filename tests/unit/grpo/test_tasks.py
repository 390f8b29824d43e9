"""Built-in tasks: determinism, prompt shape, partial-credit rewards (hand-computed values)."""

import random

import pytest

from rlbatch.config.schema import BuiltinTask
from rlbatch.grpo.tasks import (
    digit_copy_reward,
    generate_examples,
    target_length_reward,
    task_reward,
)


@pytest.mark.parametrize("task", list(BuiltinTask))
def test_examples_are_a_pure_function_of_the_seed(task):
    a = generate_examples(task, 50, seed=7)
    assert a == generate_examples(task, 50, seed=7)
    assert a != generate_examples(task, 50, seed=8)
    assert len(a) == 50
    # short prompts: fit data.max_prompt_len=32 with a byte tokenizer and a BOS
    assert max(len(e.prompt.encode()) for e in a) + 1 <= 32


def test_digit_copy_shape():
    for e in generate_examples(BuiltinTask.digit_copy, 200, seed=0):
        assert e.prompt == f"copy:{e.answer}="
        assert e.answer.isdigit() and 2 <= len(e.answer) <= 4


def test_digit_copy_reward_hand_values():
    assert digit_copy_reward("4821", "4821") == pytest.approx(1.0)
    # 2 matches, 4 digits, right length: 0.6*2/4 + 0.2*4/4 + 0.2*1
    assert digit_copy_reward("4800", "4821") == pytest.approx(0.3 + 0.2 + 0.2)
    # empty response: only the length term, 1 - 4/24
    assert digit_copy_reward("", "4821") == pytest.approx(0.2 * 20 / 24)
    # exact answer followed by 12 junk characters: length 16, error 12 -> 0.5 length term
    assert digit_copy_reward("4821abcdefghijkl", "4821") == pytest.approx(0.6 + 0.2 + 0.2 * 0.5)
    # 24 letters (never stopped): only a small length term, 1 - 20/24
    assert digit_copy_reward("x" * 24, "4821") == pytest.approx(0.2 * 4 / 24)
    assert digit_copy_reward("x" * 30, "4821") == 0.0


def test_digit_copy_improves_smoothly():
    """Each step towards the answer adds reward: longer correct prefix, then stopping."""
    answer = "4821"
    steps = [
        "x" * 24,
        "9" * 24,
        "4" + "9" * 23,
        "48" + "9" * 22,
        "4821" + "9" * 20,
        "48219",
        "4821",
    ]
    rewards = [digit_copy_reward(r, answer) for r in steps]
    assert all(b > a for a, b in zip(rewards, rewards[1:], strict=False))


def test_random_byte_policy_earns_small_nonzero_reward():
    rng = random.Random(0)
    examples = generate_examples(BuiltinTask.digit_copy, 400, seed=1)
    total = 0.0
    for e in examples:
        # a random policy over 264 tokens rarely emits EOS: mostly 24 tokens long
        response = ""
        while len(response) < 24 and rng.randrange(264) != 257:
            response += chr(rng.randrange(256))
        total += digit_copy_reward(response, e.answer)
    mean = total / len(examples)
    assert 0.01 < mean < 0.2


def test_target_length_reward_hand_values():
    assert target_length_reward(7, "7") == 1.0
    assert target_length_reward(11, "7") == pytest.approx(1 - 4 / 24)
    assert target_length_reward(3, "7") == pytest.approx(1 - 4 / 24)
    assert target_length_reward(30, "4") == 0.0
    # a random policy that runs to max_new_tokens=24 still scores, more for longer targets
    assert target_length_reward(24, "12") == pytest.approx(1 - 12 / 24)
    assert target_length_reward(24, "2") == pytest.approx(1 - 22 / 24)
    assert task_reward(BuiltinTask.target_length, "whatever", "7", 7) == 1.0


def test_target_length_prompts():
    for e in generate_examples(BuiltinTask.target_length, 100, seed=3):
        assert e.prompt == f"say {e.answer} chars:"
        assert 2 <= int(e.answer) <= 12


def test_bad_num_prompts_names_the_key():
    with pytest.raises(ValueError, match="data.num_prompts=0"):
        generate_examples(BuiltinTask.digit_copy, 0, seed=0)
