"""data.chat_template=model renders the model's own jinja template like transformers'
apply_chat_template(add_generation_prompt=True) (a tokenizer made here, no download); the
byte tokenizer keeps the built-in ChatML."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from rlbatch.config.schema import ChatTemplate  # noqa: E402
from rlbatch.engine.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402
from rlbatch.grpo.chat import apply_chat_template, render_qwen  # noqa: E402

# Llama-3 style: bos variable, loop controls, tojson, raise_exception, a system default
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system = 'Be brief.' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ system }}<|eot_id|>\n"
    "{% for m in loop_messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% if m['content'] == 'skip' %}{% continue %}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
    "<|eot_id|>\n{% endfor %}{{ {'n': loop_messages | length} | tojson }}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]


def _tokenizer_dir(tmp_path, as_file: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(set("abcdefghijklmnopqrstuvwxyz .,?!'\"{}:0123")))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_special_tokens(SPECIALS)
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": {
            "__type": "AddedToken",
            "content": "<|eot_id|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },  # fmt: skip
    }
    if as_file:
        (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    else:
        config["chat_template"] = TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


CONVERSATIONS = [
    "what is two plus two?",
    [{"role": "system", "content": "You count."}, {"role": "user", "content": " count to 3 "}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "skip"},
     {"role": "user", "content": "b"}],
]  # fmt: skip


@pytest.mark.parametrize("as_file", [False, True])
@pytest.mark.parametrize("prompt", CONVERSATIONS)
def test_model_template_matches_transformers(tmp_path, as_file, prompt):
    path = _tokenizer_dir(tmp_path, as_file)
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
    path = _tokenizer_dir(tmp_path, as_file=False)
    with pytest.raises(Exception, match="bad role tool"):
        apply_chat_template(
            ChatTemplate.model, [{"role": "tool", "content": "x"}], HFTokenizer(path)
        )
    assert apply_chat_template(ChatTemplate.model, "hi", ByteTokenizer()) == render_qwen("hi")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ValueError, match="has no chat_template"):
        apply_chat_template(ChatTemplate.model, "hi", HFTokenizer(path))
