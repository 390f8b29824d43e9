"""rlbatch-logprobs end to end on 2 processes against transformers in float64 on the same
local HF directory: Qwen2 with pp=2 + vpp=2 (packed infer plan), Qwen3 with tp=2, Llama-3
with pp=2."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from hf_reference import reference_logps, save_tiny, save_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.dist


def test_rlbatch_logprobs_pp2_vpp2(tmp_path, bin_dir, subprocess_env):
    ref = save_tiny_qwen2(tmp_path / "hf", num_layers=4)
    g = torch.Generator().manual_seed(1)
    rows = [
        {"input_ids": torch.randint(0, 259, (n,), generator=g).tolist()}
        for n in (9, 25, 4, 17, 30, 2)
    ]
    rows.insert(1, {"prompt": "7*6=", "completion": "42"})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [
        str(bin_dir / "rlbatch-logprobs"),
        f"model.hf_path={tmp_path / 'hf'}",
        f"logprobs.input={tmp_path / 'in.jsonl'}",
        f"logprobs.output={tmp_path / 'out.jsonl'}",
        "model.tokenizer=bytes",  # the text row: a model without tokenizer files
        "parallel.pp=2", "parallel.vpp=2",
        "batching.infer.mode=packed", "batching.infer.max_tokens=64",
        # the CLI validates the preset before the workers read config.json: match it
        "model.num_layers=4", "model.hidden_size=32", "model.ffn_hidden_size=64",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=subprocess_env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["index"] for o in out] == list(range(len(rows)))
    for o, row in zip(out, rows, strict=True):
        if "input_ids" in row:
            want = reference_logps(ref, row["input_ids"])
        else:
            p, c = list(row["prompt"].encode()), list(row["completion"].encode())
            want = reference_logps(ref, p + c)[len(p) - 1 :]
            assert o["completion_start"] == len(p)
        assert o["token_logprobs"] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(
    "variant,layout",
    [("qwen3", ["parallel.tp=2"]), ("llama3", ["parallel.pp=2"])],
)
def test_rlbatch_logprobs_qwen3_tp2_llama3_pp2(tmp_path, bin_dir, subprocess_env, variant, layout):
    """Qwen3 (QK-norm, head_dim != hidden / heads) split over tp=2 and Llama-3 (llama3 RoPE
    scaling, sequences past its original context) over pp=2, both saved by transformers 5."""
    ref = save_tiny(tmp_path / "hf", variant)
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, 259, (n,), generator=g).tolist() for n in (70, 9, 41)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    cmd = [
        str(bin_dir / "rlbatch-logprobs"), f"model.hf_path={tmp_path / 'hf'}",
        f"logprobs.input={tmp_path / 'in.jsonl'}", f"logprobs.output={tmp_path / 'out.jsonl'}",
        *layout,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=subprocess_env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    for o, ids in zip(out, rows, strict=True):
        assert o["token_logprobs"] == pytest.approx(reference_logps(ref, ids), abs=1e-4)
