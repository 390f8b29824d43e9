"""From bins to DP ranks: equal counts by splitting, cost-balanced assignment, lockstep order.

A bin is a list of sample indices sorted by decreasing rounded length. ``BinShape`` knows how a
bin is computed (padded rows or a packed row) and so what it costs and how to split it.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlbatch.batching.cost import CostModel


@dataclass(frozen=True)
class BinShape:
    """How bins of one plan are laid out and costed.

    rounded: rounded length per sample; sample_cost: cost(rounded) per sample.
    """

    rounded: Sequence[int]
    sample_cost: Sequence[float]
    cost: CostModel
    packed: bool

    def bin_cost(self, samples: Sequence[int]) -> float:
        if not samples:
            return 0.0
        if self.packed:
            return sum(map(self.sample_cost.__getitem__, samples))
        return len(samples) * self.sample_cost[samples[0]]

    def split(self, samples: list[int]) -> tuple[list[int], list[int]]:
        """Split a bin of >= 2 samples into two whose costs are as equal as possible; each half
        is recomputed (a padded half gets its own, never larger, padded length)."""
        n = len(samples)
        assert n >= 2, "only bins with >= 2 samples can be split"
        best_j, best = 1, float("inf")
        if self.packed:
            costs = [self.sample_cost[i] for i in samples]
            total = sum(costs)
            left = 0.0
            for j in range(1, n):
                left += costs[j - 1]
                worst = max(left, total - left)
                if worst < best:
                    best_j, best = j, worst
        else:
            head = self.sample_cost[samples[0]]
            for j in range(1, n):
                worst = max(j * head, (n - j) * self.sample_cost[samples[j]])
                if worst < best:
                    best_j, best = j, worst
        return samples[:best_j], samples[best_j:]


def split_to_count(bins: list[list[int]], costs: list[float], target: int, shape: BinShape) -> int:
    """Split the costliest splittable bin (>= 2 samples) until there are ``target`` bins or none
    is splittable. ``bins`` and their ``costs`` are extended in place; returns the splits."""
    need = target - len(bins)
    if need <= 0:
        return 0
    # Only the costliest few can ever be split: seed the heap with the 2*need costliest.
    candidates = [i for i, b in enumerate(bins) if len(b) >= 2]
    if len(candidates) > 2 * need:
        candidates = heapq.nlargest(2 * need, candidates, key=costs.__getitem__)
    heap = [(-costs[i], i) for i in candidates]
    heapq.heapify(heap)
    splits = 0
    while len(bins) < target and heap:
        _, i = heapq.heappop(heap)
        left, right = shape.split(bins[i])
        bins[i] = left
        bins.append(right)
        costs[i] = shape.bin_cost(left)
        costs.append(shape.bin_cost(right))
        splits += 1
        for j in (i, len(bins) - 1):
            if len(bins[j]) >= 2:
                heapq.heappush(heap, (-costs[j], j))
    return splits


def assign_balanced(costs: Sequence[float], dp: int, per_rank: int) -> list[list[int]]:
    """Assign len(costs) == dp * per_rank items to dp ranks, exactly per_rank each, balancing
    the summed cost: items by decreasing cost are dealt in tiers of dp, the costliest item of
    a tier to the least-loaded rank (largest-first greedy, LPT, with one item per rank per
    tier). Micro-batch i is then alike on every rank (lockstep); whole-item swaps would break
    that, so the fine correction moves single samples instead (``rebalance_samples``).
    Returns item indices per rank."""
    n = len(costs)
    assert n == dp * per_rank, f"{n} items for {dp} ranks x {per_rank}"
    ranks: list[list[int]] = [[] for _ in range(dp)]
    order = sorted(range(n), key=costs.__getitem__, reverse=True)  # stable: ties by index
    loads = [0.0] * dp
    by_rank = range(dp)
    for start in range(0, n, dp):
        lightest = sorted(by_rank, key=loads.__getitem__)  # stable: ties by rank
        for item, r in zip(order[start : start + dp], lightest, strict=True):
            ranks[r].append(item)
            loads[r] += costs[item]
    return ranks


def rebalance_samples(
    bins: list[list[int]],
    ranks: list[list[int]],
    costs: list[float],
    shape: BinShape,
    budget: int,
    max_rounds: int = 256,
    tolerance: float = 3e-4,
    partners: int = 3,
) -> int:
    """Move single samples from the most-loaded rank into a bin of a lightly-loaded rank that
    has room, while that lowers the maximum: the fine-grained correction that whole-bin
    assignment cannot make (e.g. 71 full bins and one short one over 8 ranks). A bin is never
    emptied; the budget holds (packed: tokens + L <= B; padded: a free row of the target's
    padded length and L <= it). ``bins`` and ``costs`` are updated in place (``ranks`` keeps
    its bins). Returns the number of moves."""
    dp = len(ranks)
    if dp < 2:
        return 0
    loads = [sum(map(costs.__getitem__, items)) for items in ranks]
    mean = sum(loads) / dp
    if mean <= 0 or max(loads) <= mean * (1 + tolerance):
        return 0
    spread = max(loads) - min(loads)  # gaps only shrink: a costlier sample never moves
    mover: _PackedMoves | _PaddedMoves
    if shape.packed:
        mover = _PackedMoves(bins, ranks, shape, budget, spread)
    else:
        mover = _PaddedMoves(bins, ranks, shape, budget)
    moves = 0
    for _ in range(max_rounds):
        h = max(range(dp), key=loads.__getitem__)  # first of equals
        if loads[h] <= mean * (1 + tolerance):
            break
        best_gain, best = mean * 1e-9, None
        for j in sorted(range(dp), key=loads.__getitem__)[:partners]:  # stable
            if loads[h] - loads[j] <= 2 * best_gain:
                continue
            found = mover.best(h, j, loads[h], loads[j])
            if found is not None and found[0] > best_gain:
                best_gain, best = found[0], (found[1], j)
        if best is None:
            break
        (s, b, t, dec, inc), j = best
        mover.apply(s, b, t, h, j)
        for x in (b, t):
            costs[x] = shape.bin_cost(bins[x])
        loads[h] -= dec
        loads[j] += inc
        moves += 1
    return moves


Move = tuple[int, int, int, float, float]
"""(sample, source bin, target bin, cost removed from the source rank, cost added to target)."""


_PHI = 0x9E3779B1


def _scramble(i: int) -> int:
    """A fixed pseudo-random permutation of sample indices (Fibonacci hashing)."""
    return (i * _PHI) & 0xFFFFFFFF


class _PackedMoves:
    """Candidate moves for packed bins: a sample of cost c leaves its rank's load by c and adds
    c to the target's; it fits a target bin with room >= its rounded length."""

    def __init__(
        self,
        bins: list[list[int]],
        ranks: list[list[int]],
        shape: BinShape,
        budget: int,
        max_cost: float,
    ):
        self.bins, self.ranks, self.shape, self.budget = bins, ranks, shape, budget
        self.nbins = len(bins)
        self.max_cost = max_cost
        self.tokens: dict[int, int] = {}
        # rank -> (its bin with the most room, ties by lowest id; that room): only the two
        # ranks of a move change, so a rank's target is searched once and again after a move
        self.targets: dict[int, tuple[int, int] | None] = {}
        # rank -> sorted (cost, scrambled sample, sample, bin); the scramble breaks cost ties
        # pseudo-randomly, so equal-cost picks do not all come from one sibling group
        self.by_cost: dict[int, list[tuple[float, int, int, int]]] = {}

    def _tokens(self, b: int) -> int:
        if b not in self.tokens:
            self.tokens[b] = sum(map(self.shape.rounded.__getitem__, self.bins[b]))
        return self.tokens[b]

    def _sorted(self, r: int) -> list[tuple[float, int, int, int]]:
        if r not in self.by_cost:
            sc = self.shape.sample_cost
            limit = self.max_cost
            bins, nbins = self.bins, self.nbins
            entries = [
                (sc[s], (s * _PHI) & 0xFFFFFFFF, s, b)  # the same scramble as _scramble(s)
                for b in self.ranks[r]
                if b < nbins and len(bins[b]) >= 2
                for s in bins[b]
                if sc[s] < limit
            ]
            entries.sort()
            self.by_cost[r] = entries
        return self.by_cost[r]

    def _target(self, j: int) -> tuple[int, int] | None:
        if j not in self.targets:
            tokens = self._tokens
            fewest = min(((tokens(t), t) for t in self.ranks[j] if t < self.nbins), default=None)
            self.targets[j] = None if fewest is None else (fewest[1], self.budget - fewest[0])
        return self.targets[j]

    def best(self, h: int, j: int, load_h: float, load_j: float) -> tuple[float, Move] | None:
        target = self._target(j)
        if target is None:
            return None
        t, room = target
        gap = load_h - load_j
        upper = min(gap, self.shape.cost(room))
        items = self._sorted(h)
        pos = bisect_left(items, (min(gap / 2, upper), -1, -1, -1))
        best: tuple[float, Move] | None = None
        for step in (-1, 1):  # nearest valid candidates below and above gap / 2
            i = pos - 1 if step < 0 else pos
            for _ in range(16):
                if not 0 <= i < len(items):
                    break
                c, _, s, b = items[i]
                if (
                    0 < c <= upper
                    and c < gap
                    and len(self.bins[b]) >= 2
                    and self.shape.rounded[s] <= room
                ):
                    gain = min(c, gap - c)
                    if best is None or gain > best[0]:
                        best = (gain, (s, b, t, c, c))
                    break
                i += step
        return best

    def apply(self, s: int, b: int, t: int, h: int, j: int) -> None:
        rounded = self.shape.rounded
        self.bins[b].remove(s)
        self.bins[t].append(s)
        self.bins[t].sort(key=lambda x: -rounded[x])
        self.tokens[b] = self._tokens(b) - rounded[s]
        self.tokens[t] = self._tokens(t) + rounded[s]
        self.targets.pop(h, None)
        self.targets.pop(j, None)
        c = self.shape.sample_cost[s]
        for r, entry, add in (
            (h, (c, _scramble(s), s, b), False),
            (j, (c, _scramble(s), s, t), True),
        ):
            lst = self.by_cost.get(r)  # lists not built yet are built from the bins later
            if lst is not None and c < self.max_cost:
                if add:
                    insort(lst, entry)
                else:
                    del lst[bisect_left(lst, entry)]


