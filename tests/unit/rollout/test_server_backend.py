"""rollout.backend=vllm_server's checks of a server's answers that need no server: every token
must carry the label of the weights this process pushed last (the end-to-end runs are in
tests/e2e/test_vllm_servers.py)."""

from __future__ import annotations

import pytest

from rlbatch.rollout.server_backend import ServerBackend, ServerError, _Servers

URL = "http://127.0.0.1:9"


def _backend(syncs: int) -> ServerBackend:
    backend = ServerBackend.__new__(ServerBackend)  # no model: only the labels matter here
    backend.servers = _Servers([URL], timeout_s=1.0, concurrency=1, nonce="abc", keep_going=False)
    backend.servers.syncs = syncs
    return backend


def test_tokens_of_the_weights_pushed_last_pass():
    spans = [{"version": "abc-2", "start": 0, "end": 3}, {"version": "abc-2", "start": 3, "end": 5}]
    _backend(2)._check_version(URL, {"weight_versions": spans})
    _backend(2)._check_version(URL, {})  # a server that does not label its tokens


@pytest.mark.parametrize("label", ["abc-1", "intruder", "xyz-2"])
def test_tokens_of_other_weights_stop_the_run_naming_the_server(label):
    spans = [{"version": "abc-2", "start": 0, "end": 2}, {"version": label, "start": 2, "end": 4}]
    with pytest.raises(ServerError) as err:
        _backend(2)._check_version(URL, {"weight_versions": spans})
    message = str(err.value)
    assert URL in message and repr(label) in message and "'abc-2'" in message


@pytest.mark.parametrize("keeps", [False, True])
def test_a_process_first_sync_drops_the_servers_cache_even_when_keeping_it(keeps):
    """rollout.servers.on_update=keep keeps the prefix cache across the run's own updates only:
    the first sync of a process (a new run, a resumed one) drops what the servers cached
    under weights another process pushed; abort drops it at every sync."""
    drops = []
    for syncs in (1, 2, 3):
        backend = _backend(syncs)
        backend.drops_cache = not keeps
        drops.append(backend._drops_cache())
    assert drops == ([True, False, False] if keeps else [True, True, True])
