"""Mini-batches: the samples of one optimizer step (docs/batching.md, rule 6).

A mini-batch is a fixed number of samples, chosen by a seeded shuffle of whole sibling groups;
dynamic batching happens inside it. The number of optimizer steps therefore never depends on
sequence lengths (ROLL #442: the LR schedule must not see a data-dependent step count).
"""

from __future__ import annotations

import random


def split_mini_batches(
    num_samples: int, mini_batch_size: int, *, seed: int, step: int = 1, group_size: int = 1
) -> list[list[int]]:
    """Shuffle the groups (contiguous runs of ``group_size`` samples) with a generator seeded by
    (seed, step) and cut the shuffled samples into mini-batches of ``mini_batch_size``
    (``step``: the 1-based optimizer step).

    Raises ValueError unless group_size divides mini_batch_size and mini_batch_size divides
    num_samples (a ragged last mini-batch would change the number of optimizer steps and the
    per-step normalisation)."""
    if group_size < 1 or mini_batch_size < 1:
        raise ValueError(
            f"mini_batch_size={mini_batch_size} and group_size={group_size} must be >= 1"
        )
    if num_samples < 0:
        raise ValueError(f"num_samples={num_samples} must be >= 0")
    if step < 1:
        raise ValueError(f"step={step}: optimizer steps are numbered from 1")
    if mini_batch_size % group_size:
        raise ValueError(
            f"mini-batch size {mini_batch_size} is not a multiple of the group size "
            f"{group_size} (grpo.num_generations): groups must stay whole"
        )
    if num_samples % mini_batch_size:
        raise ValueError(
            f"{num_samples} samples do not split into mini-batches of {mini_batch_size}: "
            "make grpo.global_batch_size divide the samples of a generation round"
        )
    step_index = step - 1  # the generator is seeded with the 0-based index of the step
    groups = list(range(num_samples // group_size))
    random.Random(f"rlbatch-minibatch:{seed}:{step_index}").shuffle(groups)
    order = [g * group_size + k for g in groups for k in range(group_size)]
    return [order[i : i + mini_batch_size] for i in range(0, num_samples, mini_batch_size)]
