"""Built-in byte tokenizer and a local HF tokenizer directory (tokenizers library)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlbatch.config.schema import ModelConfig
from rlbatch.engine.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer


def test_byte_tokenizer_round_trip_and_fits_tiny_model():
    tok = build_tokenizer(ModelConfig())
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode("héllo 12")
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == "héllo 12"
    assert len({tok.eos_id, tok.pad_id, tok.bos_id}) == 3
    assert tok.vocab_size <= ModelConfig().vocab_size


def test_hf_tokenizer_dir(tmp_path):
    import tokenizers

    vocab = {"<pad>": 0, "<|endoftext|>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<pad>"})
    )
    hf = build_tokenizer(replace(ModelConfig(), tokenizer_path=str(tmp_path)))
    assert isinstance(hf, HFTokenizer)
    assert (hf.eos_id, hf.pad_id, hf.vocab_size) == (1, 0, 5)
    assert hf.encode("hello world") == [3, 4]
    assert hf.decode([3, 4, 1]) == "hello world"
    with pytest.raises(ValueError, match="model.vocab_size"):
        build_tokenizer(replace(ModelConfig(vocab_size=4), tokenizer_path=str(tmp_path)))
