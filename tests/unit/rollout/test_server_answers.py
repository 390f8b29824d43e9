"""rollout.backend=vllm_server's checks of a server's answers that need no server: a row is
a finished response (a stop at one of the run's EOS ids) or a truncated one (the row's limit),
an aborted row is sent again, anything else stops the run; every token must carry the label
of the weights this process pushed last (the end-to-end runs are in
tests/e2e/test_vllm_servers.py)."""

from __future__ import annotations

import pytest

from rlbatch.rollout.protocol import TokenSampling
from rlbatch.rollout.servers.answers import RowAborted, read_row, request_body
from rlbatch.rollout.servers.client import ServerError

URL = "http://127.0.0.1:9"
EOS = (258, 7)


def _choice(tokens, finish, stop=None, spans=None):
    return {
        "token_ids": tokens,
        "logprobs": {"content": [{"logprob": -0.5} for _ in tokens]},
        "finish_reason": finish,
        "stop_reason": stop,
        "weight_versions": spans,
    }


def _labelled(n, label="abc-2"):
    return [{"version": label, "start": 0, "end": n}]


def _read(choice, limit=4, label="abc-2"):
    return read_row(URL, choice, eos_ids=EOS, limit=limit, prompt_len=3, label=label)


def test_the_request_stops_at_the_run_eos_ids_alone():
    sampling = TokenSampling(max_new_tokens=4, temperature=0.7, eos_id=258)
    body = request_body([1, 2], seed=5, limit=3, sampling=sampling, eos_ids=[258, 7])
    params = body["sampling_params"]
    assert params["stop_token_ids"] == [258, 7] and params["ignore_eos"] is True
    assert (params["seed"], params["max_tokens"], body["token_ids"]) == (5, 3, [1, 2])


@pytest.mark.parametrize("eos", EOS)
def test_a_stop_at_one_of_the_run_eos_ids_is_a_finished_row(eos):
    row = _read(_choice([4, 5, eos], "stop", eos, _labelled(3)))
    assert (row.tokens, row.truncated) == ([4, 5, eos], False)
    assert row.logps == [-0.5] * 3


def test_the_row_limit_is_a_truncated_row():
    row = _read(_choice([4, 5, 6, 9], "length", None, _labelled(4)))
    assert (row.tokens, row.truncated) == ([4, 5, 6, 9], True)


def test_an_aborted_row_is_not_a_row():
    with pytest.raises(RowAborted):
        _read(_choice([4, 5], "abort", None, _labelled(2)))


def test_a_length_short_of_the_limit_names_the_server_length():
    with pytest.raises(ServerError, match="--max-model-len"):
        _read(_choice([4, 5], "length", None, _labelled(2)))


@pytest.mark.parametrize(
    ("tokens", "finish", "stop"),
    [
        ([4, 5, 6], "repetition", "repetition_detected"),  # vLLM's repetition detection
        ([4, 5], "error", None),
        ([4, 5, 2], "stop", None),  # the server's own EOS, not one the run asked for
        ([4, 5, 6], "stop", 6),  # a stop id the run did not send
        ([4, 5, 6], "stop", 258),  # reported at 258, but the last token is another
        ([4, 5], None, None),
    ],
)
def test_any_other_end_stops_the_run_naming_the_server_and_reason(tokens, finish, stop):
    with pytest.raises(ServerError) as err:
        _read(_choice(tokens, finish, stop, _labelled(len(tokens))))
    message = str(err.value)
    assert URL in message and f"finish_reason={finish!r}" in message
    assert f"stop_reason={stop!r}" in message and "[258, 7]" in message


def test_tokens_of_the_weights_pushed_last_pass():
    spans = [{"version": "abc-2", "start": 0, "end": 3}, {"version": "abc-2", "start": 3, "end": 4}]
    assert _read(_choice([4, 5, 6, 258], "stop", 258, spans)).tokens == [4, 5, 6, 258]


def test_before_the_first_push_nothing_is_labelled():
    assert _read(_choice([4, 258], "stop", 258, None), label=None).tokens == [4, 258]


@pytest.mark.parametrize("label", ["abc-1", "intruder", "xyz-2"])
def test_tokens_of_other_weights_stop_the_run_naming_the_server(label):
    spans = [{"version": "abc-2", "start": 0, "end": 2}, {"version": label, "start": 2, "end": 4}]
    with pytest.raises(ServerError) as err:
        _read(_choice([4, 5, 6, 258], "stop", 258, spans))
    message = str(err.value)
    assert URL in message and repr(label) in message and "'abc-2'" in message


