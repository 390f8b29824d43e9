"""rlbatch-logprobs worker (in-process, world of 1) against transformers' Qwen2 in float64."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import megatron_world  # noqa: F401, E402

from hf_reference import reference_logps, save_tiny_qwen2  # noqa: E402
from rlbatch.config.schema import BatchingMode, RunConfig, TokenizerSource  # noqa: E402
from rlbatch.engine.tokenizer import ByteTokenizer  # noqa: E402
from rlbatch.jobs import logprobs as logprobs_job  # noqa: E402


def test_logprobs_job_matches_transformers(megatron_world, tmp_path):
    ref = save_tiny_qwen2(tmp_path / "hf", num_layers=2)
    g = torch.Generator().manual_seed(5)
    rows = [
        {"input_ids": torch.randint(0, 259, (n,), generator=g).tolist()} for n in (9, 2, 30, 14)
    ]
    rows.insert(2, {"prompt": "12+3=", "completion": "15 ok"})
    rows.append({"input_ids": [7]})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))

    cfg = RunConfig()
    cfg.model.hf_path = str(tmp_path / "hf")
    cfg.model.tokenizer = TokenizerSource.bytes  # the text row; the model has no tokenizer files
    cfg.logprobs.input, cfg.logprobs.output = str(src), str(tmp_path / "out" / "lp.jsonl")
    cfg.logprobs.entropy = True
    cfg.batching.infer.mode = BatchingMode.packed
    cfg.batching.infer.max_tokens = 32
    cfg.logging.progress = False
    logprobs_job.run(cfg)

    out = [json.loads(line) for line in open(cfg.logprobs.output)]
    assert [o["index"] for o in out] == list(range(len(rows)))
    tok = ByteTokenizer()
    for o, row in zip(out, rows, strict=True):
        if "input_ids" in row:
            ids = row["input_ids"]
            want = reference_logps(ref, ids) if len(ids) > 1 else []
            assert "completion_start" not in o
        else:
            prompt, completion = tok.encode(row["prompt"]), tok.encode(row["completion"])
            ids = prompt + completion
            assert o["completion_start"] == len(prompt)
            want = reference_logps(ref, ids)[len(prompt) - 1 :]
            assert len(want) == len(completion)
        assert len(o["token_logprobs"]) == len(want) == len(o["entropy"])
        assert o["token_logprobs"] == pytest.approx(want, abs=1e-4)


def test_routing_rows_are_checked_naming_each_bad_row():
    moe = RunConfig().model
    moe.num_moe_experts, moe.moe_router_topk, moe.num_layers = 4, 2, 2
    rows = [
        logprobs_job.Row([1, 2], None, [[[0, 1], [2, 3]], [[1, 2], [-1, -1]]]),  # fine
        logprobs_job.Row([1, 2, 3], None, [[[0, 1], [2, 3]]]),  # one token of three
        logprobs_job.Row([1], None, [[[0, 4], [1, 2]]]),  # expert 4 of 4
        logprobs_job.Row([5], None),  # routes freely
        logprobs_job.Row([1], None, [[[0, -1], [1, 2]]]),  # one of k unknown: no router did
        logprobs_job.Row([1], None, [[[3, 1], [1, 1]]]),  # expert 1 twice for one token
    ]
    with pytest.raises(ValueError) as info:
        logprobs_job.routing_arrays(rows, moe, "in.jsonl")
    message = str(info.value)
    assert "row 1: routing of shape (1, 2, 2), expected (3 tokens" in message
    assert "row 2: expert ids must be in [-1, 4)" in message and "row 0" not in message
    assert "row 4: token 0, MoE layer 0: [0, -1] mixes -1 with expert ids" in message
    assert "row 5: token 0, MoE layer 1: [1, 1] names an expert twice" in message
    arrays = logprobs_job.routing_arrays([rows[0], rows[3]], moe, "in.jsonl")
    assert arrays is not None and arrays[1] is None and arrays[0].shape == (2, 2, 2)
    with pytest.raises(ValueError, match="needs an MoE model"):
        logprobs_job.routing_arrays(rows[:1], RunConfig().model, "in.jsonl")
