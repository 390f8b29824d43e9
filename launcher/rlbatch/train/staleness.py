"""Per-step staleness and rollout figures, from sums that add up over DP ranks (one collective).

- ``staleness_token_mean``: mean over the step's sampled tokens of (policy version at the round's
  first step - the version that sampled the token);
- ``length_staleness_corr``: Pearson correlation, over the step's samples, between a sample's
  response length and its staleness (round start version - its oldest token's version). Rows
  continued across weight updates are the long ones, so with partial rollouts it is positive;
  0.0 when either has no spread (e.g. synchronous training);
- ``rollout/slot_occupancy``: busy decode slot-steps / (decode steps x slots) of the round
  (rlbatch.rollout.engines.builtin.DecodeStats), over every rank;
- partial rollouts: ``rollout/carried_rows`` (rows still decoding when the round was delivered),
  ``rollout/waiting_groups`` (finished groups left for later rounds) and
  ``rollout/untrained_fraction`` (rows started and neither trained nor still in the stream, over
  the rows started: 0 by design, nothing is discarded);
- rollout servers: ``rollout/servers_alive`` (each replica's pool, averaged),
  ``rollout/server_resubmits`` (rows a server aborted and the run sent again, summed),
  ``rollout/server_restarts`` (servers taken back after a restart, on_failure=restart, summed)
  and
  ``rollout/kv_cache_age`` (how many policy versions older than the last sync's the KV in the
  servers' prefix cache may be, averaged: 0 with rollout.servers.on_update=abort; with keep,
  a token sampled after that sync may rest on KV this many versions older than the version
  recorded for it, which stays below grpo.max_staleness);
- ``rollout/weight_sync_s``: mean seconds one engine took to take the policy's weights, over
  the syncs of the round's generation on every rank (rollout.backend=vllm).
"""

from __future__ import annotations

import math
from typing import Any

from rlbatch.grpo.types import trained_samples
from rlbatch.train.producer import oldest_version

ROLLOUT_COUNTERS = (
    "rollout/busy_slot_steps",
    "rollout/slot_steps",
    "rollout/carried_rows",
    "rollout/waiting_groups",
    "rollout/started_rows",
    "rollout/untrained_rows",
    "rollout/weight_sync_seconds",
    "rollout/weight_syncs",
    "rollout/servers_alive",
    "rollout/server_pools",
    "rollout/server_resubmits",
    "rollout/server_restarts",
    "rollout/kv_cache_age",
    "rollout/round_busy_slot_steps",
    "rollout/round_slot_steps",
)
"""A round's rank-local counters (GeneratedRound.filter_metrics), summed over ranks; the two
``round_*`` ones are the round's own slot counts, which every step of the round reports for its
occupancy (:func:`step_figures`)."""

ROUND_EVENTS = (
    "rollout/busy_slot_steps",
    "rollout/slot_steps",
    "rollout/server_resubmits",
    "rollout/server_restarts",
    "generation_rounds",
    "prompts_drawn",
    "groups_filtered",
    "groups_unused",
)
"""The counters of things that happened once while a round was generated (the rollout's, and
dynamic sampling's draws): a step reports them on its round's first step only
(:func:`step_figures`), so summed over steps each counts once; the round's ratios and gauges
(slot occupancy, weight_sync_s, servers_alive, kv_cache_age, ...) on every step of it."""


def step_figures(batch: Any, ahead: dict[str, float] | None = None) -> dict[str, float]:
    """The round's figures as step ``batch.step`` reports them: its :data:`ROUND_EVENTS` on the
    round's first step, 0 on the round's later steps (a round trained over several steps,
    grpo.steps_per_generation or num_iterations > 1, counts each event once), plus ``ahead``:
    the events of rounds generated for steps past trainer.max_steps, which the run's last step
    reports (RunAheadProducer.take_ahead_events)."""
    figures = dict(batch.filter_metrics)
    if "rollout/slot_steps" in figures:  # the round's occupancy, on every step of it
        figures["rollout/round_busy_slot_steps"] = figures["rollout/busy_slot_steps"]
        figures["rollout/round_slot_steps"] = figures["rollout/slot_steps"]
    if not batch.new_round:
        figures.update({k: 0.0 for k in ROUND_EVENTS if k in figures})
    for key, value in (ahead or {}).items():
        figures[key] = figures.get(key, 0.0) + value
    return figures


