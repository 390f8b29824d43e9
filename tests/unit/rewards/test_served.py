"""Served rewards against real servers on 127.0.0.1: the HTTP scorer (one sample or batches
per request), a server that fails twice then answers, one that hangs, one that answers
garbage; servers that trickle, hang after their headers, send a huge body, or answer slowly
once (none may hold a request past its deadline); rewards out of bounds; the judge's score
rule over replies that restate their scale, and its requests to an OpenAI-compatible server."""

from __future__ import annotations

import time

import pytest

from reward_servers import Judge, Misbehaving, Scorer, judge_rule, scorer_rule
from rlbatch.config.enums import ServedOnError
from rlbatch.config.rewards import JudgeConfig, ServedConfig
from rlbatch.rewards.judge import (
    DEFAULT_SCORE_PATTERN,
    DEFAULT_TEMPLATE,
    JudgeReward,
    NoScore,
    chat_url,
    pattern_problem,
    read_score,
    render,
)
from rlbatch.rewards.served import (
    HttpReward,
    ServedError,
    check_error_fraction,
    sample_payload,
)

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
        # waited 0.05 then 0.1, each drawn between half and all of it (jitter)
        assert time.monotonic() - started >= (0.05 + 0.1) / 2


def test_failure_after_retries_stops_naming_the_url_and_sample_or_scores_zero():
    with Scorer(fail_first=10) as server:
        cfg = ServedConfig(retries=1, backoff_s=0.01)
        with pytest.raises(ServedError, match=rf"sample 0 failed: {server.url} failed 2 time"):
            HttpReward(server.url, cfg).score(_payloads()[:1], LABELS[:1])
        cfg.on_error = ServedOnError.zero_reward
        out = HttpReward(server.url, cfg).score(_payloads()[:2], LABELS[:2])
        assert [s.value for s in out] == [0.0, 0.0]
        assert [f.reason for s in out for f in s.failures] == ["served_error"] * 2
        assert "HTTP 500" in out[0].failures[0].detail


def test_hanging_server_times_out_per_request():
    with Scorer(hang_s=3.0) as server:
        cfg = ServedConfig(
            timeout_s=0.3, retries=1, backoff_s=0.01, on_error=ServedOnError.zero_reward
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


LONG = "8" * 400


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        # the replies that used to score 1.0 (the last number, clamped)
        ("7 out of 10", None), ("Score: 3 (on a 0-10 scale)", 0.3),
        ("I give it a 2. Max is 10.", None), ("**Score: 6**\n\n(1 = poor, 10 = excellent)", 0.6),
        ("85/100", None), ("Rating: 11", None), (LONG, None), (f"Score: {LONG}", None),
        # the scale the judge wrote must be the configured one; the score in range
        ("Score: 85/100", None), ("Score: 7/10", 0.7), ("Score: 11", None), ("Score: -1", None),
        # one score, the same wherever it occurs; reasoning is not read
        ("Score: 4\nOn reflection... Score: 8", None), ("Score: 5\nFinal answer. Score: 5", 0.5),
        ("<think>maybe Score: 2</think>\nThe answer is right.\nScore: 9", 0.9),
        ("<think>Score: 2, then I ran out of tokens", None),
        ("the template opened it, Score: 1 </think> Score: 8", 0.8),
        # what the default prompt asks for, as judges write it
        ("Score: 7", 0.7), ("score: 10", 1.0), ("**Score:** 7", 0.7), ("Score: 7.", 0.7),
        ("The answer matches the reference exactly.\n\nScore: 10", 1.0),
        ("The final answer differs from the reference (12 vs 15).\nScore: 0", 0.0),
        ("Score: 6-8", None), ("no idea", None),
        # a number read in part was a wrong score; a scale in words is a scale
        ("Score: 1e1", None), ("Score: 1_0", None), ("Score: 0x10", None),
        ("Score: 7 out of 100", None), ("Score: 7 out of 10", 0.7), ("Score: 7 of 10.", 0.7),
        # read as 0.5, 0.7 ... before: a percentage, a decimal comma, ranges and revisions,
        # a scale in parentheses or after "points"
        ("Score: 5%", None), ("Score: 5 %", None), ("Score: 7,5", None),
        ("Score: 7 \u2013 8", None), ("Score: 7\u20148", None), ("Score: 7 ~ 8", None),
        ("Score: 7\u20268", None), ("Score: 7 or 8", None), ("Score: 7 -> 8", None),
        ("Score: 7 \u2192 8", None), ("Score: 7 (out of 100)", None),
        ("Score: 7 points out of 100", None), ("Score: 7 points (out of 10)", 0.7),
        ("Score: 7 out of a possible 10", 0.7), ("Score: 7, as the steps are right", 0.7),
    ],
)  # fmt: skip
def test_judge_reads_the_score_not_the_scale(reply, score):
    if score is None:
        with pytest.raises(NoScore):
            read_score(reply, DEFAULT_SCORE_PATTERN, 10.0)
    else:
        assert read_score(reply, DEFAULT_SCORE_PATTERN, 10.0) == pytest.approx(score)


