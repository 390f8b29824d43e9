"""Which vLLM server a request goes to (rlbatch.rollout.servers.pool.ServerPool.least_loaded):
an agent episode's calls stay on the server of its first call (its prefix cache holds the
conversation), new episodes go to the server with the fewest episodes, requests of no episode
to the one with the fewest requests outstanding, and a server that left the pool gives its
episodes to the others."""

from rlbatch.rollout.servers.client import ServerDownError
from rlbatch.rollout.servers.pool import ServerPool

A, B, C = "http://a", "http://b", "http://c"


def _servers(keep_going=False):
    return ServerPool([A, B, C], 5.0, 2, "n", keep_going)


def test_new_episodes_spread_and_calls_stay_on_their_episodes_server():
    s = _servers()
    first = [s.least_loaded(f"ep{i}") for i in range(6)]
    assert first == [A, B, C, A, B, C]  # fewest episodes first, the pool's order on ties
    for url in first:
        s.done(url)
    # later calls: each on its episode's server, whatever the load says
    for _ in range(3):
        s.done(s.least_loaded("ep1"))
    held = s.least_loaded("ep1")
    assert held == B and s.outstanding == {A: 0, B: 1, C: 0}
    assert [s.least_loaded(f"ep{i}") for i in (0, 2, 5)] == [A, C, C]


def test_a_new_episode_goes_where_fewest_episodes_are_pinned_then_fewest_requests():
    s = _servers()
    assert s.least_loaded("x") == A  # one episode, one request outstanding
    busy = s.least_loaded(None)  # a request of no episode: one of the fewest outstanding
    assert busy in (B, C)
    (idle,) = {B, C} - {busy}
    assert s.outstanding == {A: 1, busy: 1, idle: 0}
    assert s.least_loaded("y") == idle  # B and C hold no episode; the idle one has fewer requests
    assert s.least_loaded("z") == busy


def test_requests_of_no_episode_break_ties_at_random():
    """routing=least_loaded: a turn's calls are sent in the same order every turn; a fixed tie
    order would deal each call the server its episode's last call had, every turn."""
    import random

    firsts = set()
    for seed in range(40):
        s = _servers()
        s.ties = random.Random(seed)
        first = s.least_loaded(None)
        assert s.least_loaded(None) != first  # never onto a busier server
        firsts.add(first)
    assert firsts == {A, B, C}


def test_released_episodes_free_their_server_and_a_dropped_server_gives_its_episodes_up():
    s = _servers(keep_going=True)
    urls = [s.least_loaded(k) for k in ("e0", "e1", "e2")]
    for url in urls:
        s.done(url)
    s.unpin(["e0"])
    assert s.least_loaded("e3") == A  # A holds no episode any more
    s.done(A)
    s.drop(B, ServerDownError("gone"))
    moved = s.least_loaded("e1")  # its server left the pool: the least loaded of the rest
    assert moved == A and s.pinned["e1"] == A  # A and C hold one episode each, none waiting