class _PaddedMoves:
    """Candidate moves for padded bins: the shortest sample of a bin with >= 2 rows leaves (the
    source rank saves one row of its padded length) for a target bin with a free row whose
    padded length is >= the sample's (the target rank pays one row of that length)."""

    def __init__(self, bins: list[list[int]], ranks: list[list[int]], shape: BinShape, budget: int):
        self.bins, self.ranks, self.shape, self.budget = bins, ranks, shape, budget
        self.nbins = len(bins)

    def best(self, h: int, j: int, load_h: float, load_j: float) -> tuple[float, Move] | None:
        rounded, sc = self.shape.rounded, self.shape.sample_cost
        free = sorted(
            (rounded[self.bins[t][0]], t)
            for t in self.ranks[j]
            if t < self.nbins and (len(self.bins[t]) + 1) * rounded[self.bins[t][0]] <= self.budget
        )
        if not free:
            return None
        best: tuple[float, Move] | None = None
        for b in self.ranks[h]:
            if b >= self.nbins or len(self.bins[b]) < 2:
                continue
            s = self.bins[b][-1]
            i = bisect_left(free, (rounded[s], -1))
            if i == len(free):
                continue
            t = free[i][1]
            dec, inc = sc[self.bins[b][0]], sc[self.bins[t][0]]
            gain = load_h - max(load_h - dec, load_j + inc)
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, (s, b, t, dec, inc))
        return best

    def apply(self, s: int, b: int, t: int, h: int, j: int) -> None:
        self.bins[b].pop()
        self.bins[t].append(s)
        self.bins[t].sort(key=lambda x: -self.shape.rounded[x])


def order_for_lockstep(items: list[int], cost_of: Callable[[int], float]) -> list[int]:
    """Costliest first on every rank: micro-batch index i then holds the i-th costliest
    micro-batch of each rank, which minimises sum_i max_rank cost (DP ranks run in lockstep).
    Stable: equal costs keep their assignment order."""
    return sorted(items, key=cost_of, reverse=True)
