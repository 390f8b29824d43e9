"""Resume compatibility, checked in the driver before launch (docs/resume.md).

The checkpoint's meta.json holds the resolved config of the run that wrote it. A resume
compares the new config with it, key by key:

- keys in :data:`FIXED` may not change: the model's shape, the tokenizer, the batch and group
  sizes, the seed, the data and the distillation teacher and coefficients define what the checkpoint's weights, optimizer moments and
  sampler cursor mean. Each change is one error (key, old value, new value), all at once;
- keys in :data:`RUN_AHEAD` may not change either: the checkpoint holds rounds generated ahead
  of training (and with partial rollouts, rows still decoding), laid out for exactly that
  run-ahead; with partial rollouts the keys in :data:`STREAM` shape that stream too;
- every other key may change and takes effect from the next step (the learning rate and its
  schedule, max_steps, checkpoint cadence, timeouts, logging, the parallel layout through
  resharding...); the driver lists what changed.

Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlbatch.config.errors import ConfigError
from rlbatch.config.load import PATH_KEYS, same_path, to_container
from rlbatch.config.schema import RunConfig
from rlbatch.layout import SIZES

FIXED = (
    "model.",
    "data.",
    "trainer.seed",
    "grpo.num_generations",
    "grpo.global_batch_size",
    "grpo.generation_batch_size",
    "grpo.steps_per_generation",
    "grpo.num_iterations",
    "grpo.distill.",
    "grpo.routing_replay",
)
"""Keys (or prefixes ending in '.') a resume may not change. grpo.routing_replay: the pending samples carry the routing the run's mode recorded
(r2: the old-logprob pass's, taken at a round's first step), and a round continued under
another mode would train its remaining steps on routing no pass recorded. grpo.distill: the pending samples of the checkpoint carry the teacher's advantages,
and the objective is the run's."""
CHANGEABLE = (
    "model.hf_path",
    "model.recompute",
    "data.reward_timeout_s",
    "data.reward_abs_max",
    "grpo.distill.teacher_timeout_s",
    "grpo.distill.teacher_max_concurrency",
    "grpo.distill.teacher_tokenizer",
)
"""Exceptions under FIXED prefixes: where the weights come from (the checkpoint's win), how
activations are recomputed, the bounds on reward calls and served-teacher requests, and the
local copy of a served teacher's tokenizer (read for checks only). The teacher's path or URL
may also change when the checkpoint's recorded teacher identity matches (rlbatch.cli.train,
rlbatch.grpo.teacher_identity)."""
RUN_AHEAD = ("grpo.num_steps_async", "grpo.partial_rollouts")
"""How far generation runs ahead and whether rows continue across rounds: the queued rounds and
the partial-rollout stream saved in the checkpoint are shaped by them."""
STREAM = (
    "grpo.max_staleness",
    "grpo.consumption_granularity",
    "grpo.aggregation.rollout_micro_batch_size",
    "rollout.micro_batch_size",
)
"""With grpo.partial_rollouts: how many rounds a row may start ahead and wait, and how many rows
decode at once, which the saved stream's rows and slots depend on."""
IGNORED = ("run_dir", "trainer.resume", "parallel.run_id", "parallel.node_rank")
"""Keys that differ between any two launches."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def is_fixed(key: str) -> bool:
    if key in CHANGEABLE:
        return False
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FIXED)


def fixed_keys(saved: dict[str, Any]) -> set[str]:
    """The keys of :data:`RUN_AHEAD` and (a run with partial rollouts) :data:`STREAM`."""
    partial = flatten(saved).get("grpo.partial_rollouts") is True
    return set(RUN_AHEAD) | (set(STREAM) if partial else set())


def compare(saved: dict[str, Any], new: dict[str, Any]) -> tuple[list[tuple], list[tuple]]:
    """(refused, allowed) changes, each (key, old, new), sorted by key."""
    old_flat, new_flat = flatten(saved), flatten(new)
    also_fixed = fixed_keys(saved)
    refused: list[tuple] = []
    allowed: list[tuple] = []
    for key in sorted(set(old_flat) | set(new_flat)):
        if key in IGNORED or key not in old_flat or key not in new_flat:
            continue  # a key added or removed by another rlbatch version: nothing to compare
        old, value = old_flat[key], new_flat[key]
        if old != value and not (key in PATH_KEYS and same_path(old, value)):
            fixed = is_fixed(key) or key in also_fixed
            (refused if fixed else allowed).append((key, old, value))
    return refused, allowed


def _meta(checkpoint: Path) -> dict[str, Any]:
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def check_resume(cfg: RunConfig, checkpoint: Path) -> tuple[list[ConfigError], list[str]]:
    """(errors for each fixed key that changed, and for a new parallel layout when the
    checkpoint holds per-rank work in flight; notes on the changes that take effect)."""
    meta = _meta(checkpoint)  # read once: the config and the work in flight
    saved = meta.get("config")
    if not isinstance(saved, dict):
        return [], []
    refused, allowed = compare(saved, to_container(cfg))
    errors = _layout_errors(cfg, checkpoint, meta) + [
        ConfigError(
            key,
            new,
            f"was {_as_override(old)} in {checkpoint}: it cannot change on resume (the "
            "checkpoint's weights, optimizer state, data position or rounds generated ahead "
            f"depend on it). Resume with {key}={_as_override(old)}, "
            "or start a new run (another directory, trainer.resume=none)",
        )
        for key, old, new in refused
    ]
    notes = [f"{key}: {old!r} -> {new!r}" for key, old, new in allowed]
    return errors, notes


def _layout_errors(cfg: RunConfig, checkpoint: Path, meta: dict[str, Any]) -> list[ConfigError]:
    """A checkpoint whose ranks held work of their data-parallel sharding (a round half
    trained, rounds generated ahead: meta.json's ``in_flight``, rlbatch.train.checkpoint.
    work_in_flight) resumes at its own parallel layout only: one error per size that changed."""
    saved, busy = meta.get("parallel"), meta.get("in_flight")
    if not isinstance(saved, dict) or not busy:
        return []
    return [
        ConfigError(
            f"parallel.{name}",
            getattr(cfg.parallel, name),
            f"was {saved[name]} in {checkpoint}, which holds per-rank work in flight "
            f"({', '.join(busy)}): it resumes at its own parallel layout only. Resume with "
            f"parallel.{name}={saved[name]}, or from a checkpoint saved where none is pending "
            "(the last step of a generation round, grpo.num_steps_async=0)",
        )
        for name in SIZES
        if name in saved and saved[name] != getattr(cfg.parallel, name)
    ]


def _as_override(value: Any) -> str:
    """``value`` as a KEY=VALUE override writes it (true, null, 0.001, a string unquoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)
