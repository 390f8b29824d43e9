"""OpenEnv environments served over HTTP (env.agent.openenv_url): a built-in agent harness.

:class:`OpenEnvHarness` is an ordinary harness, ``run(client, model, row)``, on the same
endpoint as any other (exact tokens, splice, splits): an episode opens its own session on the
OpenEnv server through OpenEnv's own client (``GenericEnvClient``: one WebSocket, one
environment instance on the server), resets it with the row's seed, and then, up to
env.max_turns times, asks the policy for a reply through the endpoint, turns the reply into an
action (env.agent.openenv_action, or the action's only required text field) and steps the
environment with it; each observation is the next user message. The episode's reward is the
environment's rewards summed (reset's and every step's; a missing reward counts 0).

Which text the policy sees: the row's prompt (data.prompt_key: text, or messages) followed by
the reset observation, then one user message per later observation. An observation is its only
text field when it has one, otherwise its fields as JSON (sorted keys).

The pre-launch checks (the server answering, the default action having a text field) use the
server's plain HTTP routes (/health, /schema) with the standard library: the driver never
imports openenv (its import pulls gradio, seconds of CPU).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Optional

OBSERVATION_LEFT_OUT = ("reward", "done", "metadata")
"""Fields OpenEnv's server never sends inside an observation (they travel beside it)."""


class OpenEnvError(RuntimeError):
    """The OpenEnv server refused or failed a session, a reset or a step."""


# ------------------------------------------------------------------------------ pure parts
def text_field(action_schema: dict[str, Any]) -> Optional[str]:
    """The action field a text-action environment takes the reply in: the only required string
    field of the action's JSON schema (``metadata`` aside), or its only string field when none is
    required; None when there is no such single field (a function must build the action)."""
    props = {k: v for k, v in (action_schema.get("properties") or {}).items() if k != "metadata"}
    strings = [k for k, v in props.items() if _is_string(v)]
    required = [k for k in action_schema.get("required") or [] if k in props]
    if required:
        return required[0] if len(required) == 1 and required[0] in strings else None
    return strings[0] if len(strings) == 1 else None


def _is_string(prop: dict[str, Any]) -> bool:
    if prop.get("type") == "string":
        return True
    options = prop.get("anyOf") or []
    return any(o.get("type") == "string" for o in options) and all(
        o.get("type") in ("string", "null") for o in options
    )


def observation_text(observation: Any) -> str:
    """The user message an observation becomes: its only text field, else its fields as JSON."""
    if isinstance(observation, str):
        return observation
    if not isinstance(observation, dict):
        return json.dumps(observation, sort_keys=True, ensure_ascii=False, default=str)
    fields = {k: v for k, v in observation.items() if k not in OBSERVATION_LEFT_OUT}
    texts = [v for v in fields.values() if isinstance(v, str)]
    if len(texts) == 1 and all(v is None or isinstance(v, str) for v in fields.values()):
        return texts[0]
    return json.dumps(fields, sort_keys=True, ensure_ascii=False, default=str)


def reset_seed(row: dict[str, Any]) -> int:
    """The seed an episode's reset gets: the row's ``seed`` field (an int >= 0), else one drawn
    from the row's content. Every episode of a row (its grpo.num_generations) gets the same, so
    a group's episodes face the same task when the environment is deterministic in its seed."""
    seed = row.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:
        return seed
    text = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") >> 1


def first_messages(prompt: Any, observation: str) -> list[dict[str, Any]]:
    """The episode's first call: the row's prompt (text: one user message; messages: as they
    are), the reset observation joined to its last user message by a blank line (or a user
    message of its own)."""
    if isinstance(prompt, list):
        messages = [dict(m) for m in prompt]
    else:
        messages = [{"role": "user", "content": str(prompt)}] if str(prompt or "").strip() else []
    if not observation:
        return messages
    if messages and messages[-1].get("role") == "user" and isinstance(messages[-1].get("content"), str):  # fmt: skip
        messages[-1]["content"] = f"{messages[-1]['content']}\n\n{observation}"
    else:
        messages.append({"role": "user", "content": observation})
    return messages


def text_action(field: str) -> Callable[[str, Any], dict[str, Any]]:
    """The default env.agent.openenv_action: the reply as the action's one text field."""

    def act(text: str, observation: Any) -> dict[str, Any]:
        return {field: text}

    return act


