"""The partial-rollout stream on a real megatron-core GPTModel (tiny Qwen2 shape): rows that
outlive a round go on under the next round's weights.

References are independent of the stream: every sampled token's behaviour log-prob must be the
log-softmax of a full causal forward (float64 softmax) over prompt + the tokens before it, under
the weights of the version the token records; delivery order, staleness bounds and occupancy are
recounted from the delivered rows."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from model_reference import full_logps
from rlbatch.config.schema import RunConfig
from rlbatch.engine.generation import LeanDecoder, inference_mode
from rlbatch.engine.tokenizer import ByteTokenizer
from rlbatch.rollout.partial import PartialRolloutStream
from rlbatch.rollout.sampling import SamplingParams

EOS = ByteTokenizer.EOS
G, N = 3, 2  # rows per group, groups per round


@pytest.fixture(scope="module")
def model():
    from rlbatch.bench.rollout_env import turn_ending_policy

    cfg = RunConfig()
    cfg.model.init_method_std = 0.3
    return turn_ending_policy(cfg)


@pytest.fixture(scope="module")
def versions(model):
    """Weights of policy versions 0..7: the base weights plus v times a fixed perturbation."""
    base = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    g = torch.Generator().manual_seed(3)
    delta = {k: 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()
             if v.is_floating_point()}  # fmt: skip
    out = [{k: v + i * delta[k] if k in delta else v for k, v in base.items()} for i in range(8)]
    yield out
    model.load_state_dict(base, strict=False)


PROMPTS = [tuple(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist())
           for n in (5, 9, 3, 7, 4, 6, 8, 2)]  # fmt: skip


def make_stream(*, lead=1, slack=0, slots=4, median=4, seed=5):
    def draw():  # the stream's q-th draw (its draw count is part of its state)
        q = len(stream.draws)
        ids = tuple((q * N + i) % len(PROMPTS) for i in range(N))
        return ids, tuple(100 + q * N + i for i in range(N)), q * N

    params = SamplingParams(16, eos_id=EOS, length_median=median, length_sigma=1.0)
    stream = PartialRolloutStream(
        draw, lambda i: PROMPTS[i], params, num_generations=G, groups_per_round=N,
        num_slots=slots, lead=lead, slack=slack, seed=seed, max_len=9 + 16,
    )  # fmt: skip
    return stream


def run_rounds(stream, model, versions, rounds):
    """Round r is decoded by version r; returns [(round, delivered groups, stats)]."""
    out = []
    for r in range(stream.round_index, stream.round_index + rounds):
        model.load_state_dict(versions[r], strict=False)
        with inference_mode([model]):
            res = stream.run_round(r, lambda n, length: LeanDecoder(model, n, length))
        out.append((r, res.groups, res.stats))
    return out


def test_every_token_is_its_own_versions_sample(model, versions):
    """Rows continued across a swap record each token's version, and each behaviour log-prob
    is that version's full forward over the whole prefix: the caches were recomputed."""
    rounds = run_rounds(make_stream(), model, versions, 6)
    continued = 0
    for _, groups, _ in rounds:
        for g in groups:
            for row in g.rows:
                assert len(row.ids) == len(row.logps) == len(row.versions) >= 1
                assert row.versions == sorted(row.versions)
                continued += len(set(row.versions)) > 1
                seq = [*PROMPTS[g.prompt_index], *row.ids]
                p = len(PROMPTS[g.prompt_index])
                for v in sorted(set(row.versions)):
                    model.load_state_dict(versions[v], strict=False)
                    ref = full_logps(model, seq)
                    for j, (tok, ver) in enumerate(zip(row.ids, row.versions, strict=True)):
                        if ver == v:
                            assert row.logps[j] == pytest.approx(
                                ref[p + j - 1, tok].item(), abs=2e-4
                            )
    assert continued >= 3, "too few rows outlived a round to test the swap"


def test_batch_granularity_trains_each_draw_whole_and_in_order(model, versions):
    rounds = run_rounds(make_stream(lead=1, slack=0), model, versions, 5)
    for r, groups, _ in rounds:
        assert [g.group_id for g in groups] == [100 + r * N + i for i in range(N)]
        for g in groups:  # a row starts at most `lead` rounds before the round training it
            assert min(v for row in g.rows for v in row.versions) >= r - 1


def test_group_granularity_delivers_every_group_once_within_the_bound(model, versions):
    stream = make_stream(lead=1, slack=1)
    rounds = run_rounds(stream, model, versions, 6)
    seen = []
    for r, groups, _ in rounds:
        assert len(groups) == N
        for g in groups:
            draw = (g.group_id - 100) // N
            assert r <= draw + 1  # delivered by its draw's round + slack
            assert min(v for row in g.rows for v in row.versions) >= r - 2  # lead + slack
            seen.append(g.group_id)
    assert len(seen) == len(set(seen))
    # nothing is dropped: every row started is delivered or still in the stream
    assert stream.started_rows == stream.delivered_rows + stream.started_in_stream()
    order = [(g.group_id - 100) // N for _, groups, _ in rounds for g in groups]
    assert order != sorted(order), "the first groups to finish never overtook an earlier draw"


@pytest.mark.parametrize("slack", [0, 1])
def test_a_stream_restored_between_rounds_continues_exactly(model, versions, slack):
    straight = run_rounds(make_stream(slack=slack, lead=1, seed=8), model, versions, 5)
    first = make_stream(slack=slack, lead=1, seed=8)  # seed 8: rows in flight after round 2
    head = run_rounds(first, model, versions, 2)
    state = pickle.loads(pickle.dumps(copy.deepcopy(first.state_dict())))
    assert any(s for s in state["running"]), "no row in flight at the checkpoint"
    second = make_stream(slack=slack, lead=1, seed=8)
    second.load_state_dict(state)
    tail = run_rounds(second, model, versions, 3)

    def rows(rounds):
        return [(g.group_id, row.ids, row.logps, row.versions)
                for _, groups, _ in rounds for g in groups for row in g.rows]  # fmt: skip

    assert rows(head + tail) == rows(straight)


def test_slots_stay_busy_where_rounds_wait_for_their_longest_row(model, versions):
    """Occupancy: the stream's decode steps against those of decoding each round's rows
    together until the longest ends (busy row-slots / (steps x rows), counted from the rows).
    A lead of 2 rounds gives the slots enough rows to start while a round's longest decodes."""
    stream = make_stream(slots=6, median=5, lead=2, seed=6)
    rounds = run_rounds(stream, model, versions, 6)
    busy = sum(s.busy_slot_steps for _, _, s in rounds[1:])
    total = sum(s.slot_steps for _, _, s in rounds[1:])
    assert busy / total >= 0.9
    lengths = [[len(row.ids) for g in groups for row in g.rows] for _, groups, _ in rounds]
    round_based = sum(sum(x) for x in lengths) / sum(max(x) * len(x) for x in lengths)
    assert busy / total > round_based + 0.2
