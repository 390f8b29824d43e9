"""What a step reports about its multi-turn episodes: the metrics (DP-reduced) and, with
``logging.samples=true``, every sample of the step in ``<run_dir>/samples/step_NNNNN.jsonl``.

Metrics (only with env.path set): ``turns_mean`` / ``turns_max`` (assistant turns per episode),
``env_seconds`` (seconds spent in the step's reset / step calls, summed over episodes; calls run
concurrently, so this can exceed the wall time), ``observation_tokens_mean``,
``episodes_truncated`` (episodes ended by a limit: max_turns, max_total_tokens,
max_new_tokens), ``env_errors`` (episodes ended by an environment or harness error under
env.on_error=zero_reward or skip), ``env_error_groups_untrained`` (env.on_error=skip: groups
left with fewer than 2 episodes once their errored ones are left out, so that none of them
trains: advantage 0), ``observations_cut`` (observations cut to
env.max_observation_tokens) and ``env_episodes`` (episodes that reached their environment: at
least one step call, or a failed reset; an episode whose every turn was cut by
rollout.max_new_tokens never does); agent harnesses (env.harness) add ``episode_splits``
(calls that rewrote their episode's history and started a new segment: each is one more
trained sample, rlbatch.grpo.types.trained_samples) and ``episode_branches`` (calls that sampled
again from a point their episode had reached, e.g. two calls at once on one prompt: one more
trained sample each, no divergence) and ``episode_late_calls`` (calls made to an episode's
address after its harness returned or failed, while its round ran: refused, never trained).

A logged sample is one trained sample: an episode split in k segments writes k lines (its
earlier segments first, then the last, which carries the episode's calls under ``turns``), each
with ``segment`` (0-based), ``segments`` (k), ``calls`` (the indices of the episode's calls it
trains) and the episode's reward and advantage.

:func:`check_env_errors` reads them after each step: a warning when more than
env.max_error_fraction of the episodes that reached the environment failed, a stop when all of
them did, and a warning when none reached it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlbatch.env.protocol import EnvCallError
from rlbatch.grpo.types import Sample, trained_samples

_SUMS = (
    "samples", "turns", "env_seconds", "observation_tokens", "truncated", "errors", "cut",
    "reached", "splits", "branches", "late_calls", "groups_untrained",
)  # fmt: skip


EVENTS = (
    "env_seconds", "episodes_truncated", "env_errors", "observations_cut", "env_episodes",
    "episode_splits", "episode_branches", "episode_late_calls", "env_error_groups_untrained",
)  # fmt: skip
"""The metrics that count what happened while episodes ran: with grpo.num_iterations > 1 a
round's samples are trained once per iteration, and these are counted on the steps of the
first iteration only (0 on the others), so that summed over steps each episode counts once."""


def episode_metrics(samples: Sequence[Sample], dist: Any, iteration: int = 0) -> dict[str, float]:
    """The episode metrics of the step's samples over every DP rank (two collectives);
    ``iteration`` > 0 (the round's samples trained again): :data:`EVENTS` are 0."""
    local = dict.fromkeys(_SUMS, 0.0)
    turns_max = 0
    for s in samples:
        ep = s.episode or {}
        local["samples"] += 1
        local["turns"] += ep.get("num_turns", 1)
        local["env_seconds"] += ep.get("env_seconds", 0.0)
        local["observation_tokens"] += ep.get("observation_tokens", 0)
        local["truncated"] += bool(ep.get("truncated", s.truncated))
        local["errors"] += ep.get("end") == "error"
        local["cut"] += ep.get("observations_cut", 0)
        local["reached"] += bool(ep.get("reached_env", False))
        local["splits"] += ep.get("splits", 0)
        local["branches"] += ep.get("branches", 0)
        local["late_calls"] += ep.get("late_calls", 0)
        turns_max = max(turns_max, ep.get("num_turns", 1))
    local["groups_untrained"] = float(groups_untrained(samples))
    total = dict(zip(_SUMS, dist.all_reduce_sum([local[k] for k in _SUMS]), strict=True))
    n = max(total["samples"], 1.0)
    metrics = {
        "turns_mean": total["turns"] / n,
        "turns_max": float(max(dist.all_gather_object(turns_max))),
        "env_seconds": total["env_seconds"],
        "observation_tokens_mean": total["observation_tokens"] / n,
        "episodes_truncated": total["truncated"],
        "env_errors": total["errors"],
        "observations_cut": total["cut"],
        "env_episodes": total["reached"],
        "episode_splits": total["splits"],
        "episode_branches": total["branches"],
        "episode_late_calls": total["late_calls"],
        "env_error_groups_untrained": total["groups_untrained"],
    }
    if iteration > 0:
        metrics.update(dict.fromkeys(EVENTS, 0.0))
    return metrics


def groups_untrained(rows: Sequence[Sample]) -> int:
    """Groups (by group id) with an episode left out (env.on_error=skip) and fewer than 2
    left: their advantages are 0, nothing of them trains."""
    members: dict[int, list[bool]] = {}
    for s in rows:
        members.setdefault(s.group_id, []).append(s.skipped)
    return sum(any(flags) and flags.count(False) < 2 for flags in members.values())


def check_env_errors(
    metrics: dict[str, float], samples: Sequence[Sample], env: Any, step: int
) -> list[str]:
    """Warnings of one step's episode metrics (every rank gets the same: the metrics are
    reduced); raises EnvCallError when every episode that reached the environment failed (the
    step would train on reward 0 alone). ``env``: cfg.env."""
    errors, reached = metrics["env_errors"], metrics["env_episodes"]
    if reached == 0:
        return [
            f"step {step}: no episode reached the environment: every assistant turn was cut"
            " before it ended (rollout.max_new_tokens, env.max_total_tokens), so no step call"
            " was made: raise rollout.max_new_tokens, or check that the model ends its turns"
            " with EOS"
        ]
    example = next((e for s in samples if (e := (s.episode or {}).get("error"))), "")
    if errors == reached:
        raise EnvCallError(
            f"step {step}: every one of the {errors:.0f} episodes that reached the environment"
            f" failed (nothing but errored episodes to train on), e.g. {example}:"
            + (
                " fix the harness (env.harness)"
                if env.harness
                else " check the OpenEnv server (env.agent.openenv_url) and the actions it is"
                " sent (env.agent.openenv_action)"
                if env.agent.openenv_url
                else " fix the environment, or raise env.timeout_s / env.max_concurrency if its"
                " calls time out"
            )
        )
    if errors / reached > env.max_error_fraction:
        return [
            f"step {step}: {errors:.0f} of the {reached:.0f} episodes that reached the"
            f" environment failed (over env.max_error_fraction={env.max_error_fraction}) and"
            f" {'are left out' if env.on_error == 'skip' else 'score 0'}"
            f"{', e.g. ' + example if example else ''}"
        ]
    return []


def sample_record(
    s: Sample, segment: int = 0, segments: int = 1, rewarded: bool = True
) -> dict[str, Any]:
    """One line of samples/step_NNNNN.jsonl: a trained sample, segment ``segment`` of the
    ``segments`` its episode was split into (0 of 1 unless an agent episode was split);
    ``rewarded`` False (pure distillation computes no reward): reward and advantage are null."""
    ep = s.episode or {}
    record = {
        "segment": segment,
        "segments": segments,
        "prompt_index": s.prompt.index,
        "group_id": s.group_id,
        "prompt": s.prompt.text,
        "answer": s.prompt.answer,
        "prompt_ids": list(s.prompt.prompt_ids),
        "response_ids": list(s.response_ids),
        "loss_mask": list(s.loss_mask or []),
        "turns": ep.get("turns", []),
        "calls": ep.get("calls"),
        "num_turns": ep.get("num_turns", 1),
        "end": ep.get("end") or ("max_new_tokens" if s.truncated else "done"),
        "error": ep.get("error"),
        "reward": s.reward,
        "reward_parts": {
            k[len("reward/") :]: v for k, v in s.metrics.items() if k.startswith("reward/")
        },
        "env_rewards": ep.get("rewards", []),
        "reward_failures": list(getattr(s, "reward_failures", [])),
        "advantage": s.advantage,
        "skipped": s.skipped,
        "truncated": s.truncated,
        "policy_version": s.policy_version,
        "token_versions": list(s.token_versions or []),
        "behaviour_logps": list(s.behaviour_logps),
        "token_advantages": None if s.token_advantages is None else list(s.token_advantages),
        "old_logps": None if s.old_logps is None else list(s.old_logps),
        "ref_logps": None if s.ref_logps is None else list(s.ref_logps),
        "routing": None if s.routing is None else s.routing.tolist(),
        "old_routing": None if s.old_routing is None else s.old_routing.tolist(),
    }
    if not rewarded:
        record["reward"] = record["advantage"] = None
    return record


def episode_lines(row: Sample, rewarded: bool = True) -> list[str]:
    """The logged lines of one row: its episode's earlier segments (each handed the episode's
    reward and advantage), then the row itself (``rewarded``: see :func:`sample_record`)."""
    episode = [*trained_samples([row])[1:], row]
    return [
        json.dumps(sample_record(s, k, len(episode), rewarded)) + "\n"
        for k, s in enumerate(episode)
    ]


def make_sample_writer(
    run_dir: str,
    gather: Callable[[list[Sample]], list[list[Sample]]],
    rank: int,
    rewarded: bool = True,
):
    """write(step, samples): every DP rank's samples of the step, written by rank 0
    (``rewarded`` False under pure distillation: reward and advantage written as null)."""
    folder = Path(run_dir) / "samples"

    def write(step: int, samples: list[Sample]) -> None:
        shares = gather([s for s in samples])
        if rank != 0:
            return
        folder.mkdir(parents=True, exist_ok=True)
        lines = [line for share in shares for row in share for line in episode_lines(row, rewarded)]
        tmp = folder / f".step_{step:05d}.jsonl.tmp"
        tmp.write_text("".join(lines))
        tmp.replace(folder / f"step_{step:05d}.jsonl")

    return write
