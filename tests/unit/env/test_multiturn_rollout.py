"""Multi-turn rollouts on a real megatron-core GPTModel (tiny Qwen2 shape) through the
built-in engine's continuous batching: a row that waits on its environment leaves the decode
batch and re-enters with its observation (prefill of the new tokens only, its KV cache kept).

The reference for every sampled token is a full causal forward over the whole transcript
(prompt, assistant turns, observations) in float64: the behaviour logprob the rollout recorded
must be the reference's log-softmax at that position, whatever the batch did meanwhile."""

from __future__ import annotations

import pytest
import torch

from model_reference import full_logps
from rlbatch.config.schema import RunConfig
from rlbatch.engine.tokenizer import ByteTokenizer
from rlbatch.env.driver import EnvDriver
from rlbatch.env.protocol import EnvCallError
from rlbatch.grpo.types import Prompt
from rlbatch.rollout.engines.builtin import MegatronRolloutEngine, SamplingParams

TOK = ByteTokenizer()


EOS = ByteTokenizer.EOS


@pytest.fixture(scope="module")
def model():
    """The tiny policy (init std 0.3: peaked logits), with EOS's embedding moved towards the
    mean final hidden state so that turns end after a few tokens (a random model almost never
    samples EOS)."""
    from rlbatch.bench.rollout_env import turn_ending_policy

    cfg = RunConfig()
    cfg.model.init_method_std = 0.3
    return turn_ending_policy(cfg)


class Scripted:
    """Answers turn k of an episode with 'obs<k>' until `turns` steps, then done with reward 1;
    every step pays 0.25."""

    def __init__(self, turns: int = 3, fail_on: str = "") -> None:
        self.turns, self.fail_on = turns, fail_on

    def reset(self, row):
        if self.fail_on == "reset":
            raise KeyError("no such row")
        return {"k": 0, "answer": row["answer"]}

    def step(self, state, text):
        state["k"] += 1
        if self.fail_on == "step" and state["k"] == 2:
            raise ZeroDivisionError("division by zero")
        if self.fail_on == "type":
            return 3
        if state["k"] >= self.turns:
            return {"observation": None, "done": True, "reward": 1.0}
        return {"observation": f"obs{state['k']}", "done": False, "reward": 0.25}


def _prompts():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3, 7]
    return [
        Prompt(index=i, prompt_ids=tuple(torch.randint(0, 256, (n,), generator=g).tolist()),
               answer=str(i), raw=f"p{i}")
        for i, n in enumerate(lengths)
    ]  # fmt: skip


def _engine(model, eos, *, slots=None, max_total=80, max_new=12, env=None, **env_cfg):
    cfg = RunConfig()
    cfg.env.path = "x.py:Scripted"
    cfg.env.max_total_tokens = max_total
    for k, v in env_cfg.items():
        setattr(cfg.env, k, v)
    driver = EnvDriver(env or Scripted(), cfg, TOK)
    params = SamplingParams(max_new, eos_id=eos)
    return MegatronRolloutEngine(
        model, params, chunk_size=slots, driver=driver, max_total_tokens=max_total
    )


def test_trajectories_are_token_exact_and_masked(model):
    prompts = _prompts()
    eos = EOS
    engine = _engine(model, eos, slots=1, max_turns=5)  # 2 slots for 8 rows: rows queue
    samples = engine.generate(prompts, 2, 7, seed=11)
    assert len(samples) == 8
    multi = 0
    for s in samples:
        ep = s.episode
        assert len(s.loss_mask) == len(s.response_ids) == len(s.behaviour_logps)
        # rebuild the transcript from the episode's turns: assistant tokens as sampled, the
        # observation text encoded by the tokenizer, mask 0 exactly there
        pos = 0
        for turn in ep["turns"]:
            n = turn["tokens"]
            mask = s.loss_mask[pos : pos + n]
            if turn["role"] == "observation":
                assert s.response_ids[pos : pos + n] == TOK.encode(turn["text"])
                assert mask == [0] * n and s.behaviour_logps[pos : pos + n] == [0.0] * n
            else:
                assert mask == [1] * n
                ids = s.response_ids[pos : pos + n]
                assert TOK.decode(ids[:-1] if ids[-1] == eos else ids) == turn["text"]
            pos += n
        assert pos == len(s.response_ids)
        # every sampled token's logprob is the full forward's over the whole transcript
        ref = full_logps(model, s.input_ids)
        p = len(s.prompt.prompt_ids)
        for j, (tok, m) in enumerate(zip(s.response_ids, s.loss_mask, strict=True)):
            if m:
                assert s.behaviour_logps[j] == pytest.approx(ref[p + j - 1, tok].item(), abs=2e-4)
        if ep["end"] == "done":
            assert ep["num_turns"] == 3 and ep["rewards"] == [0.25, 0.25, 1.0]
            assert not s.truncated
            multi += 1
        else:
            assert s.truncated and ep["end"] in ("max_new_tokens", "max_total_tokens")
    assert multi >= 2, "too few episodes reached their last turn to test re-entry"
    stats = engine.slot_stats
    assert stats.waiting_steps > 0 and 0 <= stats.busy_fraction_while_waiting <= 1