@pytest.mark.parametrize(
    "spans",
    [None, [], [{"version": "abc-2", "start": 2, "end": 4}]],  # a label set mid-request
)
def test_unlabelled_tokens_after_a_push_stop_the_run_naming_the_server(spans):
    """A server restarted at the same URL serves its start-up weights, unlabelled."""
    with pytest.raises(ServerError) as err:
        _read(_choice([4, 5, 6, 258], "stop", 258, spans))
    message = str(err.value)
    assert URL in message and "unlabelled" in message and "'abc-2'" in message


def test_start_up_weights_after_a_push_stop_the_run_naming_a_restart():
    """vLLM labels the weights a server started with "default": restarted at the same URL,
    it serves them."""
    spans = [{"version": "default", "start": 0, "end": 4}]
    with pytest.raises(ServerError) as err:
        _read(_choice([4, 5, 6, 258], "stop", 258, spans))
    message = str(err.value)
    assert URL in message and "start-up weights" in message and "'abc-2'" in message
    assert "restarted at the same URL" in message


def _probe_server(answers):
    """A stand-in for a vLLM server whose answers to the probe are ``answers`` in turn (a real
    server aborts the probe only when another client's pause lands in its few milliseconds,
    which no test can time); the URL and the requests it received."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            raw = json.dumps(answers[min(len(received), len(answers)) - 1]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", received


SEQUENCE = [3, 14, 15, 92, 11, 18]
ABORTED = {"choices": [_choice([], "abort")], "prompt_logprobs": None}
SCORED = {
    "choices": [
        {
            "token_ids": [5],
            "logprobs": {"content": [{"logprob": -1.5}]},
            "finish_reason": "length",
            "weight_versions": _labelled(1),
        }
    ],
    "prompt_logprobs": [
        None,
        *({str(t): {"logprob": -0.25 * i}} for i, t in enumerate(SEQUENCE[1:], 1)),
    ],
}


def test_a_probe_the_server_aborted_is_asked_again_and_counted():
    """Another client's pause aborts the probe (HTTP 200, no log-probabilities): the probe is
    asked again, not taken for a server of other weights."""
    from rlbatch.rollout.servers.answers import probe_server

    server, url, received = _probe_server([ABORTED, ABORTED, SCORED])
    counted = []
    try:
        fixed, token, sampled = probe_server(
            url, SEQUENCE, 4, timeout_s=10, label="abc-2", max_resubmits=2,
            on_resubmit=lambda: counted.append(1),
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert (fixed, token, sampled) == ([-1.0, -1.25], 5, -1.5)
    assert len(received) == 3 and received[0] == received[2]
    assert len(counted) == 2


def test_a_probe_aborted_more_than_max_resubmits_stops_the_run_naming_the_key():
    from rlbatch.rollout.servers.answers import probe_server

    server, url, received = _probe_server([ABORTED])
    try:
        with pytest.raises(
            ServerError, match=r"aborted the probe 2 times \(rollout.servers.max_resubmits=1\)"
        ):
            probe_server(
                url,
                SEQUENCE,
                4,
                timeout_s=10,
                label="abc-2",
                max_resubmits=1,
                on_resubmit=lambda: None,
            )
    finally:
        server.shutdown()
        server.server_close()
    assert len(received) == 2


def test_a_request_waits_for_its_answer_on_a_descriptor_past_1023():
    """A trainer may hold more than 1024 open files (checkpoints, datasets, sockets): a request
    whose connection gets a descriptor past 1023 waits for its answer like any other (it failed
    with "filedescriptor out of range in select()")."""
    import os
    import resource

    from rlbatch.rollout.servers.answers import probe_server

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    server, url, _ = _probe_server([SCORED])
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        fixed, token, sampled = probe_server(
            url, SEQUENCE, 4, timeout_s=10, label="abc-2", max_resubmits=0, on_resubmit=lambda: None,
        )  # fmt: skip
    finally:
        for fd in held:
            os.close(fd)
        server.shutdown()
        server.server_close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert (fixed, token, sampled) == ([-1.0, -1.25], 5, -1.5)
