"""Tokenizers: a built-in byte-level one (the tiny default) and a local HF tokenizer directory.

Both have the same interface: ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``eos_id``, ``eos_ids``, ``pad_id``, ``bos_id`` (or None), ``vocab_size``.

``eos_ids`` is the set of ids that end a response (``eos_id``, the tokenizer's primary EOS,
first): every rollout backend stops at any of them and every consumer of a response (rewards,
environments, truncation) reads this one set. :func:`build_tokenizer` adds
``model.extra_eos_token_ids`` to the tokenizer's own.

    tokenizer = build_tokenizer(cfg.model)   # tokenizer_path, else hf_path, else bytes

A directory's ``tokenizer.json`` is read by the ``tokenizers`` library; a directory with other
tokenizer files only (``vocab.json`` + ``merges.txt``, a sentencepiece ``tokenizer.model``) is
converted by ``transformers.AutoTokenizer`` to the same fast tokenizer. A model directory
(model.hf_path) never falls back to the byte tokenizer on its own: without a loadable tokenizer
:func:`tokenizer_errors` names the files found and the fix, before launch; ``model.tokenizer=
bytes`` chooses the byte tokenizer deliberately.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Protocol

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import ModelConfig, TokenizerSource


class Tokenizer(Protocol):
    eos_id: int
    eos_ids: tuple[int, ...]
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
        self.eos_ids: tuple[int, ...] = (self.EOS,)
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


TOKENIZER_FILE_NAMES = (
    "tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "vocab.txt", "tokenizer_config.json",
)  # fmt: skip
"""Files that make a directory a tokenizer's (tokenizer_config.json alone does not load)."""


def tokenizer_files(path: str | Path) -> list[str]:
    """The tokenizer files in ``path`` (TOKENIZER_FILE_NAMES order)."""
    return [name for name in TOKENIZER_FILE_NAMES if (Path(path) / name).is_file()]


BYTES_MARKER = "rlbatch_tokenizer.json"
"""Written by rlbatch's HF export of a run that used the byte tokenizer ({"tokenizer": "bytes"}):
the directory itself says which tokenizer its weights were trained with, so loading it under
``model.tokenizer=auto`` takes the byte tokenizer without a guess."""


def marks_bytes(path: str | Path) -> bool:
    """``path`` is an export of a byte-tokenizer run: the marker, and no tokenizer files."""
    marker = Path(path) / BYTES_MARKER
    if not marker.is_file() or tokenizer_files(path):
        return False
    try:
        return json.loads(marker.read_text()).get("tokenizer") == "bytes"
    except (ValueError, AttributeError):
        return False


class TokenizerLoadError(ValueError):
    """A directory's tokenizer files cannot be loaded; the message names them and the fix."""


def _backend(path: Path) -> Any:
    """The directory's ``tokenizers.Tokenizer``: tokenizer.json as is, else what
    transformers.AutoTokenizer converts the other files to (its fast tokenizer)."""
    from tokenizers import Tokenizer as _Tokenizer

    if (path / "tokenizer.json").is_file():
        return _Tokenizer.from_file(str(path / "tokenizer.json"))
    found = tokenizer_files(path)
    if not [f for f in found if f != "tokenizer_config.json"]:
        raise TokenizerLoadError(
            f"{path} has no tokenizer files (looked for {', '.join(TOKENIZER_FILE_NAMES[:-1])}):"
            " copy the model's tokenizer files there"
        )
    try:
        import transformers

        converted = transformers.AutoTokenizer.from_pretrained(str(path))
        backend = getattr(converted, "backend_tokenizer", None)
    except Exception as err:  # noqa: BLE001 - any failure of the conversion is reported
        raise TokenizerLoadError(
            f"{path} has {', '.join(found)} but no tokenizer.json, and transformers could not"
            f" load them ({type(err).__name__}: {str(err).strip()[:300]}): add tokenizer.json"
            " (tokenizer.save_pretrained(DIR) with transformers writes it), or install what the"
            " files need (pip install sentencepiece for a *.model file)"
        ) from err
    if backend is None:
        raise TokenizerLoadError(
            f"{path} has {', '.join(found)}: transformers loads them as a slow tokenizer only"
            " (no fast conversion): add tokenizer.json"
        )
    return backend


