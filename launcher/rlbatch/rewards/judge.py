"""``data.reward=judge``: an LLM judge behind an OpenAI-compatible chat endpoint.

Each sample is one ``POST {base}/v1/chat/completions`` with one user message: the judge
template (``data.judge.template``, or :data:`DEFAULT_TEMPLATE`) with ``{prompt}``,
``{completion}``, ``{answer}`` and ``{max_score}`` filled in.

The score is read, not guessed: reasoning blocks (``<think>...</think>``; an unclosed one runs
to the end of the reply) are removed, then ``data.judge.score_pattern`` (default
:data:`DEFAULT_SCORE_PATTERN`: ``Score: N`` or ``Score: N/M``) must find one score, the same
wherever it occurs, in [0, ``data.judge.max_score``], on that scale when the judge wrote one
(``Score: 85/100`` on a 10 scale is refused, not clamped). The reward is the score over
``max_score``. Any other reply (no score, two different ones, a number out of range, a
restated scale taken for a score, a degenerate ``8888...``, a score the completion wrote that
the judge quotes beside its own) scores 0 with reason ``no_score``, never a guess. The
completion's own reasoning tags reach the judge as ``&lt;think&gt;`` (:func:`defuse_tags`): a
quote of them is not taken for the end of the judge's reasoning. The reply is
caused by the completion graded, so it never stops the run (data.served.on_error governs
requests that failed); data.served.max_error_fraction bounds how many of a step's samples may
end so.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from rlbatch.config.rewards import JudgeConfig, ServedConfig
from rlbatch.rewards.base import Scored
from rlbatch.rewards.served import ServedError, post_json, score_requests

DEFAULT_TEMPLATE = (
    "You grade answers. Question:\n{prompt}\n\nReference answer:\n{answer}\n\n"
    "Answer to grade:\n{completion}\n\n"
    "Grade the answer from 0 (wrong) to {max_score} (fully correct). End your reply with one"
    " line of the form 'Score: N', N an integer from 0 to {max_score}, and write no other line"
    " that starts with 'Score:'."
)
DEFAULT_SCORE_PATTERN = (
    r"(?i)\bscore\**\s*[:=]\s*(?:\*+\s*)?(?P<score>[+-]?\d+(?:\.\d+)?)(?!\w|[.,]\d|\s*%)"
    r"(?:\s*(?:points?\s*)?(?:\(\s*)?(?:/|out\s+of|of)\s*(?:a\s+possible\s+)?"
    r"(?P<max>\d+(?:\.\d+)?)(?!\w|[.,]\d))?(?!\s*(?:[-\u2013\u2014~\u2026\u2192]|-+>|to|or)\s*\d)"
)
"""``Score: 7``, ``**Score:** 7``, ``score = 7.5``, ``Score: 7/10``, ``Score: 7 out of 10``,
``Score: 7 points (out of 100)`` (a scale, refused unless it is data.judge.max_score). Not a
score: a range or a revision (``Score: 6-8``, ``6 – 8``, ``6~8``, ``6 or 8``, ``6 -> 8``), a
percentage (``Score: 5%``), a number read in part (``Score: 1e1``, the decimal comma of
``Score: 7,5``). Linear in the reply's length (no two adjacent repeats that can match the same
text): a degenerate reply of a megabyte is read at once."""
CHAT_PATH = "/v1/chat/completions"


class NoScore(ValueError):
    """A judge reply without one unambiguous score in range (says why)."""


def chat_url(url: str) -> str:
    """The chat completions URL of a server's base URL (kept when it already ends with it)."""
    url = url.rstrip("/")
    if url.endswith(CHAT_PATH):
        return url
    return url[: -len("/v1")] + CHAT_PATH if url.endswith("/v1") else url + CHAT_PATH


def strip_reasoning(reply: str) -> str:
    """The reply without its reasoning: closed ``<think>`` blocks removed, everything up to a
    lone ``</think>`` (the template opened the block) and from an unclosed ``<think>`` on.
    One pass over the text (a regular expression retried at every unclosed tag is quadratic)."""
    lower = reply.lower()
    pieces, pos = [], 0
    while True:
        start = lower.find("<think>", pos)
        end = lower.find("</think>", start + len("<think>")) if start >= 0 else -1
        if end < 0:
            break
        pieces += [reply[pos:start], " "]
        pos = end + len("</think>")
    text = "".join([*pieces, reply[pos:]])
    lower = text.lower()
    if "</think>" in lower:
        text = text[lower.rindex("</think>") + len("</think>") :]
        lower = text.lower()
    if "<think>" in lower:
        text = text[: lower.index("<think>")]
    return text


