"""Tokenizers: a built-in byte-level one (the tiny default) and a local HF tokenizer directory.

Both have the same interface: ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``eos_id``, ``pad_id``, ``bos_id`` (or None), ``vocab_size``.

    tokenizer = build_tokenizer(cfg.model)   # tokenizer_path, else hf_path, else bytes
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Protocol

from rlbatch.config.schema import ModelConfig


class Tokenizer(Protocol):
    eos_id: int
    pad_id: int
    bos_id: Optional[int]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255, then pad (256), bos (257), eos (258): vocab 259 (fits the tiny
    model's 264). ``encode`` adds no specials; ``decode`` drops them."""

    PAD, BOS, EOS = 256, 257, 258

    def __init__(self) -> None:
        self.pad_id, self.eos_id = self.PAD, self.EOS
        self.bos_id: Optional[int] = self.BOS
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def _special_id(tok: Any, value: Any) -> Optional[int]:
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, str):
        return tok.token_to_id(value)
    return None


class HFTokenizer:
    """A local HF tokenizer directory (tokenizer.json, via the ``tokenizers`` library). The EOS
    and PAD tokens come from tokenizer_config.json (eos_token / pad_token), else
    generation_config.json / config.json (eos_token_id); pad defaults to EOS."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self.path = Path(path)
        file = self.path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (set model.tokenizer_path)")
        self._tok = _Tokenizer.from_file(str(file))
        meta: dict[str, Any] = {}
        for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
            if (self.path / name).is_file():
                meta.update(json.loads((self.path / name).read_text()))
        eos = _special_id(self._tok, meta.get("eos_token"))
        if eos is None:
            eos_ids = meta.get("eos_token_id")
            eos = eos_ids[0] if isinstance(eos_ids, list) else eos_ids
        if eos is None:
            raise ValueError(f"{path}: no eos_token / eos_token_id in the tokenizer's configs")
        pad = _special_id(self._tok, meta.get("pad_token"))
        self.eos_id = int(eos)
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.bos_id = _special_id(self._tok, meta.get("bos_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = _chat_template(self.path, meta.get("chat_template"))
        """The model's jinja chat template (data.chat_template=model), or None."""
        self.special_tokens = {
            key: _token_text(meta[key])
            for key in SPECIAL_TOKENS
            if _token_text(meta.get(key)) is not None
        }
        """bos_token, eos_token, ... as text: variables of the chat template."""

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")  # fmt: skip


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, configured: Any) -> Optional[str]:
    """chat_template.jinja, else tokenizer_config.json's chat_template (a string, or a list of
    named templates: the one named "default")."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if isinstance(configured, list):
        named = {t.get("name"): t.get("template") for t in configured if isinstance(t, dict)}
        configured = named.get("default")
    return configured if isinstance(configured, str) else None


def build_tokenizer(model: ModelConfig) -> Tokenizer:
    """model.tokenizer_path, else model.hf_path (when it has a tokenizer.json), else the
    built-in byte tokenizer. The model's vocabulary must cover the tokenizer's."""
    path = model.tokenizer_path
    if path is None and model.hf_path and (Path(model.hf_path) / "tokenizer.json").is_file():
        path = model.hf_path
    tokenizer: Tokenizer = HFTokenizer(path) if path else ByteTokenizer()
    if tokenizer.vocab_size > model.vocab_size:
        raise ValueError(
            f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ({path or 'built-in bytes'}): raise model.vocab_size"
        )
    return tokenizer
