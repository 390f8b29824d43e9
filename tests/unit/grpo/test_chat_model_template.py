"""data.chat_template=model renders the model's own jinja template like transformers'
apply_chat_template(add_generation_prompt=True) (a tokenizer made here, no download); the
byte tokenizer keeps the built-in ChatML."""

from __future__ import annotations

import json

import pytest
import transformers

from hf_reference import save_chat_tokenizer  # noqa: E402
from rlbatch.config.schema import ChatTemplate  # noqa: E402
from rlbatch.engine.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402
from rlbatch.grpo.chat import apply_chat_template, render_qwen  # noqa: E402

CONVERSATIONS = [
    "what is two plus two?",
    [{"role": "system", "content": "You count."}, {"role": "user", "content": " count to 3 "}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "skip"},
     {"role": "user", "content": "b"}],
]  # fmt: skip


@pytest.mark.parametrize("as_file", [False, True])
@pytest.mark.parametrize("prompt", CONVERSATIONS)
def test_model_template_matches_transformers(tmp_path, as_file, prompt):
    path = save_chat_tokenizer(tmp_path, as_file)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ours = HFTokenizer(path)
    text = apply_chat_template(ChatTemplate.model, prompt, ours)
    assert text == want
    assert ours.encode(text) == theirs.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_template_errors_and_byte_tokenizer_fallback(tmp_path):
    path = save_chat_tokenizer(tmp_path, as_file=False)
    with pytest.raises(Exception, match="bad role tool"):
        apply_chat_template(
            ChatTemplate.model, [{"role": "tool", "content": "x"}], HFTokenizer(path)
        )
    assert apply_chat_template(ChatTemplate.model, "hi", ByteTokenizer()) == render_qwen("hi")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ValueError, match="has no chat_template"):
        apply_chat_template(ChatTemplate.model, "hi", HFTokenizer(path))
