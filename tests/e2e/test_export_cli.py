"""rlbatch-export end to end: a tiny tp=2 rlbatch-train run from a transformers-made Qwen2
checkpoint, then the middle and the last checkpoint step exported to HF directories. The last
step equals the run's own end-of-run export (the live model) tensor for tensor; every export
loads with AutoModelForCausalLM.from_pretrained, carries the source's tokenizer files, and its
logits equal those of rlbatch-logprobs on it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
import transformers

from hf_reference import reference_logps, save_tiny  # noqa: E402

pytestmark = pytest.mark.e2e


def _run(cmd, cwd, env):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _tensors(path):
    from rlbatch.engine.hf import HFWeights

    weights = HFWeights(path)
    return {k: weights.get(k) for k in weights.weight_map}


def test_export_middle_step_of_tp2_run(tmp_path, bin_dir, subprocess_env):
    src = tmp_path / "src"
    save_tiny(src, "qwen2_theta")
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    run = tmp_path / "run"
    _run(
        [
            str(bin_dir / "rlbatch-train"), "+recipe=grpo_qwen", f"hydra.run.dir={run}",
            f"model.hf_path={src}", "model.tokenizer=bytes", "parallel.tp=2", "trainer.max_steps=2",
            "trainer.checkpoint.every_steps=1", "trainer.checkpoint.keep_last=2",
        ],
        tmp_path, subprocess_env,
    )  # fmt: skip
    exported = {}
    for step in (1, 2):
        out = tmp_path / f"step{step}"
        cmd = [str(bin_dir / "rlbatch-export"), str(run), "--out", str(out), "--step", str(step)]
        _run(cmd + ["--max-shard-size", "40KB"], tmp_path, subprocess_env)
        assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
        tokenizer_config = (out / "tokenizer_config.json").read_text()
        assert tokenizer_config == (src / "tokenizer_config.json").read_text()  # from the source
        # the source's generation_config.json, with the end ids the run stopped at: the byte
        # tokenizer's EOS 258 (a reader must stop where rollouts stopped) and its BOS 257
        source_gen = json.loads((src / "generation_config.json").read_text())
        gen = json.loads((out / "generation_config.json").read_text())
        assert gen == source_gen | {"eos_token_id": 258, "bos_token_id": 257}
        exported[step] = _tensors(out)
    live = _tensors(run / "hf")
    assert set(live) == set(exported[2])
    assert all(torch.equal(live[k], exported[2][k]) for k in live)
    assert any(not torch.equal(exported[1][k], exported[2][k]) for k in live)  # it trained

    # from_pretrained on the middle step == rlbatch-logprobs on it
    middle = tmp_path / "step1"
    model = transformers.AutoModelForCausalLM.from_pretrained(middle).float().eval()
    ids = torch.randint(0, 259, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    (tmp_path / "in.jsonl").write_text(json.dumps({"input_ids": ids}) + "\n")
    shutil.rmtree(tmp_path / "outputs", ignore_errors=True)
    _run(
        [
            str(bin_dir / "rlbatch-logprobs"), f"model.hf_path={middle}",
            f"logprobs.input={tmp_path / 'in.jsonl'}", f"logprobs.output={tmp_path / 'o.jsonl'}",
        ],
        tmp_path, subprocess_env,
    )  # fmt: skip
    ours = json.loads((tmp_path / "o.jsonl").read_text())["token_logprobs"]
    assert ours == pytest.approx(reference_logps(model, ids), abs=1e-4)
