"""The multi-turn driver: runs an environment's episodes for the rollout engine.

The decoding loop (rlbatch.rollout.multiturn) speaks token ids only; this driver turns them into
the environment's calls and back: ``begin`` resets one episode per row, ``submit`` decodes an
assistant turn and starts its ``step`` call, ``collect`` waits for those calls and answers each
row with its observation's token ids (rendered by the chat template; one over
env.max_observation_tokens has its content cut, its wrapper kept) or None when the episode is over (done, env.max_turns, or an error
under env.on_error=zero_reward). Synchronous methods run in a thread pool of
env.max_concurrency; ``async def`` ones on one event loop in a background thread; each call is
bounded by env.timeout_s.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Optional

from rlbatch.config.enums import ChatTemplate, EnvOnError
from rlbatch.config.errors import ConfigErrors
from rlbatch.config.schema import RunConfig
from rlbatch.env.protocol import EnvCallError, StepResult, as_step_result
from rlbatch.env.render import observation_text, wrapper_error, wrapper_text
from rlbatch.grpo.types import Prompt


@dataclass
class Episode:
    """One row's episode: what logging.samples writes and the metrics read."""

    sample: int
    """Row index in the rollout call (errors name it)."""
    prompt_index: int
    state: Any = None
    turns: list[dict[str, Any]] = field(default_factory=list)
    """{"role": "assistant" | "observation", "text", "tokens"} in order."""
    rewards: list[float] = field(default_factory=list)
    """The reward of each step."""
    end: str = ""
    """done | max_turns | max_total_tokens | max_new_tokens | error."""
    error: Optional[str] = None
    truncated: bool = False
    seconds: float = 0.0
    """Time spent in this episode's reset / step calls."""
    observation_tokens: int = 0
    observations_cut: int = 0
    steps_called: int = 0
    """step calls made (answered, failed or timed out)."""

    @property
    def reached_env(self) -> bool:
        """Its environment was asked something beyond reset: a step call, or a failed reset."""
        return self.steps_called > 0 or self.end == "error"

    @property
    def num_turns(self) -> int:
        return sum(1 for t in self.turns if t["role"] == "assistant")

    def record(self) -> dict[str, Any]:
        """The plain dict Sample.episode carries."""
        return {
            "turns": self.turns,
            "num_turns": self.num_turns,
            "rewards": self.rewards,
            "reward": sum(self.rewards),
            "end": self.end,
            "error": self.error,
            "truncated": self.truncated,
            "env_seconds": self.seconds,
            "observation_tokens": self.observation_tokens,
            "observations_cut": self.observations_cut,
            "reached_env": self.reached_env,
        }


class _DaemonPool:
    """A thread pool of daemon threads: a call that never returns (past env.timeout_s) cannot
    keep the worker process from exiting, as it would with concurrent.futures' pool (whose
    threads the interpreter joins at exit)."""

    def __init__(self, num_threads: int) -> None:
        self.tasks: queue.SimpleQueue[Optional[tuple[Any, Future]]] = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._serve, name=f"rlbatch-env-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self.threads:
            thread.start()

    def _serve(self) -> None:
        while (task := self.tasks.get()) is not None:
            fn, future = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                future.set_exception(err)

    def submit(self, fn: Any) -> Future:
        future: Future = Future()
        self.tasks.put((fn, future))
        return future

    def shutdown(self) -> None:
        for _ in self.threads:
            self.tasks.put(None)


class _Calls:
    """Runs environment methods: sync ones in a thread pool, async ones on one event loop."""

    def __init__(self, max_concurrency: int) -> None:
        self.pool = _DaemonPool(max_concurrency)
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(
                target=self._loop.run_forever, name="rlbatch-env-loop", daemon=True
            ).start()
        return self._loop

    def submit(self, method: Any, *args: Any) -> Future:
        """A future of (value, seconds the call took)."""
        if inspect.iscoroutinefunction(method):

            async def timed() -> tuple[Any, float]:
                started = time.perf_counter()
                value = await method(*args)
                return value, time.perf_counter() - started

            return asyncio.run_coroutine_threadsafe(timed(), self._event_loop())

        def run() -> tuple[Any, float]:
            started = time.perf_counter()
            value = method(*args)
            if inspect.isawaitable(value):
                value = asyncio.run_coroutine_threadsafe(
                    _awaited(value), self._event_loop()
                ).result()
            return value, time.perf_counter() - started

        return self.pool.submit(run)

    def close(self) -> None:
        self.pool.shutdown()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)


async def _awaited(value: Any) -> Any:
    return await value


