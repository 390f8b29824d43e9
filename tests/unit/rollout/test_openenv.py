"""The built-in OpenEnv harness's pure parts (env.agent.openenv_url): which action field takes
the reply by default (checked on OpenEnv's own Action models' JSON schemas), an observation as
a user message, the reset seed a row's episodes share, and the first call's messages. The
harness through rlbatch-train is tests/e2e/test_openenv_cli.py.

The action schemas are pydantic's, as OpenEnv's server publishes them (its Action is a pydantic
model with a ``metadata`` dict); importing openenv itself would import gradio, seconds of CPU."""

from __future__ import annotations

from typing import Optional

import pytest
from pydantic import BaseModel, ConfigDict, Field, create_model

from rlbatch.rollout.agent.openenv import first_messages, observation_text, reset_seed, text_field


class Action(BaseModel):  # the shape of openenv.core.env_server.types.Action
    model_config = ConfigDict(extra="forbid")
    metadata: dict = Field(default_factory=dict)


def _schema(**fields):
    return create_model("A", __base__=Action, **fields).model_json_schema()


def test_the_default_action_is_the_one_required_text_field():
    assert text_field(_schema(message=(str, ...))) == "message"
    assert text_field(_schema(message=(str, ...), tag=(str, ""))) == "message"  # one required
    assert text_field(_schema(code=(Optional[str], None))) == "code"  # the only text field
    assert text_field(_schema(message=(str, ...), mood=(str, ...))) is None
    assert text_field(_schema(move=(int, ...))) is None
    assert text_field(_schema(move=(int, ...), note=(str, ""))) is None  # required is no text
    assert text_field(_schema()) is None  # metadata alone


def test_an_observation_is_its_only_text_or_its_fields_as_json():
    assert observation_text({"prompt": "go", "extra": None}) == "go"
    assert observation_text({"b": "x", "a": 2}) == '{"a": 2, "b": "x"}'
    assert observation_text({"a": "x", "b": "y"}) == '{"a": "x", "b": "y"}'
    assert observation_text({"board": [[1, 0]], "metadata": {"k": 1}}) == '{"board": [[1, 0]]}'


def test_a_rows_episodes_share_its_seed():
    row = {"prompt": "Play:", "answer": "0"}
    assert reset_seed(row) == reset_seed(dict(row)) and 0 <= reset_seed(row) < 2**31
    assert reset_seed({**row, "prompt": "Play on:"}) != reset_seed(row)
    assert reset_seed({**row, "seed": 12}) == 12
    assert reset_seed({**row, "seed": -1}) != -1  # not a valid OpenEnv seed: drawn instead


def test_the_first_call_is_the_rows_prompt_then_the_reset_observation():
    assert first_messages("Play:", "task 3") == [{"role": "user", "content": "Play:\n\ntask 3"}]
    assert first_messages("", "task 3") == [{"role": "user", "content": "task 3"}]
    assert first_messages("Play:", "") == [{"role": "user", "content": "Play:"}]
    system = [{"role": "system", "content": "Be brief."}]
    assert first_messages(system, "task 3") == system + [{"role": "user", "content": "task 3"}]
    chat = system + [{"role": "user", "content": "Play:"}]
    assert first_messages(chat, "task 3")[-1] == {"role": "user", "content": "Play:\n\ntask 3"}
    assert chat[-1]["content"] == "Play:"  # the row is left as it was


def test_the_server_is_checked_before_launch():
    """default_action_problem reads the server's /health and /schema (OpenEnv's routes; served
    here by the standard library): an action with one text field is served by the default, one
    with two needs a function, naming its fields; no server is 'does not answer'."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from rlbatch.rollout.agent.openenv import OpenEnvError, default_action_problem

    schemas = {"/one": _schema(message=(str, ...)), "/two": _schema(a=(str, ...), b=(str, ...))}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the standard library's name
            app, _, route = self.path.rpartition("/")
            body = {"status": "healthy"} if route == "health" else {"action": schemas[app]}
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert default_action_problem(url + "/one") is None
        problem = default_action_problem(url + "/two/")
        assert problem and "(fields: a, b) has no single required text field" in problem
        assert "env.agent.openenv_action=PATH.py:fn" in problem
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(OpenEnvError, match="does not answer as an OpenEnv server"):
        default_action_problem(url, timeout=2)


def test_a_full_server_is_an_error_naming_both_fixes():
    """A session past the server's max_concurrent_envs: OpenEnv's client raises the server's
    error (this text is what openenv-core 0.3.0's server and GenericEnvClient give for a second
    session on max_concurrent_envs=1); the episode's error names the call and both fixes."""
    import asyncio

    from rlbatch.rollout.agent.openenv import OpenEnvError, OpenEnvHarness

    full = (
        "Server error: Server at capacity: 1/1 sessions active. Cannot accept new connections."
        " (code: CAPACITY_REACHED)"
    )

    async def refused():
        raise RuntimeError(full)

    harness = object.__new__(OpenEnvHarness)  # no server to read a schema from
    harness.url = "http://127.0.0.1:1"
    with pytest.raises(OpenEnvError) as caught:
        asyncio.run(harness._call(refused(), "reset"))
    text = str(caught.value)
    assert text.startswith("the OpenEnv server http://127.0.0.1:1 failed the reset: " + full)
    assert "max_concurrent_envs" in text and "env.max_concurrency" in text
