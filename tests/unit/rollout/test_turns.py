"""SharedTurns: in a model-parallel group only the first rank steps the environment; the other
ranks get its answers, its episode records and its errors. The leader's side is a real
EnvDriver over the built-in guess-the-number game; the follower's broadcast hands it what the
leader sent, in order (the real broadcast runs in tests/e2e/test_vllm_cli.py at tp 2 x pp 2)."""

from __future__ import annotations

import pytest

from rlbatch.config.schema import RunConfig
from rlbatch.engine.tokenizer import ByteTokenizer
from rlbatch.env.driver import EnvDriver
from rlbatch.env.guess_number import GuessNumber
from rlbatch.env.protocol import EnvCallError
from rlbatch.grpo.types import Prompt
from rlbatch.rollout.turns import SharedTurns


class Failing(GuessNumber):
    def step(self, state, text):
        raise ValueError("tool down")


def group(env):
    """(leader, follower) of a two-rank group; the follower receives the leader's broadcasts."""
    cfg = RunConfig()
    cfg.env.path = "rlbatch.env.guess_number:GuessNumber"
    sent: list = []

    def broadcast(outcome):
        sent.append(outcome)
        return outcome

    leader = SharedTurns(EnvDriver(env, cfg, ByteTokenizer()), broadcast)
    follower = SharedTurns(None, lambda _: sent.pop(0))
    return leader, follower


def turn(text: str) -> list[int]:
    tok = ByteTokenizer()
    return [*tok.encode(text), tok.eos_id]


def test_followers_see_the_leaders_turns_and_records():
    leader, follower = group(GuessNumber())
    prompts = [Prompt(index=i, prompt_ids=(5, 6), answer=str(a)) for i, a in enumerate((3, 7))]
    for ranks in (leader, follower):
        ranks.begin(prompts)
    leader.submit(0, turn("5"))
    leader.submit(1, turn("7"))
    follower.submit(0, turn("5"))  # the follower's calls reach no environment
    answers = leader.collect()
    assert follower.collect() == answers
    tok = ByteTokenizer()
    assert "lower" in tok.decode(answers[0])  # 5 is above the secret 3
    assert answers[1] is None  # 7 was the secret: the episode is over
    leader.end(0, "max_new_tokens", turn("x")[:-1])
    records = leader.records()
    assert follower.records() == records
    assert [r["end"] for r in records] == ["max_new_tokens", "done"]


def test_an_environment_error_is_raised_on_every_rank():
    leader, follower = group(Failing())
    prompts = [Prompt(index=0, prompt_ids=(5,), answer="3")]
    leader.begin(prompts)
    follower.begin(prompts)
    leader.submit(0, turn("4"))
    with pytest.raises(EnvCallError, match="Failing.step on sample 0.*tool down"):
        leader.collect()
    with pytest.raises(EnvCallError, match="tool down"):
        follower.collect()


class PooledBackend:
    """A rollout-server backend's routing without the servers: every row goes to the server
    the real ServerPool picks for its episode (rlbatch.rollout.servers.backend._balanced), and
    answers a wrong guess ("5" and EOS) from that server; released episodes are unpinned."""

    def __init__(self, urls):
        from rlbatch.rollout.servers.pool import ServerPool

        self.pool = ServerPool(urls, 5.0, 2, "n", False)
        self.released: list[str] = []

    def decode(self, prompt_ids, seeds, sampling, max_tokens=None, episodes=None):
        from rlbatch.rollout.protocol import DecodedRow

        rows = []
        for key in episodes or [None] * len(prompt_ids):
            url = self.pool.least_loaded(key)
            rows.append(DecodedRow(turn("5"), [-1.0, -1.0], False, server=url))
        for row in rows:  # the requests of a turn are in flight together, as in the thread pool
            self.pool.done(row.server)
        return rows

    def release(self, episodes):
        self.released += episodes
        self.pool.unpin(episodes)


def test_on_rollout_servers_an_episode_s_turns_stay_on_one_server():
    """env.path on vLLM servers: each episode's turns go to the server of its first turn (its
    prefix cache holds the conversation), new episodes spread over the servers, each assistant
    turn's record names its server, and the episodes are released when the round ends."""
    from rlbatch.rollout.protocol import TokenSampling
    from rlbatch.rollout.turns import TurnSamples

    cfg = RunConfig()
    cfg.env.path = "rlbatch.env.guess_number:GuessNumber"
    cfg.env.max_turns = 3
    tok = ByteTokenizer()
    backend = PooledBackend(["http://a", "http://b"])
    rows = [(i, Prompt(index=i, prompt_ids=(5, 6), answer="3")) for i in range(4)]
    sampling = TokenSampling(max_new_tokens=4, temperature=1.0, eos_id=tok.eos_id)
    run = TurnSamples(EnvDriver(GuessNumber(), cfg, tok), max_total_tokens=200)
    samples = run(backend, sampling, rows, [11, 12, 13, 14], 0)
    firsts = []
    for s in samples:
        said = [t for t in s.episode["turns"] if t["role"] == "assistant"]
        assert len(said) == 3  # three wrong guesses: env.max_turns ends it
        assert len({t["server"] for t in said}) == 1, said
        firsts.append(said[0]["server"])
    assert sorted(firsts) == ["http://a", "http://a", "http://b", "http://b"]
    assert len(backend.released) == 4 and backend.pool.pinned == {}
