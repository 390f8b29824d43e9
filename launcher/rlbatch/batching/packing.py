"""Bin construction: which samples share a micro-batch.

Every function takes ``order`` (sample indices sorted by decreasing rounded length) and returns
bins, each a list of sample indices in decreasing rounded length (so a padded bin's first sample
sets its padded length). No function here knows about DP ranks.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence


def pack_sorted_runs(
    order: Sequence[int], rounded: Sequence[int], capacity: int, max_rows: int | None = None
) -> list[list[int]]:
    """Padded bins (dynamic / fixed modes): consecutive runs of the length-sorted order with
    rows * round_up(max_len) <= capacity, greedy from the longest.

    For "contiguous runs of a sorted order" this greedy uses the fewest bins: the bin holding
    the longest remaining sample has that sample's padded length whatever else it holds, so
    filling it with the next-longest samples leaves the shortest possible remainder.
    ``max_rows`` caps the rows (fixed mode's micro_batch_size).
    """
    bins: list[list[int]] = []
    i, n = 0, len(order)
    while i < n:
        rows = capacity // rounded[order[i]]
        if max_rows is not None:
            rows = min(rows, max_rows)
        rows = max(rows, 1)  # an isolated oversize sample still gets its own bin
        bins.append(list(order[i : i + rows]))
        i += rows
    return bins


def pack_best_fit_decreasing(
    order: list[int], rounded: Sequence[int], capacity: int
) -> list[list[int]]:
    """Packed bins: best-fit decreasing (BFD) on rounded lengths, sum <= capacity.

    Exact BFD, computed per size class instead of per item: rounded lengths take few distinct
    values, so the items of one size s are placed together. The best fit for s is the smallest
    remaining room c >= s (bisect over the sorted distinct rooms); sequential BFD would then put
    min(c // s, items left) copies of s into that bin before it drops below s, so that many go
    in at once. Bins whose room is below the smallest item are closed. Cost: O(classes + bins
    touched) bisects instead of one per item.
    """
    bins: list[list[int]] = []
    if not order:
        return bins
    smallest = rounded[order[-1]]
    rooms: list[int] = []  # sorted distinct remaining rooms that have open bins
    open_bins: dict[int, list[int]] = {}  # room -> bin ids (popped from the end)
    neg = [-rounded[k] for k in order]  # non-decreasing: class boundaries by bisect
    # Items longer than capacity / 2 fit no open bin (each open bin holds a longer one): one
    # bin each, opened in one step; their rooms capacity - size come in ascending order.
    i, n = bisect_left(neg, -(capacity // 2)), len(order)
    bins.extend([k] for k in order[:i])
    for room, singles in _rooms_of_singles(neg, i, capacity, smallest):
        rooms.append(room)
        open_bins[room] = singles
    while i < n:
        size = -neg[i]
        j = bisect_right(neg, neg[i], i)
        while i < j:
            pos = bisect_left(rooms, size)
            if pos == len(rooms):  # nothing fits: open bins, capacity // size items each
                per = capacity // size if size <= capacity else 1
                while i < j:
                    take = per if per < j - i else j - i
                    bid = len(bins)
                    bins.append(order[i : i + take])
                    i += take
                    room = capacity - take * size
                    if room >= smallest:
                        _reopen(room, bid, rooms, open_bins)
                break
            room = rooms[pos]
            ids = open_bins[room]
            bid = ids.pop()
            if not ids:
                del open_bins[room]
                del rooms[pos]
            take = room // size
            if take == 1:
                bins[bid].append(order[i])
            else:
                if take > j - i:
                    take = j - i
                bins[bid].extend(order[i : i + take])
            i += take
            room -= take * size
            if room >= smallest:
                _reopen(room, bid, rooms, open_bins)
    return bins


def _reopen(room: int, bid: int, rooms: list[int], open_bins: dict[int, list[int]]) -> None:
    """File bin ``bid`` under its remaining ``room`` (rooms stays sorted and distinct)."""
    ids = open_bins.get(room)
    if ids is None:
        open_bins[room] = [bid]
        insort(rooms, room)
    else:
        ids.append(bid)


def _rooms_of_singles(
    neg: list[int], end: int, capacity: int, smallest: int
) -> list[tuple[int, list[int]]]:
    """(room, bin ids) per size class of the first ``end`` items, one bin each, for the rooms
    that can still take the smallest item."""
    out = []
    i = 0
    while i < end:
        j = bisect_right(neg, neg[i], i, end)
        if capacity + neg[i] >= smallest:
            out.append((capacity + neg[i], list(range(i, j))))
        i = j
    return out


def eliminate_bins(
    bins: list[list[int]], rounded: Sequence[int], capacity: int, count: int
) -> list[list[int]] | None:
    """Try to empty the ``count`` least-filled packed bins into the others' free room (best fit,
    longest items first). Returns the remaining bins (sorted by decreasing rounded length inside)
    or None when some item finds no room. Used when BFD lands just above a multiple of dp."""
    if count <= 0:
        return bins
    if count >= len(bins):
        return None
    get = rounded.__getitem__
    filled = [sum(map(get, b)) for b in bins]
    drop = set(heapq.nsmallest(count, range(len(bins)), key=filled.__getitem__))
    items = sorted((s for i in drop for s in bins[i]), key=lambda s: -rounded[s])
    keep = [i for i in range(len(bins)) if i not in drop]
    if rounded[items[0]] > capacity - min(filled[i] for i in keep):
        return None  # the longest item fits nowhere: fail fast
    smallest = rounded[items[-1]]
    rooms = sorted(
        ((capacity - filled[i]) << 32) | i for i in keep if capacity - filled[i] >= smallest
    )
    added: dict[int, list[int]] = {}
    for s in items:
        size = rounded[s]
        pos = bisect_left(rooms, size << 32)
        if pos == len(rooms):
            return None
        key = rooms.pop(pos)
        i = key & 0xFFFFFFFF
        added.setdefault(i, []).append(s)
        room = (key >> 32) - size
        if room >= smallest:
            insort(rooms, (room << 32) | i)
    out = []
    for i in keep:
        if i in added:
            out.append(sorted(bins[i] + added[i], key=lambda s: -rounded[s]))
        else:
            out.append(bins[i])
    return out
