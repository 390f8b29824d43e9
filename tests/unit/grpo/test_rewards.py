"""Reward functions and their registry."""

from fractions import Fraction

import pytest

from rlbatch.config.schema import BuiltinTask, DataConfig, DataSource, RewardKind
from rlbatch.grpo.rewards import (
    RewardInput,
    build_reward_fn,
    extract_math_answer,
    score,
)


def x(response, answer="", n=None):
    return RewardInput(prompt="p", response=response, answer=answer, num_response_tokens=n or 0)


def test_exact_match():
    fn = build_reward_fn(DataConfig(source=DataSource.jsonl, reward=RewardKind.exact_match))
    assert fn(x(" Paris\n", "Paris")) == 1.0
    assert fn(x("paris", "Paris")) == 0.0


@pytest.mark.parametrize(
    "text,value",
    [
        ("so the answer is 42.", Fraction(42)),
        ("first 3 then -7", Fraction(-7)),
        ("total 1,234.5 dollars", Fraction("1234.5")),
        ("ratio 3/4", Fraction(3, 4)),
        ("\\boxed{\\frac{1}{2}} and later 9", Fraction(1, 2)),
        ("\\boxed{x = {12}} ok", Fraction(12)),
        ("\\boxed{1} then \\boxed{2}", Fraction(2)),
        ("no number here", None),
    ],
)
def test_extract_math_answer(text, value):
    assert extract_math_answer(text) == value


def test_math_reward_compares_numerically():
    fn = build_reward_fn(DataConfig(source=DataSource.jsonl, reward=RewardKind.math))
    assert fn(x("The result is \\boxed{0.50}", "1/2")) == 1.0
    assert fn(x("It is 3.", "\\boxed{3}")) == 1.0
    assert fn(x("It is 4.", "3")) == 0.0
    assert fn(x("no idea", "3")) == 0.0


def test_format_reward():
    fn = build_reward_fn(DataConfig(source=DataSource.jsonl, reward=RewardKind.format))
    assert fn(x("<think>hmm</think>\n<answer>4</answer>")) == 1.0
    assert fn(x("<think>hmm</think> 4")) == pytest.approx(0.4)
    assert fn(x("4")) == 0.0
    assert fn(x("<answer>4</answer><think>x</think>")) == pytest.approx(0.8)


def test_task_reward_is_the_builtin_tasks():
    fn = build_reward_fn(DataConfig(task=BuiltinTask.digit_copy, reward=RewardKind.task))
    assert fn(x("4821", "4821", 4)) == pytest.approx(1.0)
    fn = build_reward_fn(DataConfig(task=BuiltinTask.target_length, reward=RewardKind.task))
    assert fn(x("abc", "3", 3)) == 1.0


def test_task_reward_needs_builtin_source():
    with pytest.raises(ValueError, match="data.reward=task needs data.source=builtin"):
        build_reward_fn(DataConfig(source=DataSource.jsonl, reward=RewardKind.task))


def test_every_kind_is_registered():
    """A per-sample built-in, or a brought kind (batch scorer) with its check before launch."""
    from rlbatch.rewards.kinds import BROUGHT, CHECKS

    for kind in RewardKind:
        if kind in BROUGHT:
            assert kind in CHECKS
            with pytest.raises(ValueError, match="scores batches"):
                build_reward_fn(DataConfig(reward=kind))
        else:
            assert callable(build_reward_fn(DataConfig(reward=kind)))


def test_score_rejects_non_finite():
    with pytest.raises(ValueError, match="sample 1"):
        score(lambda r: float("nan") if r.response == "b" else 0.0, [x("a"), x("b")])


class Bytes:
    eos_id = 258
    eos_ids = (258,)

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_sample_reward_fn_strips_eos_and_counts_tokens():
    from rlbatch.grpo.rewards import sample_reward_fn
    from rlbatch.grpo.types import Prompt, Sample

    p = Prompt(index=0, prompt_ids=(257, 99), answer="4821", text="copy:4821=")
    done = Sample(p, 0, [*b"4821", 258], [0.0] * 5, truncated=False, policy_version=0)
    cut = Sample(p, 0, list(b"48219"), [0.0] * 5, truncated=True, policy_version=0)
    fn = sample_reward_fn(build_reward_fn(DataConfig(reward=RewardKind.task)), Bytes())
    assert fn([done, cut]) == pytest.approx([1.0, 0.6 + 0.2 + 0.2 * (1 - 1 / 24)])
    fn = sample_reward_fn(
        build_reward_fn(DataConfig(task=BuiltinTask.target_length, reward=RewardKind.task)), Bytes()
    )
    q = Prompt(index=1, prompt_ids=(257,), answer="4", text="say 4 chars:")
    four = Sample(q, 0, [*b"abcd", 258], [0.0] * 5, truncated=False, policy_version=0)
    five = Sample(q, 0, list(b"abcde"), [0.0] * 5, truncated=True, policy_version=0)
    assert fn([four, five]) == pytest.approx([1.0, 1 - 1 / 24])


