"""``data.reward=judge``: an LLM judge behind an OpenAI-compatible chat endpoint.

Each sample is one ``POST {base}/v1/chat/completions`` with one user message: the judge
template (``data.judge.template``, or :data:`DEFAULT_TEMPLATE`) with ``{prompt}``,
``{completion}`` and ``{answer}`` filled in. The score is read from the reply by one rule: the
last number in it (``7``, ``7.5``, ``-1``, the ``8`` of ``8/10``: a number right after a
slash is the scale, not the score), divided by ``data.judge.max_score`` and clamped to [0, 1].
A reply without a number is a failure of that request (data.served.on_error decides).
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
    "Reply with one integer from 0 (wrong) to 10 (fully correct), and nothing else."
)
CHAT_PATH = "/v1/chat/completions"
_NUMBER = re.compile(r"(?<![\d/.])-?\d+(?:\.\d+)?")


def chat_url(url: str) -> str:
    """The chat completions URL of a server's base URL (kept when it already ends with it)."""
    url = url.rstrip("/")
    if url.endswith(CHAT_PATH):
        return url
    return url[: -len("/v1")] + CHAT_PATH if url.endswith("/v1") else url + CHAT_PATH


def parse_score(reply: str, max_score: float) -> float | None:
    """The judge's score in [0, 1]: the last number of the reply that does not follow a slash,
    over ``max_score``, clamped; None when the reply has no number."""
    numbers = _NUMBER.findall(reply)
    if not numbers:
        return None
    return min(1.0, max(0.0, float(numbers[-1]) / max_score))


def render(template: str, prompt: str, completion: str, answer: str) -> str:
    """The judge's message: the three placeholders replaced (other braces left alone)."""
    return (
        template.replace("{prompt}", prompt)
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

    def _request(self, message: str) -> dict[str, Any]:
        return {
            "model": self.judge.model,
            "messages": [{"role": "user", "content": message}],
            "max_tokens": self.judge.max_tokens,
            "temperature": self.judge.temperature,
        }

    def _call(self, message: str) -> Callable[[], list[float]]:
        def call() -> list[float]:
            reply = reply_text(post_json(self.url, self._request(message), self.served), self.url)
            score = parse_score(reply, self.judge.max_score)
            if score is None:
                raise ServedError(f"{self.url} replied {reply[:200]!r}: no score (a number) in it")
            return [score]

        return call

    def score(self, messages: Sequence[str], labels: Sequence[str]) -> list[Scored]:
        calls = [self._call(m) for m in messages]
        return score_requests(calls, labels, [1] * len(messages), self.url, self.served)

    def message(self, prompt: str, completion: str, answer: str) -> str:
        return render(self.judge.template or DEFAULT_TEMPLATE, prompt, completion, answer)

    def check(self) -> str:
        """ "" when the endpoint answers a chat completion, else what came back."""
        probe = ServedConfig(timeout_s=self.served.timeout_s, retries=0)
        try:
            reply_text(post_json(self.url, self._request("Reply with 0."), probe), self.url)
        except ServedError as err:
            return str(err)
        return ""