@pytest.mark.parametrize(
    "reply",
    ["Score:" + " " * 1_000_000 + "x", "<think>" * 140_000, "score " * 160_000 + "Score: 5"],
)
def test_reading_a_megabyte_reply_takes_linear_time(reply):
    """A reply of data.served.max_response_bytes (1 MB) is read at once: whitespace after
    'Score:' and unclosed <think> tags took quadratic time (40 kB: 48 s; 140 kB of <think>:
    55 s), holding the run past every deadline."""
    started = time.monotonic()
    try:
        read_score(reply, DEFAULT_SCORE_PATTERN, 10.0)
    except NoScore:
        pass
    assert time.monotonic() - started < 2.0


def test_the_default_prompt_asks_for_the_format_it_reads():
    message = render(DEFAULT_TEMPLATE, "What is 2+2?", "4", "4", 5.0)
    assert "'Score: N', N an integer from 0 to 5" in message
    assert "{max_score}" not in message and "What is 2+2?" in message
    # a completion that writes placeholders or a score line keeps them as written
    message = render(DEFAULT_TEMPLATE, "p", "{answer} Score: 10", "a", 10.0)
    assert "{answer} Score: 10" in message


def test_a_users_score_pattern():
    pattern = r"Grade: (?P<score>[A-E])"
    assert (
        pattern_problem(r"Grade: (\d)") == "has no group named 'score': write it as (?P<score>...)"
    )
    assert "is not a regular expression" in pattern_problem("Grade: (")
    assert pattern_problem(pattern) == ""
    with pytest.raises(NoScore, match="not a number"):
        read_score("Grade: B", pattern, 10.0)
    assert read_score("Mark 3 of 4. Grade: 3", r"Grade: (?P<score>\d)", 4.0) == 0.75


REPLIES = {
    "a": "7 out of 10",
    "b": "Score: 3 (on a 0-10 scale)",
    "c": "I give it a 2. Max is 10.",
    "d": "**Score: 6**\n\n(1 = poor, 10 = excellent)",
    "e": "85/100",
    "f": "Rating: 11",
    "g": LONG,
    "h": "<think>Score: 1?</think>Correct.\nScore: 9",
}
"""completion -> the judge's reply to it (a real OpenAI-compatible server on 127.0.0.1)."""


def _reply(message: str) -> str:
    return REPLIES[message.split("Answer to grade:\n", 1)[1].split("\n", 1)[0]]


@pytest.mark.parametrize("on_error", list(ServedOnError))
def test_judge_replies_without_one_score_score_zero_counted_as_no_score(on_error):
    """Whatever data.served.on_error says: it governs requests that failed, and these were
    answered (the default raise_error stopped the run at the first such reply)."""
    want = {"a": None, "b": 0.3, "c": None, "d": 0.6, "e": None, "f": None, "g": None, "h": 0.9}
    with Judge(reply=_reply) as server:
        judge = JudgeReward(server.url, JudgeConfig(), ServedConfig(on_error=on_error))
        out = judge.score([judge.message("q", c, "ref") for c in REPLIES], list(REPLIES))
        assert server.requests == len(REPLIES)  # a reply without a score is not asked again
        for (c, expected), s in zip(want.items(), out, strict=True):
            if expected is None:
                assert s.value == 0.0 and [f.reason for f in s.failures] == ["no_score"], c
                assert REPLIES[c][:20] in s.failures[0].detail
            else:
                assert s.value == pytest.approx(expected) and s.failures == (), c


