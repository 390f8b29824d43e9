"""The built-in engine's per-row KV-cache decoder (multi-turn environments and agent harnesses
decode on it) computes an MoE policy as the trainer does: megatron's own MoE layer (router
top-k in fp32, norm_topk_prob, experts) on the decoder's tokens. Its log-probs over a
two-turn episode (prefill, decode, an observation appended on top of the cache, decode again)
equal transformers' float64 forward of the same weights, and the experts each token went to
are transformers' own (an expert flip near a top-k tie would show here, and is reported)."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

import pytest
import torch
from engine_helpers import megatron_world  # noqa: F401

from hf_reference import moe_reference
from rlbatch.config.schema import Architecture, RunConfig

TOL = 1e-5
EXPERTS, TOPK = 4, 2
FREQ = [1, 0, 1]  # a dense layer between two sparse ones


def _model():
    from rlbatch.engine.model import build_model

    cfg = RunConfig()
    m = cfg.model
    m.architecture, m.num_layers, m.hidden_size = Architecture.qwen3_moe, len(FREQ), 32
    m.num_attention_heads, m.num_query_groups, m.head_dim = 4, 2, 8
    m.ffn_hidden_size, m.vocab_size, m.qk_layernorm = 64, 264, True
    m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size = EXPERTS, TOPK, 16
    m.moe_layer_freq = FREQ
    m.add_qkv_bias, m.tie_word_embeddings = False, False  # as Qwen3-MoE
    torch.manual_seed(0)
    (chunk,) = build_model(cfg, wrap_ddp=False)
    with torch.no_grad():  # peaked logits, decisive and varied routing
        for name, p in chunk.named_parameters():
            p.add_((1.5 if "router" in name else 0.3) * torch.randn_like(p))
    return cfg, chunk.eval()


def _episode(decoder, rows):
    """Two rows in their own slots: prefill of each prompt, 5 decoded tokens, an observation
    of 4 tokens appended to row 0 alone (extend) while row 1 waits, then 4 more decoded tokens
    for both. Returns per row the log-probs of its next tokens, as decoding computed them, and
    each row's length fed."""
    got: list[list[float]] = [[], []]

    def take(logits, row_positions):
        for (row, pos), lp in zip(
            row_positions, torch.log_softmax(logits.double(), -1), strict=True
        ):
            got[row].append(float(lp[rows[row][pos + 1]]))

    lens = [7, 9]
    take(decoder.prefill([0, 1], [rows[0][:7], rows[1][:9]]), [(0, 6), (1, 8)])
    for _ in range(5):
        logits = decoder.decode(torch.tensor([rows[0][lens[0]], rows[1][lens[1]]]))
        take(logits, [(0, lens[0]), (1, lens[1])])
        lens = [n + 1 for n in lens]
    logits = decoder.extend([0], [rows[0][lens[0] : lens[0] + 4]])
    take(logits, [(0, lens[0] + 3)])
    lens[0] += 4
    for _ in range(4):
        feed = torch.tensor([rows[0][lens[0]], rows[1][lens[1]]])
        take(decoder.decode(feed, torch.tensor([0, 1])), [(0, lens[0]), (1, lens[1])])
        lens = [n + 1 for n in lens]
    return got, lens


def test_the_per_row_decoder_computes_the_moe_model_transformers_computes(megatron_world, tmp_path):
    """... and records each fed token's experts (what grpo.routing_replay=r3 replays):
    transformers' own top-k, token by token; a prompt shared by two slots, computed once,
    gives both its routing."""
    import transformers

    from rlbatch.engine import hf, routing
    from rlbatch.engine.generation import LeanDecoder

    cfg, chunk = _model()
    hf.export_hf([chunk], cfg.model, tmp_path)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(2, 260, (30,), generator=g).tolist() for _ in range(2)]
    with torch.no_grad(), torch.inference_mode():
        decoder = LeanDecoder(chunk, 2, 64, record_routing=True)
        got, lens = _episode(decoder, rows)
        # one past each row's fed length: the sample's last token, never fed, is -1
        records = [decoder.routing_of(slot, n + 1) for slot, n in enumerate(lens)]
        shared = LeanDecoder(chunk, 2, 64, record_routing=True)
        shared.prefill([0, 1], [rows[0][:7], rows[0][:7]])
        twins = [shared.routing_of(slot, 8) for slot in (0, 1)]
    routing.clear([chunk])

    want, _ = moe_reference(tmp_path, rows)
    # which positions' next-token log-prob the episode computed: every fed position whose
    # logits it read (the observation's last one only, as an extend returns)
    positions = [[6, 7, 8, 9, 10, 11, 15, 16, 17, 18, 19], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    errors = [
        abs(value - want[r][p])
        for r in (0, 1)
        for value, p in zip(got[r], positions[r], strict=True)
    ]
    assert len(errors) == 21 and lens == [20, 18]
    assert max(errors) <= TOL, f"max |decoder - transformers float64| = {max(errors):.2e}"

    # transformers' own top-k per sparse layer and token vs what the decoder recorded
    ref = (
        transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, experts_implementation="eager", attn_implementation="eager"
        )
        .double()
        .eval()
    )
    with torch.no_grad():
        logits = [ref(input_ids=torch.tensor([row]), output_router_logits=True).router_logits
                  for row in rows]  # fmt: skip
    top = torch.cat([lg.topk(TOPK + 1, -1).values for per_row in logits for lg in per_row])
    gap = float((top[:, TOPK - 1] - top[:, TOPK]).min())  # router logits: k-th minus (k+1)-th
    flips = compared = 0
    for row, record in enumerate(records):
        assert record.shape == (lens[row] + 1, 2, TOPK) and (record[-1] == -1).all()
        for layer, router_logits in enumerate(logits[row]):
            expected = router_logits.topk(TOPK, -1).indices
            for pos in range(lens[row]):
                compared += 1
                flips += set(record[pos, layer].tolist()) != set(expected[pos].tolist())
    print(f"max error {max(errors):.2e}; expert flips {flips} of {compared}; smallest top-k "
          f"logit gap {gap:.2e}")  # fmt: skip
    assert compared == 2 * 38 and flips == 0
    assert (twins[0] == twins[1]).all() and (twins[0][:7] == records[0][:7]).all()


def test_an_idle_forward_changes_no_slot(megatron_world):
    """The expert group's idle forward (a rank with nothing to decode while a peer decodes)
    leaves the decoder's caches and lengths as they were: the next decode is the same."""
    from rlbatch.engine.generation import LeanDecoder

    _, chunk = _model()
    ids = list(range(3, 15))
    with torch.no_grad(), torch.inference_mode():
        plain = LeanDecoder(chunk, 1, 32)
        plain.prefill([0], [ids])
        want = plain.decode(torch.tensor([5]))
        idled = LeanDecoder(chunk, 1, 32)
        idled.prefill([0], [ids])
        idled.idle()
        got = idled.decode(torch.tensor([5]))
    assert torch.equal(got, want) and idled.lens.tolist() == [13]


@pytest.mark.parametrize("dense", [True, False])
def test_single_turn_keeps_moe_on_the_lockstep_path(megatron_world, dense):
    """Single-turn rollouts of an MoE policy keep megatron's forward (it records the routing
    r3 replays); dense models take the continuous batch."""
    from rlbatch.engine import generation

    if dense:
        from rlbatch.engine.model import build_model

        (chunk,) = build_model(RunConfig(), wrap_ddp=False)
    else:
        _, chunk = _model()
    assert generation.lean_decoding_refusal([chunk]) == ""
    assert generation.lean_decoding_supported([chunk]) is dense