class HFTokenizer:
    """A local HF tokenizer directory (tokenizer.json via the ``tokenizers`` library, else the
    fast tokenizer transformers converts vocab.json + merges.txt or a sentencepiece model to).
    The EOS and PAD tokens come from tokenizer_config.json (eos_token / pad_token), else
    generation_config.json / config.json (eos_token_id); pad defaults to EOS. ``eos_ids``: that
    EOS, then every other id of generation_config.json's and config.json's eos_token_id (a chat
    model's end-of-turn token is often listed there), as Hugging Face's generate stops."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._tok = _backend(self.path)
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
        self.eos_ids = _unique((self.eos_id, *_listed_eos_ids(self.path)))
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


def _listed_eos_ids(path: Path) -> list[int]:
    """The eos_token_id entries (an int or a list) of config.json and generation_config.json."""
    out: list[int] = []
    for name in ("config.json", "generation_config.json"):
        if (path / name).is_file():
            listed = json.loads((path / name).read_text()).get("eos_token_id")
            out += [
                int(i) for i in (listed if isinstance(listed, list) else [listed]) if i is not None
            ]
    return out


def _unique(ids: Any) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids))


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


def tokenizer_source(model: ModelConfig) -> tuple[str, Optional[str]]:
    """(dotted key, directory) of the run's tokenizer: model.tokenizer_path, else model.hf_path;
    (key, None) for the built-in byte tokenizer (model.tokenizer=bytes, no directory at all, or
    a model.hf_path that rlbatch exported from a byte-tokenizer run: :data:`BYTES_MARKER`)."""
    if TokenizerSource(model.tokenizer) == TokenizerSource.bytes:
        return "model.tokenizer", None
    if model.tokenizer_path:
        return "model.tokenizer_path", model.tokenizer_path
    if model.hf_path:
        if marks_bytes(model.hf_path):
            return "model.hf_path", None  # rlbatch's export of a byte-tokenizer run
        return "model.hf_path", model.hf_path
    return "model.tokenizer", None


def tokenizer_errors(model: ModelConfig) -> list[ConfigError]:
    """Before launch: the run's tokenizer loads (its files found, what failed and the fix), and
    model.extra_eos_token_ids are ids of its vocabulary."""
    key, path = tokenizer_source(model)
    if path is None or not Path(path).is_dir():  # a missing directory is its own rule's error
        return _extra_eos_errors(model, ByteTokenizer().vocab_size) if path is None else []
    try:
        tokenizer = build_tokenizer(model)
    except TokenizerLoadError as err:
        fix = "set model.tokenizer_path=DIR (a tokenizer directory)"
        if key == "model.hf_path":
            fix += ", or model.tokenizer=bytes to train with the built-in byte tokenizer"
        return [ConfigError(key, path, f"{err}; or {fix}")]
    except ValueError as err:
        return [ConfigError(key, path, str(err))]
    return _extra_eos_errors(model, tokenizer.vocab_size)


def _extra_eos_errors(model: ModelConfig, vocab_size: int) -> list[ConfigError]:
    bad = [i for i in model.extra_eos_token_ids if not 0 <= int(i) < vocab_size]
    if not bad:
        return []
    return [
        ConfigError(
            "model.extra_eos_token_ids",
            list(model.extra_eos_token_ids),
            f"{bad} are outside the tokenizer's vocabulary (ids 0..{vocab_size - 1}): list ids"
            " of tokens that end a response (e.g. a chat model's end-of-turn token)",
        )
    ]


def build_tokenizer(model: ModelConfig) -> Tokenizer:
    """The tokenizer :func:`tokenizer_source` names (an HF directory never falls back to bytes:
    TokenizerLoadError). The model's vocabulary must cover the tokenizer's."""
    _, path = tokenizer_source(model)
    tokenizer: Tokenizer = HFTokenizer(path) if path else ByteTokenizer()
    tokenizer.eos_ids = _unique((*tokenizer.eos_ids, *model.extra_eos_token_ids))
    if tokenizer.vocab_size > model.vocab_size:
        raise ValueError(
            f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ({path or 'built-in bytes'}): raise model.vocab_size"
        )
    return tokenizer