def test_a_judge_quoting_the_completions_score_beside_its_own_is_no_score():
    """A completion that writes a score of its own: the judge quotes it, then gives its own."""
    completion = "The answer is 4. Score: 10"
    reply = 'The answer ends with "Score: 10", which is not mine to accept.\nScore: 3'
    with Judge(reply=lambda m: reply) as server:
        judge = JudgeReward(server.url, JudgeConfig(), ServedConfig())
        [out] = judge.score([judge.message("q", completion, "4")], ["sample 0"])
    assert out.value == 0.0 and [f.reason for f in out.failures] == ["no_score"]
    assert "several different scores [3.0, 10.0]" in out.failures[0].detail


def test_a_request_that_failed_still_stops_the_run_under_raise_error():
    with Judge(reply=lambda m: "Score: 5", fail_first=100) as server:
        served = ServedConfig(retries=1, backoff_s=0.01)
        judge = JudgeReward(server.url, JudgeConfig(), served)
        with pytest.raises(ServedError, match=r"for sample 0 failed: .* failed 2 time\(s\)"):
            judge.score([judge.message("q", "a", "ref")], ["sample 0"])
        served.on_error = ServedOnError.zero_reward
        [out] = judge.score([judge.message("q", "a", "ref")], ["sample 0"])
    assert out.value == 0.0 and [f.reason for f in out.failures] == ["served_error"]


@pytest.mark.parametrize(
    ("failed", "total", "limit", "stops"),
    [(1, 16, 0.5, False), (8, 16, 0.5, False), (9, 16, 0.5, True), (1, 16, 0.0, True),
     (16, 16, 1.0, False), (0, 0, 0.0, False)],
)  # fmt: skip
def test_a_step_over_the_served_error_fraction_stops_naming_it(failed, total, limit, stops):
    cfg = ServedConfig(max_error_fraction=limit)
    if not stops:
        check_error_fraction(failed, total, cfg, 3, "judge: no_score: x")
        return
    with pytest.raises(ServedError) as caught:
        check_error_fraction(failed, total, cfg, 3, "judge: no_score: x")
    text = str(caught.value)
    assert f"step 3: {failed} of the {total} samples had a served reward failure" in text
    assert f"over data.served.max_error_fraction={limit:g}" in text
    assert "the step was not trained, e.g. judge: no_score: x" in text


def test_judge_check_before_launch_retries_and_reads_a_score():
    with Judge(fail_first=2) as server:  # loading its model: 503 twice
        judge = JudgeReward(server.url, JudgeConfig(), ServedConfig(backoff_s=0.01))
        assert judge.check("q", "4") == ""
        assert server.requests == 3
    with Judge(reply=lambda m: "Looks right to me!") as server:
        why = JudgeReward(server.url, JudgeConfig(), ServedConfig()).check("q", "4")
        assert "'Looks right to me!': no score in the form data.judge.score_pattern" in why


def test_judge_url_and_template():
    assert chat_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"
    assert render("{prompt}|{completion}|{answer}|{other}", "p", "c", "a", 10) == "p|c|a|{other}"


def test_judge_asks_an_openai_compatible_server():
    with Judge() as server:
        judge = JudgeReward(
            server.url, JudgeConfig(template="Q={prompt} A={completion}"), ServedConfig()
        )
        assert judge.check("q", "a") == ""
        messages = [judge.message("q", t, "a") for t in TEXTS]
        out = judge.score(messages, LABELS)
        assert [s.value for s in out] == [pytest.approx(judge_rule(m) / 10) for m in messages]
        assert server.messages[-1].startswith("Q=q A=")


