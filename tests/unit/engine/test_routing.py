"""MoE routing relayout (rlbatch.engine.routing): per-sample ``[length, layers, k]`` records in
megatron's sequence-major token order for padded, packed and filler micro-batches, and back,
checked token by token against the micro-batch's own token layout (schedule.make_inputs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlbatch.batching.plan import MicroBatch
from rlbatch.engine import routing, schedule

LAYERS, K = 3, 2


def _record(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 8, size=(n, LAYERS, K)).astype(np.int8)
    arr[-1] = -1  # the last token: no record
    return arr


def _padded(lengths: list[int]) -> MicroBatch:
    width = max(lengths) + 2
    return MicroBatch(tuple(range(len(lengths))), tuple(lengths), width, width * len(lengths),
                      sum(lengths))  # fmt: skip


def _packed(lengths: list[int], r: int) -> MicroBatch:
    width = sum(schedule.round_up(n, r) for n in lengths) + r
    return MicroBatch(tuple(range(len(lengths))), tuple(lengths), width, width, sum(lengths),
                      packed=True)  # fmt: skip


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_each_token_gets_its_own_record_in_megatrons_order(packed):
    lengths = [5, 9, 3]
    mb = _packed(lengths, 4) if packed else _padded(lengths)
    # token ids that say which (sample, position) they are: 1000 * (sample + 1) + position
    seqs = [[1000 * (j + 1) + t for t in range(n)] for j, n in enumerate(lengths)]
    inputs = schedule.make_inputs(seqs, mb, round_to=4, device="cpu")
    records = [_record(n, j) for j, n in enumerate(lengths)]
    got = routing.micro_batch_routing(records, inputs.segments, mb.num_rows, mb.padded_len,
                                      LAYERS, K)  # fmt: skip
    rows, width = inputs.tokens.shape
    assert got.shape == (LAYERS, width * rows, K)
    flat = inputs.tokens.t().reshape(-1)  # [S, R] sequence-major, as the router flattens
    for index, token in enumerate(flat.tolist()):
        if token < 1000:  # padding: nothing to replay
            assert (got[:, index] == -1).all()
            continue
        j, t = token // 1000 - 1, token % 1000
        want = torch.as_tensor(records[j][t].astype(np.int64))
        assert torch.equal(got[:, index], want), (j, t)
    # and back: what a forward's routers chose, one record per sample
    natural = {slot: got[slot].clamp(min=0) for slot in range(LAYERS)}
    back = routing.sample_routing(natural, inputs.segments, mb.num_rows, mb.padded_len, LAYERS,
                                  K, np.dtype(np.int8))  # fmt: skip
    for rec, b in zip(records, back, strict=True):
        assert np.array_equal(rec[:-1], b[:-1]) and (b[-1] == 0).all()


def test_samples_without_records_and_fillers_replay_nothing():
    mb = _padded([4, 6])
    segs = schedule.segments(mb)
    got = routing.micro_batch_routing([None, _record(6, 1)], segs, 2, mb.padded_len, LAYERS, K)
    assert (got.view(LAYERS, mb.padded_len, 2, K)[:, :, 0] == -1).all()
    filler = MicroBatch((), (), 8, 8, 0, filler=True)
    empty = routing.micro_batch_routing([], schedule.segments(filler), 1, 8, LAYERS, K)
    assert (empty == -1).all()


def test_stages_merge_and_mismatch_counts():
    a = np.full((4, LAYERS, K), -1, dtype=np.int8)
    b = a.copy()
    a[:, 0] = 1
    b[:, 1:] = 2
    merged = routing.merge([a, None, b])
    assert merged is not None and (merged[:, 0] == 1).all() and (merged[:, 1:] == 2).all()
    assert routing.merge([None, None]) is None
    replayed = torch.tensor([[[0, 1], [2, 3], [-1, -1]]])  # 1 layer, 3 tokens
    natural = {0: torch.tensor([[1, 0], [2, 1], [0, 1]])}  # same set, moved, unknown
    counts = routing.mismatch_counts(natural, replayed, 1)
    assert counts.tolist() == [[2.0], [1.0]]
    assert routing.mismatch_metrics(counts)["moe/routing_mismatch"] == 0.5


def test_a_chunk_without_moe_layers_gives_zeros_on_the_losss_device():
    """A last pipeline chunk of dense layers only: its (zero) share is created where the loss
    indexes it with its sample index (on a GPU, CPU zeros indexed by CUDA indices would
    raise); "meta" stands in for a device here."""
    segs = schedule.segments(_padded([3, 5]), 1)
    zeros = routing.load_balance({}, segs, 2, 7, K, num_layers=2, device=torch.device("meta"))
    assert zeros.device.type == "meta" and tuple(zeros.shape) == (2,)
