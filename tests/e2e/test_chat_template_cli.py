"""data.chat_template=model through the real rlbatch-train: the prompts are rendered by the
tokenizer's own template (a tokenizer made in the test). The run is stopped before launch by
the dataset check of data.max_prompt_len, which reports each prompt's templated token count:
it must be the count of transformers' apply_chat_template(tokenize=True,
add_generation_prompt=True)."""

from __future__ import annotations

import json
import subprocess

import pytest
import transformers

from hf_reference import save_chat_tokenizer  # noqa: E402

pytestmark = pytest.mark.e2e


def test_rlbatch_train_renders_the_model_template(tmp_path, bin_dir, subprocess_env):
    tok_dir = save_chat_tokenizer(tmp_path / "tok")
    prompts = [
        [{"role": "system", "content": "add."}, {"role": "user", "content": "two plus two"}],
        "three plus one",
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "4"}) + "\n" for p in prompts))
    theirs = transformers.AutoTokenizer.from_pretrained(tok_dir)
    counts = [
        len(
            theirs.apply_chat_template(
                [{"role": "user", "content": p}] if isinstance(p, str) else p,
                tokenize=True, add_generation_prompt=True, return_dict=False,
            )
        )
        for p in prompts
    ]  # fmt: skip
    cmd = [
        str(bin_dir / "rlbatch-train"), "+recipe=grpo_qwen", f"hydra.run.dir={tmp_path / 'run'}",
        "data.source=jsonl", f"data.path={data}", "data.chat_template=model",
        "data.reward=exact_match", f"model.tokenizer_path={tok_dir}", "data.max_prompt_len=8",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=subprocess_env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2  # the pre-launch dataset check: nothing was run
    text = " ".join((proc.stdout + proc.stderr).split())
    for line, n in enumerate(counts, 1):
        expected = f"line {line}: prompt is {n} tokens (chat template included)"
        assert expected in text, text[-3000:]