def test_same_seed_same_trajectories_whatever_the_slots(model):
    prompts = _prompts()
    eos = EOS
    runs = [_engine(model, eos, slots=k).generate(prompts, 2, 0, seed=5) for k in (1, 2, None)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert a.response_ids == b.response_ids and a.loss_mask == b.loss_mask
            # fp32: the batch size changes the reductions (~1e-5 on a logprob); the tokens are identical
            assert a.behaviour_logps == pytest.approx(b.behaviour_logps, abs=1e-4)


def test_limits_end_episodes_as_truncated(model):
    prompts = _prompts()
    eos = EOS
    out = _engine(model, eos, max_turns=1).generate(prompts, 2, 0, seed=2)
    stepped = [s for s in out if s.episode["rewards"]]  # its one turn ended with EOS
    assert stepped and all(s.episode["num_turns"] == 1 for s in out)
    for s in stepped:  # the step answered with an observation at the last allowed turn
        assert s.episode["end"] == "max_turns" and s.truncated and s.loss_mask[-1] == 1
    cut = _engine(model, eos, max_observation_tokens=2).generate(prompts, 2, 0, seed=2)
    assert sum(s.episode["observations_cut"] for s in cut) > 0
    for s in cut:
        obs = [t for t in s.episode["turns"] if t["role"] == "observation"]
        assert all(t["tokens"] <= 2 for t in obs)
        assert s.episode["observations_cut"] == len(obs)
    short = _engine(model, eos, max_total=14).generate(prompts, 2, 0, seed=2)
    assert any(s.episode["end"] == "max_total_tokens" for s in short)
    for s in short:
        assert s.length <= 14
        if s.episode["end"] == "max_total_tokens":
            assert s.truncated


def test_environment_errors_name_class_sample_and_turn(model):
    prompts = _prompts()
    eos = EOS
    with pytest.raises(
        EnvCallError,
        match=r"environment Scripted\.reset on sample 0 \(prompt index 0\) raised KeyError",
    ):
        _engine(model, eos, env=Scripted(fail_on="reset")).generate(prompts, 1, 0, seed=2)
    with pytest.raises(
        EnvCallError,
        match=r"Scripted\.step on sample \d+ \(prompt index \d\), turn 2 raised ZeroDivisionError",
    ):
        _engine(model, eos, env=Scripted(fail_on="step")).generate(prompts, 1, 0, seed=2)
    with pytest.raises(EnvCallError, match=r"returned int 3: step must return a dict"):
        _engine(model, eos, env=Scripted(fail_on="type")).generate(prompts, 1, 0, seed=2)
    for on_error in ("zero_reward", "skip"):  # the episode ends; training decides the rest
        out = _engine(model, eos, env=Scripted(fail_on="step"), on_error=on_error).generate(
            prompts, 1, 0, seed=2
        )
        ended = [s.episode for s in out if s.episode["end"] == "error"]
        assert ended and all("ZeroDivisionError" in e["error"] for e in ended)


class Slow:
    """Sync or async steps that take 0.5 s."""

    def reset(self, row):
        return None

    def step(self, state, text):
        import time

        time.sleep(0.5)
        return {"observation": None, "done": True}


class SlowAsync(Slow):
    async def step(self, state, text):
        import asyncio

        await asyncio.sleep(0.5)
        return {"observation": None, "done": True}


@pytest.mark.parametrize("env", [Slow(), SlowAsync()], ids=["sync", "async"])
def test_a_step_longer_than_the_timeout_is_an_error(model, env):
    prompts = _prompts()
    with pytest.raises(EnvCallError, match=r"took longer than env.timeout_s=0.1"):
        _engine(model, EOS, env=env, timeout_s=0.1).generate(prompts, 1, 0, seed=2)
    out = _engine(model, EOS, env=env, timeout_s=0.1, on_error="zero_reward").generate(
        prompts, 1, 0, seed=2
    )
    assert any(s.episode["end"] == "error" for s in out)
    done = _engine(model, EOS, env=env, timeout_s=5.0).generate(prompts, 1, 0, seed=2)
    assert all(s.episode["end"] in ("done", "max_new_tokens") for s in done)