class EnvDriver:
    """The TurnDriver of rlbatch.rollout.multiturn over one environment instance (this rank's)."""

    def __init__(self, env: Any, cfg: RunConfig, tokenizer: Any) -> None:
        self.env = env
        self.name = type(env).__qualname__
        self.limits = cfg.env
        self.template = ChatTemplate(cfg.data.chat_template)
        self.prompt_key, self.answer_key = cfg.data.prompt_key, cfg.data.answer_key
        self.tokenizer = tokenizer
        self.calls = _Calls(cfg.env.max_concurrency)
        self.episodes: list[Episode] = []
        self._pending: dict[int, tuple[Future, float]] = {}
        self._closed: set[int] = set()
        """Rows that submitted a turn to an episode already over (a failed reset)."""
        self._wrapped: Optional[tuple[tuple[str, list[int]], tuple[str, list[int]]]] = None

    # ---------------------------------------------------------------- episodes
    def _row(self, prompt: Prompt) -> dict[str, Any]:
        raw = prompt.raw if prompt.raw is not None else prompt.text
        return {**prompt.fields, self.prompt_key: raw, self.answer_key: prompt.answer}

    def _where(self, ep: Episode, method: str) -> str:
        turn = "" if method == "reset" else f", turn {ep.num_turns}"
        return (
            f"environment {self.name}.{method} on sample {ep.sample} (prompt index"
            f" {ep.prompt_index}){turn}"
        )

    def begin(self, prompts: Sequence[Prompt]) -> None:
        """One episode per row: every reset runs (concurrently) before decoding starts."""
        self._pending, self._closed = {}, set()
        self.episodes = [Episode(i, p.index) for i, p in enumerate(prompts)]
        futures = [
            (ep, self.calls.submit(self.env.reset, self._row(p)), time.monotonic())
            for ep, p in zip(self.episodes, prompts, strict=True)
        ]
        for ep, future, started in futures:
            try:
                ep.state = self._result(ep, "reset", future, started)
            except EnvCallError as err:
                self._fail(ep, err)

    def _add_turn(self, ep: Episode, turn_ids: list[int]) -> str:
        """Record an assistant turn; returns its text (EOS excluded)."""
        ends = turn_ids and turn_ids[-1] in self.tokenizer.eos_ids
        ids = turn_ids[:-1] if ends else turn_ids
        text = self.tokenizer.decode(list(ids))
        ep.turns.append({"role": "assistant", "text": text, "tokens": len(turn_ids)})
        return text

    def submit(self, row: int, turn_ids: list[int]) -> None:
        ep = self.episodes[row]
        text = self._add_turn(ep, turn_ids)
        if ep.end:  # its reset failed (env.on_error=zero_reward): the episode is over
            self._closed.add(row)
            return
        ep.steps_called += 1
        self._pending[row] = (self.calls.submit(self.env.step, ep.state, text), time.monotonic())

    def collect(self) -> dict[int, Optional[list[int]]]:
        pending, self._pending = self._pending, {}
        answers: dict[int, Optional[list[int]]] = dict.fromkeys(self._closed)
        self._closed = set()
        for row, (future, started) in pending.items():
            answers[row] = self._answer(self.episodes[row], future, started)
        return answers

    def end(self, row: int, reason: str, turn_ids: list[int]) -> None:
        ep = self.episodes[row]
        if turn_ids:
            self._add_turn(ep, turn_ids)
        elif ep.turns and ep.turns[-1]["role"] == "observation":  # given, but it did not fit
            ep.observation_tokens -= ep.turns.pop()["tokens"]
        if not ep.end:
            ep.end, ep.truncated = reason, True

    def records(self) -> list[dict[str, Any]]:
        return [ep.record() for ep in self.episodes]

    def close(self) -> None:
        self.calls.close()

    # ---------------------------------------------------------------- one call
    def _result(self, ep: Episode, method: str, future: Future, started: float) -> Any:
        """The call's value; EnvCallError naming the environment, sample and turn."""
        remaining = max(0.0, started + self.limits.timeout_s - time.monotonic())
        try:
            value, seconds = future.result(timeout=remaining)
        except FutureTimeout as err:
            ep.seconds += self.limits.timeout_s
            raise EnvCallError(
                f"{self._where(ep, method)} took longer than env.timeout_s={self.limits.timeout_s}"
            ) from err
        except Exception as err:  # noqa: BLE001 - the user's environment: any exception
            raise EnvCallError(
                f"{self._where(ep, method)} raised {type(err).__name__}: {err}"
            ) from err
        ep.seconds += seconds
        return value

    def _fail(self, ep: Episode, err: EnvCallError) -> None:
        if EnvOnError(self.limits.on_error) == EnvOnError.raise_error:
            raise err
        ep.end, ep.error = "error", str(err)

    def _answer(self, ep: Episode, future: Future, started: float) -> Optional[list[int]]:
        """Observation ids for the row's next turn, or None when its episode is over."""
        try:
            result: StepResult = as_step_result(
                self._result(ep, "step", future, started), self._where(ep, "step")
            )
        except EnvCallError as err:
            self._fail(ep, err)
            return None
        ep.rewards.append(result.reward)
        if result.done or result.observation is None:
            ep.end = "done"
            return None
        if ep.num_turns >= self.limits.max_turns:
            ep.end, ep.truncated = "max_turns", True
            return None
        text, ids, cut = self._observation(result.observation)
        ep.observations_cut += cut
        ep.turns.append({"role": "observation", "text": text, "tokens": len(ids)})
        ep.observation_tokens += len(ids)
        return ids

    def _observation(self, observation: str) -> tuple[str, list[int], bool]:
        """(text, ids, cut) appended for ``observation``: the rendered turn, or, when it is over
        env.max_observation_tokens, its content cut to what the wrapper leaves (the wrapper's
        ids around the content's first ids; the text is what those ids are)."""
        text = observation_text(self.template, observation, self.tokenizer)
        ids = [int(t) for t in self.tokenizer.encode(text)]
        if len(ids) <= self.limits.max_observation_tokens:
            return text, ids, False
        (before, before_ids), (after, after_ids) = self._wrapper()
        room = self.limits.max_observation_tokens - len(before_ids) - len(after_ids)
        content = [int(t) for t in self.tokenizer.encode(observation)][:room]
        kept = self.tokenizer.decode(content)
        return before + kept + after, before_ids + content + after_ids, True

    def _wrapper(self) -> tuple[tuple[str, list[int]], tuple[str, list[int]]]:
        """The template's text and ids before and after an observation's content (cached)."""
        if self._wrapped is None:
            error = wrapper_error(self.template, self.tokenizer, self.limits.max_observation_tokens)
            if error is not None:
                raise ConfigErrors([error])
            parts = wrapper_text(self.template, self.tokenizer)
            before, after = ((t, [int(i) for i in self.tokenizer.encode(t)]) for t in parts)
            self._wrapped = (before, after)
        return self._wrapped