def staleness_sums(batch: Any) -> list[float]:
    """[n, sum x, sum y, sum xy, sum x^2, sum y^2, token staleness sum, tokens] of the step's
    samples on this rank (x = response length, y = sample staleness)."""
    out = [0.0] * 8
    start = batch.round_start_version
    for s in trained_samples(batch.samples):  # a split episode's segments each count
        x = float(len(s.response_ids))
        y = float(start - oldest_version(s))
        for i, v in enumerate((1.0, x, y, x * y, x * x, y * y)):
            out[i] += v
        versions = s.token_versions or [s.policy_version] * len(s.response_ids)
        mask = s.loss_mask or [1] * len(versions)
        out[6] += sum(start - v for v, m in zip(versions, mask, strict=True) if m)
        out[7] += sum(mask)
    return out


def staleness_metrics(sums: list[float]) -> dict[str, float]:
    n, sx, sy, sxy, sxx, syy, token_sum, tokens = sums
    corr = 0.0
    if n > 1:
        cov = sxy - sx * sy / n
        var_x, var_y = sxx - sx * sx / n, syy - sy * sy / n
        if var_x > 1e-12 and var_y > 1e-12:
            corr = cov / math.sqrt(var_x * var_y)
    return {
        "staleness_token_mean": token_sum / tokens if tokens else 0.0,
        "length_staleness_corr": corr,
    }


def rollout_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The step's rollout figures from the rank-summed ``rollout/*`` counters its round reported
    (a key is absent when the round's engine does not count it; present and 0 when it counted
    nothing). A round that decoded nothing (partial rollouts served wholly by groups finished in
    earlier rounds) left no slot idle: occupancy 1.0 with ``rollout/slot_steps`` = 0, so the
    run's occupancy is sum(busy_slot_steps) / sum(slot_steps) over the steps."""
    out: dict[str, float] = {}
    if "rollout/slot_steps" in sums:
        busy, slots = sums["rollout/busy_slot_steps"], sums["rollout/slot_steps"]
        # the step's round's own counts (every step of a round reports its occupancy, not the
        # 1.0 of a step whose counts went to the round's first step)
        r_busy = sums.get("rollout/round_busy_slot_steps", busy)
        r_slots = sums.get("rollout/round_slot_steps", slots)
        out["rollout/slot_occupancy"] = r_busy / r_slots if r_slots else 1.0
        out["rollout/slot_steps"] = slots
        out["rollout/busy_slot_steps"] = busy
    if sums.get("rollout/weight_syncs"):  # engines with their own weights (vLLM)
        out["rollout/weight_sync_s"] = (
            sums["rollout/weight_sync_seconds"] / sums["rollout/weight_syncs"]
        )
    if sums.get("rollout/server_pools"):  # rollout servers: each replica's pool, averaged
        out["rollout/servers_alive"] = sums["rollout/servers_alive"] / sums["rollout/server_pools"]
        out["rollout/server_resubmits"] = sums.get("rollout/server_resubmits", 0.0)
        out["rollout/server_restarts"] = sums.get("rollout/server_restarts", 0.0)
        out["rollout/kv_cache_age"] = (
            sums.get("rollout/kv_cache_age", 0.0) / sums["rollout/server_pools"]
        )
    if "rollout/started_rows" in sums:  # partial rollouts
        out["rollout/carried_rows"] = sums["rollout/carried_rows"]
        out["rollout/waiting_groups"] = sums["rollout/waiting_groups"]
        started = sums["rollout/started_rows"]
        out["rollout/untrained_fraction"] = (
            sums["rollout/untrained_rows"] / started if started else 0.0
        )
    return out
