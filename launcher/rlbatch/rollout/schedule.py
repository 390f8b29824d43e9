"""Prompt sampling and the generation schedule of the GRPO loop (docs/training_loop.md).

Pure Python + numpy: no torch, no torch.distributed. Every rank builds the same objects from the
same config; only ``dp_rank`` differs, so no communication is needed to agree on the data.

Vocabulary (docs/training_loop.md):

- *round*: one generation. A round draws ``prompts_per_round`` prompts from the global stream,
  each DP rank generates ``num_generations`` completions for its own contiguous block of them,
  and the resulting buffer serves ``steps_per_round = steps_per_generation * num_iterations``
  optimizer steps.
- *global stream*: the concatenation of per-epoch permutations of the dataset. Epoch ``e``'s
  permutation is a pure function of ``(seed, e)`` and covers the WHOLE dataset (a global
  shuffle, not a shuffle inside a rank's shard, which would keep each rank on its own slice forever). Rounds cut the stream into
  consecutive blocks; a round may straddle an epoch boundary. Nothing is dropped or repeated:
  each prompt appears exactly once per epoch, over all ranks together.
- *DP sharding*: a round's block is split into ``dp`` equal contiguous slices, rank ``r`` takes
  slice ``r`` (verifiers #112: every rank read the same prompts).
- *mini-batch order inside a round* (:func:`minibatch_groups`): the rank's groups are permuted
  by a generator seeded with ``(seed, round)`` and cut into ``steps_per_generation`` contiguous
  slices of ``groups_per_rank_step`` groups (the mini-batches). Each mini-batch is trained
  ``num_iterations`` times in a row, the order a a b b of the LCM aggregator's
  ``batch_repeat``. Groups stay whole and contiguous, siblings in generation order.
- *step*: the 1-based optimizer step number (step 1 is the first optimizer step), as in logs,
  metrics.jsonl, checkpoints and ``trainer.max_steps``; rounds, iterations and slices count
  from 0 (docs/training_loop.md, "Step numbers").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbatch.rollout.protocol import GenerationRequest

# Domain tags of the seeded generators (so that the epoch shuffle and the mini-batch shuffle of
# the same numbers never share a stream). numpy's SeedSequence hashes the whole tuple: no
# collisions between (seed, epoch) pairs, unlike seed + epoch or seed * 1000 + shard (which collide past 1000 shards).
_EPOCH_TAG = 0x5EED_E90C
_MINIBATCH_TAG = 0x5EED_B47C


@dataclass(frozen=True)
class GenerationSchedule:
    """Derived batch sizes of the GRPO loop; built by :func:`derive_schedule`."""

    num_generations: int
    """Completions per prompt (G, the group size)."""
    dp: int
    """Data-parallel ranks."""
    global_batch_size: int
    """Samples per optimizer step over all DP ranks (the mini-batch)."""
    steps_per_generation: int
    """Distinct mini-batches cut from one generation buffer."""
    num_iterations: int
    """Passes over each generation buffer."""

    @property
    def steps_per_round(self) -> int:
        """Optimizer steps served by one generation: steps_per_generation * num_iterations."""
        return self.steps_per_generation * self.num_iterations

    @property
    def generation_batch_size(self) -> int:
        """Samples generated per round over all ranks."""
        return self.global_batch_size * self.steps_per_generation

    @property
    def prompts_per_round(self) -> int:
        """Prompts drawn from the global stream per round (all ranks)."""
        return self.generation_batch_size // self.num_generations

    @property
    def prompts_per_rank_round(self) -> int:
        """Prompts (= groups) one rank generates per round."""
        return self.prompts_per_round // self.dp

    @property
    def groups_per_rank_step(self) -> int:
        """Groups in one rank's share of an optimizer step's mini-batch."""
        return self.global_batch_size // (self.dp * self.num_generations)

    @property
    def samples_per_rank_step(self) -> int:
        return self.groups_per_rank_step * self.num_generations

    def round_position(self, step: int) -> tuple[int, int, int]:
        """(round, iteration, slice) that optimizer step ``step`` (1-based) trains on, each
        0-based: slice (mini-batch) s of a round is trained at its iterations
        0 .. num_iterations - 1 in a row (a a b b). Step 1 is (0, 0, 0)."""
        if step < 1:
            raise ValueError(f"step={step}: optimizer steps are numbered from 1")
        step_index = step - 1
        rnd, k = divmod(step_index, self.steps_per_round)
        slice_index, iteration = divmod(k, self.num_iterations)
        return rnd, iteration, slice_index


def derive_schedule(
    *,
    num_generations: int,
    global_batch_size: int,
    dp: int,
    num_iterations: int = 1,
    steps_per_generation: int | None = None,
    generation_batch_size: int | None = None,
) -> GenerationSchedule:
    """Compute the generation schedule; raise ValueError listing every violated rule.

    ``steps_per_generation`` and ``generation_batch_size`` (samples per round, all ranks) are
    mutually exclusive; both null means one optimizer step per generation.
    """
    errors: list[str] = []
    if num_generations < 1:
        errors.append(f"grpo.num_generations={num_generations} must be >= 1")
    if dp < 1:
        errors.append(f"parallel.dp={dp} must be >= 1")
    if num_iterations < 1:
        errors.append(f"grpo.num_iterations={num_iterations} must be >= 1")
    if steps_per_generation is not None and generation_batch_size is not None:
        errors.append(
            f"grpo.steps_per_generation={steps_per_generation} and grpo.generation_batch_size="
            f"{generation_batch_size} are mutually exclusive: set one of them to null"
        )
    steps = 1 if steps_per_generation is None else steps_per_generation
    if generation_batch_size is not None and global_batch_size > 0:
        if generation_batch_size <= 0 or generation_batch_size % global_batch_size:
            errors.append(
                f"grpo.generation_batch_size={generation_batch_size} must be a positive multiple "
                f"of grpo.global_batch_size={global_batch_size}"
            )
        else:
            steps = generation_batch_size // global_batch_size
    if steps < 1:
        errors.append(f"grpo.steps_per_generation={steps} must be >= 1")
    per_step = max(dp, 1) * max(num_generations, 1)
    if global_batch_size < 1 or global_batch_size % per_step:
        errors.append(
            f"grpo.global_batch_size={global_batch_size} must be a positive multiple of "
            f"parallel.dp * grpo.num_generations = {per_step} (every rank trains whole groups "
            f"each step): use {max(per_step, global_batch_size // per_step * per_step)}"
        )
    if errors:
        raise ValueError("invalid GRPO batch sizes:\n  " + "\n  ".join(errors))
    return GenerationSchedule(
        num_generations=num_generations,
        dp=dp,
        global_batch_size=global_batch_size,
        steps_per_generation=steps,
        num_iterations=num_iterations,
    )


def schedule_from_config(grpo: Any, dp: int) -> GenerationSchedule:
    """:func:`derive_schedule` from a ``GRPOConfig``."""
    return derive_schedule(
        num_generations=grpo.num_generations,
        global_batch_size=grpo.global_batch_size,
        dp=dp,
        num_iterations=grpo.num_iterations,
        steps_per_generation=grpo.steps_per_generation,
        generation_batch_size=grpo.generation_batch_size,
    )


def epoch_permutation(num_prompts: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The dataset order of ``epoch``: a global permutation seeded by (seed, epoch)."""
    if not shuffle:
        return np.arange(num_prompts, dtype=np.int64)
    rng = np.random.default_rng([_EPOCH_TAG, seed, epoch])
    return rng.permutation(num_prompts).astype(np.int64)