# ------------------------------------------------------------------------------ the server
def _get(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as answer:  # noqa: S310 - the user's server
        return json.loads(answer.read().decode())


def action_schema(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The action's JSON schema the server at ``url`` publishes (GET /schema); OpenEnvError
    when it does not answer as an OpenEnv server."""
    base = url.rstrip("/")
    try:
        _get(f"{base}/health", timeout)
        schema = _get(f"{base}/schema", timeout)
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise OpenEnvError(f"does not answer as an OpenEnv server (GET /health, /schema): {err}") from err  # fmt: skip
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
        raise OpenEnvError(f"answered /schema without an action schema: {schema!r:.200}")
    return schema["action"]


def load_action(spec: str) -> Callable[..., Any]:
    """The ``fn(text, observation)`` env.agent.openenv_action names; ValueError saying what is
    wrong."""
    from rlbatch.grpo.user_rewards import RewardSpecError, load_callable

    try:
        fn = load_callable(spec, what="function")
    except RewardSpecError as err:
        raise ValueError(str(err)) from err
    try:
        inspect.signature(fn).bind("", {})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{spec} cannot be called as fn(text, observation): {err}") from err
    return fn


def default_action_problem(url: str, timeout: float = 10.0) -> Optional[str]:
    """Why the default action cannot serve the server at ``url`` (None when it can)."""
    schema = action_schema(url, timeout)
    if text_field(schema) is not None:
        return None
    fields = ", ".join(sorted(k for k in (schema.get("properties") or {}) if k != "metadata"))
    return (
        f"the environment's action (fields: {fields or 'none'}) has no single required text"
        " field for the reply: set env.agent.openenv_action=PATH.py:fn, fn(text, observation)"
        " returning the action as a dict"
    )


# ------------------------------------------------------------------------------ the harness
class OpenEnvHarness:
    """``run(client, model, row)`` for env.agent.openenv_url (see the module docstring)."""

    def __init__(self, cfg: Any) -> None:
        from openenv import GenericEnvClient  # here, not on the harness loop: it imports gradio

        self.client_class = GenericEnvClient
        env = cfg.env
        self.url = env.agent.openenv_url.rstrip("/")
        self.prompt_key = cfg.data.prompt_key
        self.max_turns = env.max_turns
        self.timeout_s = env.agent.episode_timeout_s
        if env.agent.openenv_action:
            self.act = load_action(env.agent.openenv_action)
        else:
            field = text_field(action_schema(self.url))
            if field is None:  # the pre-launch check says so first
                raise OpenEnvError(str(default_action_problem(self.url)))
            self.act = text_action(field)

    async def __call__(self, client: Any, model: str, row: dict[str, Any]) -> dict[str, float]:
        session = self.client_class(
            base_url=self.url, connect_timeout_s=30.0, message_timeout_s=self.timeout_s
        )
        try:
            try:
                await session.connect()
            except Exception as err:  # noqa: BLE001 - OpenEnv's client wraps every cause
                raise OpenEnvError(f"env.agent.openenv_url={self.url} is not answering: {err}") from err  # fmt: skip
            return await self._episode(session, client, model, row)
        finally:
            await session.close()

    async def _episode(
        self, session: Any, client: Any, model: str, row: dict[str, Any]
    ) -> dict[str, float]:
        result = await self._call(session.reset(seed=reset_seed(row)), "reset")
        total = float(result.reward or 0.0)
        messages = first_messages(row.get(self.prompt_key), observation_text(result.observation))
        steps, done = 0, bool(result.done)
        while not done and steps < self.max_turns:
            out = await client.chat.completions.create(model=model, messages=messages)
            choice = out.choices[0]
            if not (out.usage and out.usage.completion_tokens) and choice.finish_reason == "length":
                break  # no room left under env.max_total_tokens or env.max_turns: no action
            messages.append(choice.message.model_dump(exclude_none=True))
            action = self.act(choice.message.content or "", result.observation)
            if inspect.isawaitable(action):
                action = await action
            if hasattr(action, "model_dump"):
                action = action.model_dump()
            if not isinstance(action, dict):
                raise OpenEnvError(
                    f"the action function returned {type(action).__name__} {action!r:.80}:"
                    " return the action as a dict (or the environment's Action model)"
                )
            steps += 1
            result = await self._call(session.step(action), f"step {steps}")
            total += float(result.reward or 0.0)
            done = bool(result.done)
            if not done:
                messages.append({"role": "user", "content": observation_text(result.observation)})  # fmt: skip
        return {"reward": total, "steps": float(steps), "done": float(done)}

    async def _call(self, call: Any, what: str) -> Any:
        """The session's reset / step, its failure an OpenEnvError naming the server and the
        call (and the fix when the server is full)."""
        try:
            return await call
        except Exception as err:  # noqa: BLE001 - the server's errors, and a dropped connection
            text = f"{type(err).__name__}: {err}" if not isinstance(err, RuntimeError) else str(err)
            fix = ""
            if "CAPACITY_REACHED" in text:
                fix = (
                    ": the server takes fewer sessions at once than episodes run (env.max_concurrency"
                    " per data-parallel rank): start it with max_concurrent_envs at least that many"
                    " (its environment SUPPORTS_CONCURRENT_SESSIONS), or lower env.max_concurrency"
                )
            raise OpenEnvError(f"the OpenEnv server {self.url} failed the {what}: {text}{fix}") from err  # fmt: skip
