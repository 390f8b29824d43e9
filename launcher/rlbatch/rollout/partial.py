"""Partial rollouts: one rank's long-lived continuous batch across policy versions.

Round-based generation (``RunAheadProducer`` without ``grpo.partial_rollouts``) decodes a
round's rows together and waits for the longest one: on a long-tailed length distribution the
decode batch runs nearly empty for most of a round. The stream here keeps ``num_slots`` rows
decoding at all times: a finished row's slot takes the next row of the prompt stream at once,
and rows still decoding when a round is delivered stay in the stream and go on under the next
round's weights (docs/training_loop.md, "Partial rollouts").

Vocabulary (N = groups one rank trains per round, G = rows per group):

- the rank's *stream* of groups: draw q (the sampler's q-th round draw, this rank's slice)
  gives groups q*N .. q*N + N - 1 in order; rows are admitted strictly in that order;
- round r is decoded by one policy version (the producer's ``generation_version(r)``); every
  token records it (``Sample.token_versions``) with its behaviour log-prob;
- *lead* L: a row of draw q may start while round r decodes only if q <= r + L;
- *slack* C: a group of draw q must be delivered by round q + C. ``consumption_granularity=
  batch`` is C = 0 (round r delivers exactly draw r's groups), ``group`` is C = 1 (a round
  delivers the first N groups to finish, the groups due this round first);
- round r ends at the first decode step at which every due group has finished and at least N
  finished groups are waiting; it delivers N of them, due ones first, then by finishing step.

A row of draw q therefore starts at round >= q - L and is trained at round <= q + C: its oldest
token is at most (L + C) rounds older than the round that trains it, which the config check
bounds by ``grpo.max_staleness``. Nothing is ever discarded: every started row is delivered.

Weights swap only between rounds, at a decode step fixed by the data (never by timing): the
same seed gives the same samples whichever thread or process decodes. At each round start the
KV caches of the continuing rows are recomputed under the new weights (a prefill of prompt +
tokens so far), so each new token is sampled from exactly the policy of its version and its
behaviour log-prob is that policy's. Sampling noise is keyed by (row key, token index): the
stream's state between rounds (plain data, no caches) is all a checkpoint needs to continue
bit-exactly.

An engine with its own copy of the weights (vLLM) decodes the same stream in ``Segments``: each
row in a slot decodes up to a fixed number of tokens as one request (prompt + its tokens so
far, seeded by (row key, segment index)), and the round may end, and free slots refill, only
between segments (rlbatch.rollout.segments says why).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from rlbatch.rollout.engines.builtin import DecodeStats
from rlbatch.rollout.protocol import TokenBackend, TokenSampling, segment_seed
from rlbatch.rollout.sampling import SamplingParams, length_caps, row_keys, sample_tokens

_KEY_TAG = 0x9A27_1A1

Draw = tuple[tuple[int, ...], tuple[int, ...], int]
"""(prompt indices, group ids, stream start) of one draw: this rank's slice of a sampler round."""


@dataclass
class StreamRow:
    """One rollout row: its tokens so far, with the version and log-prob of each."""

    group: int
    """Stream index of its group."""
    sibling: int
    key: int
    """Sampling key (the noise of token t is a hash of key and t)."""
    cap: int
    """Tokens it may sample (max_new_tokens, or its lognormal cap)."""
    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    ended: bool = False
    truncated: bool = False
    segments: int = 0
    """Decode calls it took part in (a segment-decoding engine seeds each from its index)."""
    routing: Optional[np.ndarray] = None
    """An MoE policy on the built-in engine: the experts each position (prompt and tokens) was
    routed to by the forward that last fed it, taken when the row ends: its round's re-prefill
    for the positions before that round (a row continued across a weight update is recomputed
    under the new weights, and its later tokens were sampled from that context), then its
    decode steps; ``[length, MoE layers, k]``, the last position -1 (never fed). What
    grpo.routing_replay=r3 replays; None for a dense policy or a segment engine (vLLM)."""


@dataclass
class StreamGroup:
    index: int
    draw: int
    prompt_index: int
    group_id: int
    rows: list[StreamRow]
    finished: Optional[tuple[int, int]] = None
    """(round, decode step) at which its last row ended."""


@dataclass
class RoundResult:
    """What one round delivers: N finished groups, and the round's figures."""

    groups: list[StreamGroup]
    stream_start: int
    """Stream position of the round's own draw (equal on every rank)."""
    stats: DecodeStats
    carried_rows: int
    """Rows still decoding when the round ended (they continue next round)."""
    waiting_groups: int
    """Finished groups left for later rounds."""
    started_rows: int
    delivered_rows: int
    """Totals over the run: rows started and rows delivered (the rest are in the stream)."""