class PromptSampler:
    """Infinite, DP-sharded, epoch-reshuffled prompt stream, cut into generation rounds.

    State is ``(epoch, cursor, round_index)`` of the GLOBAL stream, identical on every rank:
    resume continues at the cursor without replaying anything.
    """

    def __init__(
        self,
        num_prompts: int,
        schedule: GenerationSchedule,
        *,
        dp_rank: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if num_prompts < 1:
            raise ValueError(f"the dataset has no prompts (num_prompts={num_prompts})")
        if not 0 <= dp_rank < schedule.dp:
            raise ValueError(f"dp_rank={dp_rank} outside [0, {schedule.dp})")
        self.num_prompts = num_prompts
        self.schedule = schedule
        self.dp_rank = dp_rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self.round_index = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = epoch_permutation(self.num_prompts, self.seed, self.epoch, self.shuffle)
            self._perm_epoch = self.epoch
        return self._perm

    def _take_global(self, count: int) -> tuple[list[int], list[int]]:
        """Next ``count`` (prompt index, group id) pairs of the global stream."""
        indices: list[int] = []
        group_ids: list[int] = []
        while len(indices) < count:
            perm = self._permutation()
            take = min(count - len(indices), self.num_prompts - self.cursor)
            indices.extend(int(i) for i in perm[self.cursor : self.cursor + take])
            base = self.epoch * self.num_prompts + self.cursor
            group_ids.extend(range(base, base + take))
            self.cursor += take
            if self.cursor == self.num_prompts:
                self.epoch += 1
                self.cursor = 0
        return indices, group_ids

    def next_round(self) -> GenerationRequest:
        """This rank's prompts for the next round; advances the global stream on every rank."""
        request = self._draw(self.round_index)
        self.round_index += 1
        return request

    def next_draw_of_round(self) -> GenerationRequest:
        """Another draw of ``prompts_per_round`` prompts for the round :meth:`next_round` last
        returned (dynamic sampling refills the round): the cursor advances, the round does not."""
        if self.round_index == 0:
            raise RuntimeError("next_draw_of_round before the first next_round")
        return self._draw(self.round_index - 1)

    def _draw(self, round_index: int) -> GenerationRequest:
        per_rank = self.schedule.prompts_per_rank_round
        stream_start = self.epoch * self.num_prompts + self.cursor
        indices, group_ids = self._take_global(self.schedule.prompts_per_round)
        lo, hi = self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank
        return GenerationRequest(
            round_index=round_index,
            prompt_indices=tuple(indices[lo:hi]),
            group_ids=tuple(group_ids[lo:hi]),
            num_generations=self.schedule.num_generations,
            stream_start=stream_start,
        )

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "round_index": self.round_index,
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "prompts_per_round": self.schedule.prompts_per_round,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor; refuse a state made for another dataset, seed or round size."""
        for key in ("num_prompts", "seed", "shuffle", "prompts_per_round"):
            mine = self.state_dict()[key]
            if state[key] != mine:
                raise ValueError(
                    f"sampler checkpoint has {key}={state[key]} but this run has {mine}: "
                    "resume with the same data, trainer.seed and grpo batch sizes"
                )
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self.round_index = int(state["round_index"])


def minibatch_groups(
    num_groups: int,
    schedule: GenerationSchedule,
    *,
    seed: int,
    round_index: int,
    slice_index: int,
) -> list[int]:
    """Group indices (into one rank's round buffer) of mini-batch ``slice_index``, in order.

    Round ``r`` permutes its groups with a generator seeded by ``(seed, r)``; slice ``s`` is the
    ``s``-th run of ``groups_per_rank_step`` groups of that permutation, the same at every
    iteration (each mini-batch is repeated as a whole: a a b b).
    """
    per_step = schedule.groups_per_rank_step
    if num_groups != per_step * schedule.steps_per_generation:
        raise ValueError(
            f"round buffer holds {num_groups} groups, expected "
            f"{per_step} x {schedule.steps_per_generation}"
        )
    rng = np.random.default_rng([_MINIBATCH_TAG, seed, round_index])
    perm = rng.permutation(num_groups)
    return [int(g) for g in perm[slice_index * per_step : (slice_index + 1) * per_step]]


def filtered_minibatch_groups(
    positions: Sequence[int],
    schedule: GenerationSchedule,
    *,
    seed: int,
    round_index: int,
    slice_index: int,
) -> list[int]:
    """Group indices (into one rank's round buffer) of mini-batch ``slice_index`` of a round
    filled by dynamic sampling, where ranks hold different numbers of kept groups.

    ``positions[j]`` is the place of this rank's group j in the round's GLOBAL list of kept
    groups (exactly ``prompts_per_round`` of them, the same list on every rank). The global list
    is permuted by a generator seeded by ``(seed, round)`` and cut into ``steps_per_generation``
    slices of ``global_batch_size / num_generations`` groups; this rank's share of a slice is
    its groups in it, in permutation order. Over all ranks every slice is exactly one
    mini-batch: the step trains ``global_batch_size`` samples whatever was filtered.
    """
    total = schedule.prompts_per_round
    per_step = schedule.global_batch_size // schedule.num_generations
    rng = np.random.default_rng([_MINIBATCH_TAG, seed, round_index])
    chosen = rng.permutation(total)[slice_index * per_step : (slice_index + 1) * per_step]
    local = {pos: j for j, pos in enumerate(positions)}
    return [local[int(p)] for p in chosen if int(p) in local]


def expand_groups(groups: Sequence[int], num_generations: int) -> list[int]:
    """Sample indices of whole groups (siblings contiguous, in generation order)."""
    return [g * num_generations + j for g in groups for j in range(num_generations)]
