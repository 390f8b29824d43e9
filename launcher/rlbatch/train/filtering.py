"""DAPO dynamic sampling (``grpo.filter_groups``) with exact batches (docs/training_loop.md,
"Dynamic sampling").

A round draws ``prompts_per_round`` prompts; groups whose rewards are all equal (zero variance:
their GRPO advantage is 0, they teach nothing) are dropped, unless a teacher's per-token
advantage makes their combined advantage non-zero (on-policy distillation), and the round draws further
``prompts_per_round`` prompts until the kept groups over ALL DP ranks reach
``prompts_per_round``, at most ``grpo.max_generation_rounds`` extra draws. The decision is
global: each draw, every DP rank gathers every rank's keep flags (one small collective in the
training thread), so all ranks take the same decision and none waits on a collective the
others skip. The first ``prompts_per_round`` kept groups in (draw, rank, group) order make the
round, the same list on every rank; each rank keeps its own groups of it with their places in
the list (:func:`rlbatch.rollout.schedule.filtered_minibatch_groups` cuts the mini-batches from
it). Every step then trains exactly ``grpo.global_batch_size`` samples. Kept groups past the
first ``prompts_per_round`` are not trained and are reported (``groups_unused``); the sampler's
cursor counts every prompt drawn, so a resume continues the same stream.

The selection functions are pure; :class:`GroupFilter` drives the draws with an injected
gather (rlbatch.distributed's DP all-gather in a run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlbatch.grpo.types import Sample

Draw = tuple[Any, list[Sample]]
"""(GenerationRequest, this rank's samples of it)."""

UNTRAINED = "samples_untrained"
"""Round figure: samples drawn and not trained (groups filtered or unused), over DP ranks."""
UNTRAINED_FAILED = "reward_served_fail_untrained"
"""Round figure: those of them whose served reward failed."""


def keep_flags(rewards: Sequence[float], group_size: int) -> list[bool]:
    """Per group of ``group_size`` contiguous rewards: True when they are not all equal."""
    return [
        max(rewards[i : i + group_size]) != min(rewards[i : i + group_size])
        for i in range(0, len(rewards), group_size)
    ]


def teaching_groups(samples: Sequence[Sample], group_size: int) -> list[bool]:
    """Per group: its combined advantage is not 0 everywhere: the rewards of its members
    differ (:func:`keep_flags`; an episode left out under env.on_error=skip is no member, and
    a group with fewer than 2 members has advantage 0) or a sample has a non-zero per-token
    teacher advantage (on-policy distillation, rlbatch.grpo.distill; 0 on a left-out one)."""
    out = []
    for i in range(0, len(samples), group_size):
        group = samples[i : i + group_size]
        rewards = [s.reward for s in group if not s.skipped]
        spread = len(rewards) >= 2 and max(rewards) != min(rewards)
        out.append(spread or any(any(s.token_advantages or ()) for s in group))
    return out


def kept_in_order(flags: Sequence[Sequence[Sequence[bool]]]) -> list[tuple[int, int, int]]:
    """(draw, rank, group) of every kept group, in draw, then DP-rank, then group order, from
    ``flags[draw][rank][group]`` (identical on every rank after the gather)."""
    return [
        (d, r, g)
        for d, per_rank in enumerate(flags)
        for r, groups in enumerate(per_rank)
        for g, keep in enumerate(groups)
        if keep
    ]


def my_groups(chosen: Sequence[tuple[int, int, int]], rank: int) -> list[tuple[int, int, int]]:
    """(global position, draw, group) of this rank's groups among the ``chosen`` ones."""
    return [(pos, d, g) for pos, (d, r, g) in enumerate(chosen) if r == rank]


@dataclass
class GroupFilter:
    """Fills one round's kept groups to exactly ``needed`` over every DP rank."""

    num_generations: int
    needed: int
    """Groups a round trains over all ranks: prompts_per_round."""
    max_rounds: int
    """grpo.max_generation_rounds: extra draws allowed after the first."""
    dp_rank: int
    gather: Callable[[Any], list[Any]]
    """One object per DP rank, in DP-rank order (identity on one process)."""
    failed: Callable[[Sample], bool] | None = None
    """Whether a sample's served reward failed (rlbatch.grpo.stages.SERVED_FAILED): when set,
    the round's figures count the samples drawn and not trained, and those of them that
    failed (:data:`UNTRAINED`, :data:`UNTRAINED_FAILED`), so that a group dropped for its zero
    variance (every sample failed, every reward 0) still counts against
    data.served.max_error_fraction."""

    def fill(
        self, first: Draw, draw_more: Callable[[], Draw]
    ) -> tuple[list[Sample], list[int], dict]:
        """(this rank's kept samples, their groups' global positions, metrics) of a round."""
        draws, flags = [first], []
        while True:
            flags.append(self.gather(teaching_groups(draws[-1][1], self.num_generations)))
            kept = kept_in_order(flags)
            if len(kept) >= self.needed:
                break
            if len(draws) > self.max_rounds:
                raise RuntimeError(self._too_few(len(kept), len(draws)))
            draws.append(draw_more())
        G = self.num_generations
        samples: list[Sample] = []
        positions = []
        for pos, d, g in my_groups(kept[: self.needed], self.dp_rank):
            samples.extend(draws[d][1][g * G : (g + 1) * G])
            positions.append(pos)
        drawn = sum(len(per_rank) for f in flags for per_rank in f)
        metrics = {
            "generation_rounds": len(draws),
            "prompts_drawn": drawn,
            "groups_filtered": drawn - len(kept),
            "groups_unused": len(kept) - self.needed,
        }
        return samples, positions, metrics | self._untrained(draws, kept[: self.needed])

    def _untrained(
        self, draws: Sequence[Draw], chosen: Sequence[tuple[int, int, int]]
    ) -> dict[str, float]:
        """The samples drawn and not trained over every DP rank, and those of them whose
        served reward failed (one more gather; {} without ``failed``)."""
        if self.failed is None:
            return {}
        G = self.num_generations
        mine = {(d, g) for d, r, g in chosen if r == self.dp_rank}
        local = [0, 0]
        for d, (_, samples) in enumerate(draws):
            for g in range(len(samples) // G):
                if (d, g) not in mine:
                    group = samples[g * G : (g + 1) * G]
                    local[0] += len(group)
                    local[1] += sum(bool(self.failed(s)) for s in group)
        per_rank = self.gather(local)
        return {
            UNTRAINED: float(sum(n for n, _ in per_rank)),
            UNTRAINED_FAILED: float(sum(f for _, f in per_rank)),
        }

    def _too_few(self, kept: int, draws: int) -> str:
        return (
            f"grpo.filter_groups=zero_variance: after {draws} generation rounds (1 + "
            f"grpo.max_generation_rounds={self.max_rounds} extra) only {kept} of the {self.needed}"
            " groups a round needs have rewards that differ: raise grpo.max_generation_rounds,"
            " use data whose rewards vary within a group, or set grpo.filter_groups=none"
        )