# Reference: hand-checked mathematics (each pair equal or not by definition).
MATH_VERIFY_TABLE = [
    (r"\frac{\sqrt{3}}{2}", r"The answer is $\boxed{\frac{\sqrt3}{2}}$", 1.0),
    (r"\frac{\sqrt{3}}{2}", r"so $\boxed{\frac{1}{2}}$", 0.0),
    (r"\frac{1}{2}", r"$\boxed{0.5}$", 1.0),
    (r"(1, 2]", r"The set is $\boxed{(1,2]}$", 1.0),
    (r"(1, 2]", r"$\boxed{[1,2]}$", 0.0),
    (r"(3, -1)", r"$\boxed{(3,-1)}$", 1.0),
    (r"(3, -1)", r"$\boxed{(-1,3)}$", 0.0),
    (r"2\sqrt{2}", r"$\boxed{\sqrt{8}}$", 1.0),
    (r"x^2+2x+1", r"$\boxed{(x+1)^2}$", 1.0),
    (r"\{1, 2\}", r"$\boxed{\{2, 1\}}$", 1.0),
    ("72", r"48 + 24 = 72, so \boxed{72}", 1.0),
    ("72", "the answer is 71", 0.0),
]


@pytest.mark.parametrize("answer,response,want", MATH_VERIFY_TABLE)
@pytest.mark.optional_extra
def test_math_verify_symbolic_equivalence(answer, response, want):
    pytest.importorskip("math_verify", reason="optional extra 'math' (math-verify) not installed")
    fn = build_reward_fn(DataConfig(source=DataSource.jsonl, reward=RewardKind.math_verify))
    assert fn(x(response, answer)) == want


def test_numeric_math_misses_what_math_verify_catches():
    """The dependency-free default compares numbers only: a root scores 0 even when right."""
    fn = build_reward_fn(DataConfig(source=DataSource.jsonl, reward=RewardKind.math))
    assert fn(x(r"$\boxed{\sqrt{8}}$", r"2\sqrt{2}")) == 0.0
    assert fn(x(r"$\boxed{0.5}$", "1/2")) == 1.0


@pytest.mark.optional_extra
def test_math_verify_works_off_the_main_thread():
    """The run-ahead producer may score in a generation thread (no SIGALRM there)."""
    import threading

    pytest.importorskip("math_verify", reason="optional extra 'math' (math-verify) not installed")
    fn = build_reward_fn(DataConfig(source=DataSource.jsonl, reward=RewardKind.math_verify))
    out = []
    thread = threading.Thread(target=lambda: out.append(fn(x(r"$\boxed{\sqrt{8}}$", r"2\sqrt{2}"))))
    thread.start()
    thread.join()
    assert out == [1.0]


def test_a_harness_episodes_data_reward_reads_only_what_the_policy_sampled():
    """An agent harness writes the messages between the sampled turns (a tool result may hold
    the answer): data.reward scores the sampled turns, one a line, so a math reward takes the
    policy's last number, not the harness's. A multi-turn environment's trajectory is read
    whole, as documented."""
    from rlbatch.config.schema import ModelConfig
    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.grpo.rewards import math_reward, reward_input
    from rlbatch.grpo.types import Prompt, Sample

    tok = build_tokenizer(ModelConfig())
    parts = [("call calc 17*23", 1), ("\ntool: 391\n", 0), ("so it is 390", 1)]
    ids = [t for text, _ in parts for t in tok.encode(text)]
    mask = [keep for text, keep in parts for _ in tok.encode(text)]
    prompt = Prompt(index=0, prompt_ids=(1, 2), answer="391", text="What is 17*23?")

    def sample(episode):
        return Sample(prompt, 0, ids, [0.0] * len(ids), False, 0, loss_mask=mask, episode=episode)

    harness = reward_input(sample({"calls": [0, 1]}), tok)
    assert harness.response == "call calc 17*23\nso it is 390"
    assert harness.num_response_tokens == sum(mask)
    assert math_reward(harness) == 0.0  # the tool's 391 is not the policy's answer
    trajectory = reward_input(sample({"turns": []}), tok)
    assert "tool: 391" in trajectory.response
