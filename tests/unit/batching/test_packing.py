"""The per-size-class best-fit decreasing equals item-by-item BFD, bin for bin."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch.batching.packing import pack_best_fit_decreasing


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([1, 8, 10, 64, 100]),
    st.lists(st.integers(1, 130), max_size=60),
    st.sampled_from([1, 2, 8]),
)
def test_per_class_bfd_matches_item_by_item(capacity: int, raw: list[int], r: int) -> None:
    rounded = [-(-x // r) * r for x in raw]
    order = sorted(range(len(rounded)), key=rounded.__getitem__, reverse=True)
    assert pack_best_fit_decreasing(order, rounded, capacity) == _reference(
        order, rounded, capacity
    )


def _reference(order: list[int], rounded: list[int], capacity: int) -> list[list[int]]:
    """Item-by-item BFD with the per-class version's tie rule: among bins of equal room, the
    one that reached that room last goes first (a stack per room); bins whose room is below
    the smallest item are closed (they can take nothing anyway)."""
    bins: list[list[int]] = []
    stacks: dict[int, list[int]] = {}
    smallest = min(rounded, default=0)
    for k in order:
        size = rounded[k]
        fitting = [room for room, ids in stacks.items() if ids and room >= size]
        if fitting:
            room = min(fitting)
            b = stacks[room].pop()
            bins[b].append(k)
        else:
            b, room = len(bins), capacity
            bins.append([k])
        if room - size >= smallest:
            stacks.setdefault(room - size, []).append(b)
    return bins