_REASONING_TAG = re.compile(r"<(/?)(think)>", re.IGNORECASE)


def defuse_tags(completion: str) -> str:
    """The completion as the judge sees it: its ``<think>`` / ``</think>`` written
    ``&lt;think&gt;`` / ``&lt;/think&gt;``. A judge that quotes the completion after its verdict
    would otherwise quote a tag that :func:`strip_reasoning` takes for the judge's own, erasing
    the verdict and keeping a score the completion wrote (``</think> Score: 10``)."""
    return _REASONING_TAG.sub(lambda m: f"&lt;{m[1]}{m[2]}&gt;", completion)


def pattern_problem(pattern: str) -> str:
    """ "" when ``pattern`` compiles and has a group named ``score``, else why not."""
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        return f"is not a regular expression ({err})"
    if "score" not in compiled.groupindex:
        return "has no group named 'score': write it as (?P<score>...)"
    return ""


def read_score(reply: str, pattern: str, max_score: float) -> float:
    """The judge's score over ``max_score``, in [0, 1]; NoScore saying why there is none."""
    text = strip_reasoning(reply)
    found = set()
    for m in re.finditer(pattern, text):
        groups = m.groupdict()
        scale = groups.get("max")
        try:
            value = float(groups["score"])
            found.add((value, None if scale is None else float(scale)))
        except (TypeError, ValueError):
            raise NoScore(f"{m.group(0)!r} matched, but its score is not a number") from None
    if not found:
        raise NoScore("no score in the form data.judge.score_pattern asks for")
    if len({v for v, _ in found}) > 1:
        raise NoScore(f"several different scores {sorted(v for v, _ in found)}")
    scales = {s for _, s in found if s is not None}
    if scales and scales != {float(max_score)}:
        raise NoScore(
            f"a score on a scale of {sorted(scales)}, not data.judge.max_score={max_score:g}"
        )
    value = found.pop()[0]
    if not 0.0 <= value <= max_score:
        raise NoScore(f"score {value:g} is outside [0, data.judge.max_score={max_score:g}]")
    return value / max_score


def render(template: str, prompt: str, completion: str, answer: str, max_score: float) -> str:
    """The judge's message: the four placeholders replaced (other braces left alone); the
    completion last, so text in it that looks like a placeholder stays as written."""
    return (
        template.replace("{max_score}", f"{max_score:g}")
        .replace("{prompt}", prompt)
        .replace("{answer}", answer)
        .replace("{completion}", completion)
    )


def reply_text(answer: Any, url: str) -> str:
    """choices[0].message.content of a chat completion, else ServedError."""
    try:
        content = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    if not isinstance(content, str):
        raise ServedError(f"{url} answered {str(answer)[:200]!r}: not a chat completion")
    return content


class JudgeReward:
    """Scores each sample by asking the judge at ``url``."""

    def __init__(self, url: str, judge: JudgeConfig, served: ServedConfig) -> None:
        self.url = chat_url(url)
        self.judge = judge
        self.served = served
        self.pattern = judge.score_pattern or DEFAULT_SCORE_PATTERN

    def _request(self, message: str) -> dict[str, Any]:
        return {
            "model": self.judge.model,
            "messages": [{"role": "user", "content": message}],
            "max_tokens": self.judge.max_tokens,
            "temperature": self.judge.temperature,
        }

    def ask(self, message: str) -> float:
        """The judge's score of one message, in [0, 1]; ServedError when the request fails
        (reason ``served_error``) or the reply has no usable score (reason ``no_score``)."""
        reply = reply_text(post_json(self.url, self._request(message), self.served), self.url)
        try:
            return read_score(reply, self.pattern, self.judge.max_score)
        except NoScore as why:
            raise ServedError(f"{self.url} replied {reply[:200]!r}: {why}", "no_score") from None

    def _call(self, message: str) -> Callable[[], list[float]]:
        return lambda: [self.ask(message)]

    def score(self, messages: Sequence[str], labels: Sequence[str]) -> list[Scored]:
        calls = [self._call(m) for m in messages]
        return score_requests(calls, labels, [1] * len(messages), self.url, self.served)

    def message(self, prompt: str, completion: str, answer: str) -> str:
        template = self.judge.template or DEFAULT_TEMPLATE
        return render(template, prompt, defuse_tags(completion), answer, self.judge.max_score)

    def check(self, prompt: str, answer: str) -> str:
        """ "" when the endpoint grades one sample (the reference answer as the completion)
        with a score it can read, with the run's timeout and retries; else what came back."""
        try:
            self.ask(self.message(prompt, answer, answer))
        except ServedError as err:
            return str(err)
        return ""