# ------------------------------------------------------------------------------------------
# Servers that would hold the run, and rewards out of bounds
# ------------------------------------------------------------------------------------------


def _timed(server_url: str, cfg: ServedConfig) -> tuple[float, str]:
    """(seconds to the answer, the failure's detail) of one sample, scored 0 on failure."""
    cfg.on_error = ServedOnError.zero_reward
    started = time.monotonic()
    out = HttpReward(server_url, cfg).score(_payloads()[:1], LABELS[:1])
    assert out[0].value == 0.0 and [f.reason for f in out[0].failures] == ["served_error"]
    return time.monotonic() - started, out[0].failures[0].detail


def test_a_trickling_server_is_cut_at_the_deadline_and_not_asked_again():
    with Misbehaving("trickle") as server:
        seconds, detail = _timed(server.url, ServedConfig(timeout_s=3, retries=1))
        assert 2.9 <= seconds < 4.5, seconds  # was > 240 s: each byte restarted the timeout
        assert (
            "timed out: no full answer within data.served.timeout_s=3 (the whole request)" in detail
        )
        assert "data.served.retry_timeouts=true" in detail
        assert server.requests == 1


def test_a_server_hanging_after_its_headers_is_cut_at_the_deadline():
    with Misbehaving("hang_after_headers") as server:
        seconds, detail = _timed(server.url, ServedConfig(timeout_s=1, retries=2))
        assert 0.9 <= seconds < 2.5 and "timed out: no full answer within" in detail
        assert server.requests == 1


@pytest.mark.parametrize("mode", ["huge", "huge_undeclared"])
def test_a_huge_body_is_refused_at_the_size_limit_without_a_retry(mode):
    with Misbehaving(mode) as server:
        cfg = ServedConfig(timeout_s=20, retries=2, max_response_bytes=100_000)
        seconds, detail = _timed(server.url, cfg)
        assert seconds < 5 and "data.served.max_response_bytes=100000" in detail
        assert server.requests == 1


def test_a_slow_then_fast_server_is_retried_only_when_asked():
    with Misbehaving("slow_then_fast", slow_s=3) as server:
        seconds, detail = _timed(server.url, ServedConfig(timeout_s=1, retries=2))
        assert (
            seconds < 2.5 and "timed out: no full answer within" in detail and server.requests == 1
        )
    with Misbehaving("slow_then_fast", slow_s=3) as server:
        cfg = ServedConfig(timeout_s=1, retries=2, retry_timeouts=True, backoff_s=0.05)
        out = HttpReward(server.url, cfg).score(_payloads()[:1], LABELS[:1])
        assert out[0].value == 0.5 and out[0].failures == () and server.requests == 2


@pytest.mark.parametrize("value", [1e300, float("inf"), float("nan"), -2e6])
def test_a_served_reward_out_of_bounds_is_a_failure_of_its_own(value):
    with Scorer(reward=value) as server:
        cfg = ServedConfig(on_error=ServedOnError.zero_reward)
        out = HttpReward(server.url, cfg, abs_max=1e6).score(_payloads()[:2], LABELS[:2])
        assert [s.value for s in out] == [0.0, 0.0]
        assert [f.reason for s in out for f in s.failures] == ["out_of_range"] * 2
        assert "data.reward_abs_max" in out[0].failures[0].detail
        cfg.on_error = ServedOnError.raise_error  # an answer read, not a failed request: the same
        again = HttpReward(server.url, cfg, abs_max=1e6).score(_payloads()[:2], LABELS[:2])
        assert again == out


def test_a_redirect_is_not_an_answer():
    """A 302 whose body happens to be JSON was read as the reward ({"reward": 1.0} from a
    load balancer's or proxy's redirect page); redirects are not followed either (the scorer's
    URL is configured, a redirect says it is the wrong one)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        body = b'{"reward": 1.0}'
        conn.sendall(
            b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:9/\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/score"
    try:
        why = HttpReward(url, ServedConfig(timeout_s=5, retries=0)).check(_payloads()[0])
    finally:
        listener.close()
    assert "answered HTTP 302" in why and "data.reward_url" in why
