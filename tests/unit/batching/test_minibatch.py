"""Mini-batches: fixed sample counts after a seeded shuffle, groups whole (rule 6)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch.batching import split_mini_batches


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 6),
    st.integers(1, 5),
    st.integers(0, 5),
    st.integers(1, 6),
)
def test_fixed_size_groups_whole_every_sample_once(
    group: int, groups_per_mini: int, minis: int, seed: int, step: int
) -> None:
    size = group * groups_per_mini
    n = size * minis
    batches = split_mini_batches(n, size, seed=seed, step=step, group_size=group)
    assert len(batches) == minis and all(len(b) == size for b in batches)
    assert sorted(s for b in batches for s in b) == list(range(n))
    for b in batches:
        for k in range(0, size, group):
            run = b[k : k + group]
            assert run == list(range(run[0], run[0] + group)) and run[0] % group == 0
    assert batches == split_mini_batches(n, size, seed=seed, step=step, group_size=group)


def test_reshuffled_per_step() -> None:
    a = split_mini_batches(64, 16, seed=1, step=1, group_size=4)
    b = split_mini_batches(64, 16, seed=1, step=2, group_size=4)
    assert a != b


def test_steps_are_numbered_from_one() -> None:
    with pytest.raises(ValueError, match="step=0: optimizer steps are numbered from 1"):
        split_mini_batches(8, 4, seed=0, step=0)


@pytest.mark.parametrize(
    "n, size, group, match",
    [(10, 4, 1, "do not split"), (12, 6, 4, "multiple of the group"), (8, 0, 1, ">= 1")],
)
def test_invalid_sizes(n: int, size: int, group: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_mini_batches(n, size, seed=0, group_size=group)
