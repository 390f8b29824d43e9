"""Which tokenizer rlbatch-train uses for a model directory (model.hf_path), through the real
command: a directory with vocab.json + merges.txt and no tokenizer.json is tokenized with those
files (the prompt counts of the pre-launch dataset check are transformers'), and a directory
whose tokenizer cannot be loaded, or that has none, stops the run before launch naming the
files found and the fix. The byte tokenizer is never chosen silently."""

from __future__ import annotations

import json
import subprocess

import pytest
import transformers

from hf_reference import save_qwen_style_tokenizer, save_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.e2e

PROMPTS = ["the answer is 42", "what does the tool say?"]


def _train(bin_dir, env, tmp_path, model_dir, *overrides):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "42"}) + "\n" for p in PROMPTS))
    cmd = [
        str(bin_dir / "rlbatch-train"), "+recipe=grpo_qwen", f"hydra.run.dir={tmp_path / 'run'}",
        f"model.hf_path={model_dir}", "data.source=jsonl", f"data.path={data}",
        "data.chat_template=none", "data.reward=exact_match", *overrides,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return proc, " ".join((proc.stdout + proc.stderr).split())


def test_vocab_and_merges_directory_tokenizes_with_its_own_files(tmp_path, bin_dir, subprocess_env):
    """Stopped by data.max_prompt_len=2, the check reports each prompt's count: transformers'
    count for these files (not the byte count the built-in fallback gave)."""
    model_dir = tmp_path / "model"
    save_tiny_qwen2(model_dir, num_layers=2)
    save_qwen_style_tokenizer(model_dir, as_vocab_merges=True)
    assert not (model_dir / "tokenizer.json").exists()
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    counts = [len(theirs.encode(p, add_special_tokens=False)) for p in PROMPTS]
    assert counts != [len(p.encode()) for p in PROMPTS]  # the byte tokenizer would differ
    proc, text = _train(bin_dir, subprocess_env, tmp_path, model_dir, "data.max_prompt_len=2")
    assert proc.returncode == 2, text[-3000:]
    for line, n in enumerate(counts, 1):
        assert f"line {line}: prompt is {n} tokens" in text, text[-3000:]
    assert not (tmp_path / "run" / "errors").exists()  # nothing launched


@pytest.mark.parametrize("files", ["sentencepiece", "none"])
def test_unloadable_or_missing_tokenizer_stops_before_launch(
    tmp_path, bin_dir, subprocess_env, files
):
    model_dir = tmp_path / "model"
    save_tiny_qwen2(model_dir, num_layers=2)
    if files == "sentencepiece":  # a sentencepiece model transformers cannot convert here
        (model_dir / "tokenizer.model").write_bytes(b"\x0a\x03not a sentencepiece model")
        (model_dir / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "LlamaTokenizer", "eos_token": "</s>"})
        )
    proc, text = _train(bin_dir, subprocess_env, tmp_path, model_dir)
    assert proc.returncode == 2, text[-3000:]
    assert f"model.hf_path={model_dir}" in text
    assert "model.tokenizer=bytes" in text and "model.tokenizer_path=DIR" in text
    if files == "sentencepiece":
        assert "has tokenizer.model, tokenizer_config.json but no tokenizer.json" in text
        assert "pip install sentencepiece" in text
    else:
        assert "has no tokenizer files" in text
    assert not (tmp_path / "run" / "errors").exists()  # nothing launched
    # asked for: the byte tokenizer passes the same checks (the prompts fit in bytes)
    if files == "none":
        proc, text = _train(
            bin_dir, subprocess_env, tmp_path, model_dir, "model.tokenizer=bytes",
            "data.max_prompt_len=2",
        )  # fmt: skip
        assert proc.returncode == 2
        assert f"line 1: prompt is {len(PROMPTS[0].encode())} tokens" in text
