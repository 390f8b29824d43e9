"""Served rewards against real servers on 127.0.0.1: the HTTP scorer (one sample or batches
per request), a server that fails twice then answers, one that hangs, one that answers
garbage; the judge's score rule and its requests to an OpenAI-compatible server."""

from __future__ import annotations

import time

import pytest

from reward_servers import Judge, Scorer, judge_rule, scorer_rule
from rlbatch.config.enums import EnvOnError
from rlbatch.config.rewards import JudgeConfig, ServedConfig
from rlbatch.rewards.judge import JudgeReward, chat_url, parse_score, render
from rlbatch.rewards.served import HttpReward, ServedError, sample_payload

TEXTS = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", ""]


def _payloads() -> list[dict]:
    return [sample_payload("p", t, "ans", {"level": i}) for i, t in enumerate(TEXTS)]


LABELS = [f"sample {i}" for i in range(len(TEXTS))]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_scorer_rewards_in_sample_order_with_row_fields(batch_size):
    with Scorer() as server:
        cfg = ServedConfig(batch_size=batch_size, max_concurrency=3)
        out = HttpReward(server.url, cfg).score(_payloads(), LABELS)
        assert [s.value for s in out] == [scorer_rule(t) for t in TEXTS]
        assert sorted(p["level"] for p in server.payloads) == list(range(len(TEXTS)))
        assert server.requests == -(-len(TEXTS) // batch_size)


def test_failing_twice_then_answering_is_retried_with_backoff():
    with Scorer(fail_first=2) as server:
        cfg = ServedConfig(retries=3, backoff_s=0.05, max_concurrency=1)
        started = time.monotonic()
        out = HttpReward(server.url, cfg).score(_payloads()[:1], LABELS[:1])
        assert out[0].value == scorer_rule(TEXTS[0]) and out[0].failures == ()
        assert server.failures_sent == 2 and server.requests == 3
        assert time.monotonic() - started >= 0.05 + 0.1  # waited 0.05 then 0.1


def test_failure_after_retries_stops_naming_the_url_and_sample_or_scores_zero():
    with Scorer(fail_first=10) as server:
        cfg = ServedConfig(retries=1, backoff_s=0.01)
        with pytest.raises(ServedError, match=rf"sample 0 failed: {server.url} failed 2 time"):
            HttpReward(server.url, cfg).score(_payloads()[:1], LABELS[:1])
        cfg.on_error = EnvOnError.zero_reward
        out = HttpReward(server.url, cfg).score(_payloads()[:2], LABELS[:2])
        assert [s.value for s in out] == [0.0, 0.0]
        assert [f.reason for s in out for f in s.failures] == ["served_error"] * 2
        assert "HTTP 500" in out[0].failures[0].detail


def test_hanging_server_times_out_per_request():
    with Scorer(hang_s=3.0) as server:
        cfg = ServedConfig(
            timeout_s=0.3, retries=1, backoff_s=0.01, on_error=EnvOnError.zero_reward
        )
        started = time.monotonic()
        out = HttpReward(server.url, cfg).score(_payloads()[:1], LABELS[:1])
        assert time.monotonic() - started < 2.5
        assert out[0].value == 0.0 and "timed out" in out[0].failures[0].detail


def test_garbage_is_not_retried_and_is_named():
    with Scorer(garbage=True) as server:
        cfg = ServedConfig(retries=3)
        with pytest.raises(ServedError, match="not JSON: b'<html>surprise</html>'"):
            HttpReward(server.url, cfg).score(_payloads()[:1], LABELS[:1])
        assert server.requests == 1
        assert "not JSON" in HttpReward(server.url, cfg).check(_payloads()[0])


def test_unreachable_endpoint_check_says_what_happened():
    cfg = ServedConfig(timeout_s=1, retries=0)
    why = HttpReward("http://127.0.0.1:9/score", cfg).check(_payloads()[0])
    assert "http://127.0.0.1:9/score failed 1 time(s)" in why and "refused" in why


@pytest.mark.parametrize(
    ("reply", "score"),
    [("7", 0.7), ("Score: 8/10", 0.8), ("I'd say 3.5 out of 10... final: 9", 0.9),
     ("12", 1.0), ("-2", 0.0), ("no idea", None), ("10/10", 1.0)],
)  # fmt: skip
def test_judge_score_rule(reply, score):
    got = parse_score(reply, 10.0)
    assert got == (None if score is None else pytest.approx(score))


def test_judge_url_and_template():
    assert chat_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"
    assert render("{prompt}|{completion}|{answer}|{other}", "p", "c", "a") == "p|c|a|{other}"


def test_judge_asks_an_openai_compatible_server():
    with Judge() as server:
        judge = JudgeReward(
            server.url, JudgeConfig(template="Q={prompt} A={completion}"), ServedConfig()
        )
        assert judge.check() == ""
        messages = [judge.message("q", t, "a") for t in TEXTS]
        out = judge.score(messages, LABELS)
        assert [s.value for s in out] == [pytest.approx(judge_rule(m) / 10) for m in messages]
        assert server.messages[-1].startswith("Q=q A=")
