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


def test_export_of_a_byte_tokenizer_run_loads_with_bytes_and_others_do_not(tmp_path):
    from rlbatch.engine.hf import write_side_files
    from rlbatch.engine.tokenizer import TokenizerLoadError, tokenizer_errors

    export = tmp_path / "export"
    export.mkdir()
    write_side_files(ModelConfig(), export)  # a random-init run: the byte tokenizer
    assert json.loads((export / "rlbatch_tokenizer.json").read_text()) == {"tokenizer": "bytes"}
    from_export = replace(ModelConfig(), hf_path=str(export))
    assert isinstance(build_tokenizer(from_export), ByteTokenizer)
    assert tokenizer_errors(from_export) == []

    # a model directory without the marker (a hub checkpoint missing its tokenizer) still stops
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(TokenizerLoadError, match="no tokenizer files"):
        build_tokenizer(replace(ModelConfig(), hf_path=str(bare)))
    # and real tokenizer files win over a stale marker
    (export / "vocab.json").write_text("{}")
    with pytest.raises(TokenizerLoadError):
        build_tokenizer(from_export)
