"""What a step reports about its multi-turn episodes: the metrics (DP-reduced) and, with
``logging.samples=true``, every sample of the step in ``<run_dir>/samples/step_NNNNN.jsonl``.

Metrics (only with env.path set): ``turns_mean`` / ``turns_max`` (assistant turns per episode),
``env_seconds`` (seconds spent in the step's reset / step calls, summed over episodes; calls run
concurrently, so this can exceed the wall time), ``observation_tokens_mean``,
``episodes_truncated`` (episodes ended by a limit: max_turns, max_total_tokens,
max_new_tokens), ``env_errors`` (episodes ended by an environment error under
env.on_error=zero_reward) and ``observations_cut`` (observations cut to
env.max_observation_tokens).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlbatch.grpo.types import Sample

_SUMS = ("samples", "turns", "env_seconds", "observation_tokens", "truncated", "errors", "cut")


def episode_metrics(samples: Sequence[Sample], dist: Any) -> dict[str, float]:
    """The episode metrics of the step's samples over every DP rank (two collectives)."""
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
        turns_max = max(turns_max, ep.get("num_turns", 1))
    total = dict(zip(_SUMS, dist.all_reduce_sum([local[k] for k in _SUMS]), strict=True))
    n = max(total["samples"], 1.0)
    return {
        "turns_mean": total["turns"] / n,
        "turns_max": float(max(dist.all_gather_object(turns_max))),
        "env_seconds": total["env_seconds"],
        "observation_tokens_mean": total["observation_tokens"] / n,
        "episodes_truncated": total["truncated"],
        "env_errors": total["errors"],
        "observations_cut": total["cut"],
    }


def sample_record(s: Sample) -> dict[str, Any]:
    """One line of samples/step_NNNNN.jsonl."""
    ep = s.episode or {}
    return {
        "prompt_index": s.prompt.index,
        "group_id": s.group_id,
        "prompt": s.prompt.text,
        "answer": s.prompt.answer,
        "prompt_ids": list(s.prompt.prompt_ids),
        "response_ids": list(s.response_ids),
        "loss_mask": list(s.loss_mask or []),
        "turns": ep.get("turns", []),
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
        "truncated": s.truncated,
        "policy_version": s.policy_version,
        "token_versions": list(s.token_versions or []),
        "behaviour_logps": list(s.behaviour_logps),
    }


def make_sample_writer(
    run_dir: str, gather: Callable[[list[Sample]], list[list[Sample]]], rank: int
):
    """write(step, samples): every DP rank's samples of the step, written by rank 0."""
    folder = Path(run_dir) / "samples"

    def write(step: int, samples: list[Sample]) -> None:
        shares = gather([s for s in samples])
        if rank != 0:
            return
        folder.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(sample_record(s)) + "\n" for share in shares for s in share]
        tmp = folder / f".step_{step:05d}.jsonl.tmp"
        tmp.write_text("".join(lines))
        tmp.replace(folder / f"step_{step:05d}.jsonl")

    return write