DecoderFactory = Callable[[int, int], Any]
"""(num_slots, max_len) -> a per-slot decoder (rlbatch.engine.generation.LeanDecoder)."""


@dataclass(frozen=True)
class Segments:
    """A ``TokenBackend`` (vLLM in the trainer's processes or on servers; rlbatch.rollout.segments)
    decoding whole stretches of rows: every row in a slot decodes up to ``length`` more tokens
    per call with ``sampling``, stopping at EOS; the stream checks for the end of its round and
    refills free slots between calls."""

    backend: TokenBackend
    sampling: TokenSampling
    length: int


class PartialRolloutStream:
    """One rank's partial-rollout stream (see the module docstring).

    ``draw_fn()`` returns the rank's next draw; ``prompt_ids(index)`` a prompt's token ids.
    """

    def __init__(
        self,
        draw_fn: Callable[[], Draw],
        prompt_ids: Callable[[int], Sequence[int]],
        params: SamplingParams,
        *,
        num_generations: int,
        groups_per_round: int,
        num_slots: int,
        lead: int,
        slack: int,
        seed: int,
        max_len: int,
    ) -> None:
        if lead < 0 or slack not in (0, 1) or lead + slack < 1:
            raise ValueError(
                f"partial rollouts need lead + slack >= 1 (lead={lead}, slack={slack})"
            )
        self.draw_fn = draw_fn
        self.prompt_ids = prompt_ids
        self.params = params
        self.G, self.N = num_generations, groups_per_round
        self.num_slots = max(1, num_slots)
        self.lead, self.slack, self.seed = lead, slack, seed
        self.max_len = max_len
        """Longest prompt + max_new_tokens: the decoder's cache length."""
        self.draws: list[int] = []
        """Stream start of every draw taken so far."""
        self.groups: dict[int, StreamGroup] = {}
        """Groups drawn and not yet delivered, by stream index."""
        self.pending: deque[StreamRow] = deque()
        """Rows drawn, not yet started, in stream order."""
        self.running: list[StreamRow] = []
        """Rows started and not ended, in the order they hold slots."""
        self.round_index = 0
        self.started_rows = 0
        self.delivered_rows = 0

    # -------------------------------------------------------------------------- drawing
    def _row_keys(self, group_id: int) -> list[int]:
        seed = int(np.random.SeedSequence([self.seed, _KEY_TAG, group_id]).generate_state(1)[0])
        return row_keys(seed, self.G).tolist()

    def _draw(self) -> None:
        indices, group_ids, stream_start = self.draw_fn()
        if len(indices) != self.N:
            raise ValueError(f"a draw gave {len(indices)} groups, the stream expects {self.N}")
        q = len(self.draws)
        self.draws.append(stream_start)
        for pos, (prompt, gid) in enumerate(zip(indices, group_ids, strict=True)):
            keys = self._row_keys(gid)
            caps = length_caps(torch.tensor(keys), self.params).tolist()
            rows = [StreamRow(q * self.N + pos, j, keys[j], caps[j]) for j in range(self.G)]
            self.groups[q * self.N + pos] = StreamGroup(q * self.N + pos, q, prompt, gid, rows)
            self.pending.extend(rows)

    def _admissible(self) -> bool:
        """Whether the next row of the stream may start in this round (drawing it if needed)."""
        if not self.pending and len(self.draws) <= self.round_index + self.lead:
            self._draw()
        return bool(self.pending) and self.groups[self.pending[0].group].draw <= (
            self.round_index + self.lead
        )

    # -------------------------------------------------------------------------- a round
    def run_round(self, version: int, decode: DecoderFactory | Segments) -> RoundResult:
        """Decode with policy ``version`` until this round can deliver; returns its groups."""
        r = self.round_index
        while len(self.draws) <= r:  # the round's own draw exists (its stream position)
            self._draw()
        stats = DecodeStats()
        if not self._ready():
            if isinstance(decode, Segments):
                self._decode_segments(version, decode, stats)
            else:
                self._decode(version, decode, stats)
        delivered = self._select()
        for g in delivered:
            del self.groups[g.index]
            self.delivered_rows += self.G
        self.round_index += 1
        return RoundResult(
            groups=delivered,
            stream_start=self.draws[r],
            stats=stats,
            carried_rows=len(self.running),
            waiting_groups=sum(1 for g in self.groups.values() if g.finished is not None),
            started_rows=self.started_rows,
            delivered_rows=self.delivered_rows,
        )

    def _due(self, g: StreamGroup) -> bool:
        return g.draw + self.slack <= self.round_index

    def _ready(self) -> bool:
        finished = 0
        for g in self.groups.values():
            if g.finished is None and self._due(g):
                return False
            finished += g.finished is not None
        return finished >= self.N

    def _select(self) -> list[StreamGroup]:
        done = [g for g in self.groups.values() if g.finished is not None]
        due = sorted((g for g in done if self._due(g)), key=lambda g: g.index)
        rest = sorted((g for g in done if not self._due(g)), key=lambda g: (g.finished, g.index))
        chosen = (due + rest)[: self.N]
        if len(due) > self.N or len(chosen) != self.N:
            raise RuntimeError(
                f"round {self.round_index}: {len(due)} due and {len(done)} finished groups for "
                f"{self.N} places"
            )
        return chosen

    def _decode(self, version: int, new_decoder: DecoderFactory, stats: DecodeStats) -> None:
        """The decode loop of one round (the round's weights are loaded in the decoder's model)."""
        decoder = new_decoder(self.num_slots, self.max_len)
        slots: list[Optional[StreamRow]] = [None] * self.num_slots
        # rows carried over: their caches are recomputed under this round's weights
        logits = self._enter(decoder, slots, self.running, lambda row: row.ids)
        logits.update(self._admit(decoder, slots))
        step = 0
        while logits:
            active = sorted(logits)
            rows = [slots[s] for s in active]
            assert all(row is not None for row in rows)
            tok, lp = self._sample(rows, torch.stack([logits[s] for s in active]))
            stats.add(len(active), self.num_slots)
            going: dict[int, int] = {}
            for slot, row, t, logp in zip(active, rows, tok.tolist(), lp.tolist(), strict=True):
                assert row is not None
                row.ids.append(t)
                row.logps.append(logp)
                row.versions.append(version)
                if self._row_ends(row, t):
                    slots[slot] = None
                    self._keep_routing(decoder, slot, row)
                    self._finish(row, step)
                else:
                    going[slot] = t
            step += 1
            self.running = [row for row in slots if row is not None]
            if self._ready():
                return
            logits = self._feed(decoder, going)
            logits.update(self._admit(decoder, slots))
        raise RuntimeError(f"round {self.round_index}: the stream ran dry before it could deliver")

    def _decode_segments(self, version: int, engine: Segments, stats: DecodeStats) -> None:
        """The round's decode loop on a segment engine: every row in a slot decodes up to
        ``engine.length`` more tokens as a new request (prompt + its tokens so far, so rows
        carried over are recomputed under this round's weights), seeded by (row key, segment
        index); then the round may end, and free slots take the next rows of the stream. The
        round's end falls on a segment boundary, a pure function of the data."""
        slots: list[Optional[StreamRow]] = [None] * self.num_slots
        for slot, row in enumerate(self.running):
            slots[slot] = row
        step = 0
        while True:
            self._admit_rows(slots)
            taken = [(slot, row) for slot, row in enumerate(slots) if row is not None]
            if not taken:
                raise RuntimeError(
                    f"round {self.round_index}: the stream ran dry before it could deliver"
                )
            decoded = engine.backend.decode(
                [[*self.prompt_ids(self.groups[r.group].prompt_index), *r.ids] for _, r in taken],
                [segment_seed(row.key, row.segments) for _, row in taken],
                engine.sampling,
                [min(engine.length, row.cap - len(row.ids)) for _, row in taken],
            )
            for (slot, row), d in zip(taken, decoded, strict=True):
                row.segments += 1
                row.ids += d.tokens
                row.logps += d.logps
                row.versions += [version] * len(d.tokens)
                if d.tokens and self._row_ends(row, d.tokens[-1]):
                    slots[slot] = None
                    self._finish(row, step + len(d.tokens) - 1)
            longest = max(len(d.tokens) for d in decoded)
            for t in range(longest):
                stats.add(sum(len(d.tokens) > t for d in decoded), self.num_slots)
            step += longest
            self.running = [row for row in slots if row is not None]
            if self._ready():
                return

    def _admit_rows(self, slots: list[Optional[StreamRow]]) -> None:
        """Start the next rows of the stream in free slots, as far as the lead allows."""
        for slot in [s for s, row in enumerate(slots) if row is None]:
            if not self._admissible():
                return
            row = self.pending.popleft()
            slots[slot] = row
            self.started_rows += 1
            self.running.append(row)

    def started_in_stream(self) -> int:
        """Rows started and not yet delivered (decoding, or finished in a waiting group)."""
        return sum(1 for g in self.groups.values() for row in g.rows if row.ids)

    def _sample(self, rows: list[Any], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.tensor([row.key for row in rows], device=logits.device)
        steps = torch.tensor([len(row.ids) for row in rows], device=logits.device)
        return sample_tokens(logits, self.params, keys, steps)

    def _row_ends(self, row: StreamRow, token: int) -> bool:
        if self.params.ends(token):
            row.ended = True
        elif len(row.ids) >= row.cap:
            row.ended = True
            row.truncated = row.cap >= self.params.max_new_tokens
        return row.ended

    def _keep_routing(self, decoder: Any, slot: int, row: StreamRow) -> None:
        """An ended row's routing record (StreamRow.routing), from a decoder that records one,
        before its slot takes another row."""
        if getattr(decoder, "routing", None) is None:
            return
        prompt = self.prompt_ids(self.groups[row.group].prompt_index)
        row.routing = decoder.routing_of(slot, len(prompt) + len(row.ids))

    def _finish(self, row: StreamRow, step: int) -> None:
        group = self.groups[row.group]
        if all(r.ended for r in group.rows):
            group.finished = (self.round_index, step)

    def _enter(
        self,
        decoder: Any,
        slots: list[Optional[StreamRow]],
        rows: Sequence[StreamRow],
        tokens: Callable[[StreamRow], list[int]],
    ) -> dict[int, torch.Tensor]:
        """Put rows in the free slots (in order), prefilling prompt + ``tokens(row)``."""
        free = [s for s, row in enumerate(slots) if row is None][: len(rows)]
        if not free:
            return {}
        seqs = []
        for slot, row in zip(free, rows, strict=False):
            slots[slot] = row
            prompt = self.prompt_ids(self.groups[row.group].prompt_index)
            seqs.append([*prompt, *tokens(row)])
        return dict(zip(free, decoder.prefill(free, seqs), strict=True))

    def _admit(self, decoder: Any, slots: list[Optional[StreamRow]]) -> dict[int, torch.Tensor]:
        """Start the next rows of the stream in free slots, as far as the lead allows."""
        free = sum(1 for row in slots if row is None)
        starting: list[StreamRow] = []
        while len(starting) < free and self._admissible():
            starting.append(self.pending.popleft())
        self.started_rows += len(starting)
        self.running.extend(starting)
        return self._enter(decoder, slots, starting, lambda row: [])

    @staticmethod
    def _feed(decoder: Any, going: dict[int, int]) -> dict[int, torch.Tensor]:
        """One decode step for the rows that go on (their last token)."""
        if not going:
            return {}
        active = sorted(going)
        index = torch.tensor(active, device=decoder.device)
        feed = torch.tensor([going[s] for s in active], device=decoder.device)
        return dict(zip(active, decoder.decode(feed, index), strict=True))

    # -------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything between two rounds, as plain data: groups (with their rows' tokens,
        log-probs, versions and keys), the rows waiting to start and those decoding."""
        return {
            "draws": list(self.draws),
            "groups": {
                i: {
                    "draw": g.draw,
                    "prompt_index": g.prompt_index,
                    "group_id": g.group_id,
                    "finished": g.finished,
                    "rows": [{k: _copy(v) for k, v in vars(row).items()} for row in g.rows],
                }
                for i, g in self.groups.items()
            },
            "pending": [(row.group, row.sibling) for row in self.pending],
            "running": [(row.group, row.sibling) for row in self.running],
            "round_index": self.round_index,
            "started_rows": self.started_rows,
            "delivered_rows": self.delivered_rows,
            "shape": (self.G, self.N, self.lead, self.slack, self.num_slots),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shape = (self.G, self.N, self.lead, self.slack, self.num_slots)
        if tuple(state["shape"]) != shape:
            raise ValueError(
                f"the checkpoint's partial-rollout stream has (num_generations, groups per "
                f"round, lead, slack, slots) = {tuple(state['shape'])}, this run {shape}: resume "
                "with the same grpo batch sizes, max_staleness, consumption_granularity and "
                "rollout micro-batch size"
            )
        self.draws = list(state["draws"])
        self.groups = {}
        for i, g in state["groups"].items():
            rows = [StreamRow(**{k: _copy(v) for k, v in row.items()}) for row in g["rows"]]
            self.groups[int(i)] = StreamGroup(
                int(i), g["draw"], g["prompt_index"], g["group_id"], rows, g["finished"]
            )
        self.pending = deque(self.groups[i].rows[j] for i, j in state["pending"])
        self.running = [self.groups[i].rows[j] for i, j in state["running"]]
        self.round_index = int(state["round_index"])
        self.started_rows = int(state["started_rows"])
        self.delivered_rows = int(state["delivered_rows"])


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value
