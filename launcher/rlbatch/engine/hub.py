"""``model.hf_path`` as a Hugging Face hub id: resolved to a local snapshot directory through
huggingface_hub's cache (downloaded when the network allows; the cache alone with
``HF_HUB_OFFLINE=1``). A local directory is returned as it is.

    path = resolve_hf_path("Qwen/Qwen3-0.6B")   # .../models--Qwen--Qwen3-0.6B/snapshots/<rev>
"""

from __future__ import annotations

from pathlib import Path

from rlbatch.config.errors import ConfigError, ConfigErrors
from rlbatch.config.hub_id import looks_like_hub_id

MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")
"""What a snapshot download fetches: configs, weights, tokenizer files (no .bin / .pth)."""


def resolve_hf_path(value: str | Path, key: str = "model.hf_path") -> Path:
    """A local directory for ``value`` (a directory, or a hub id fetched into the hub cache).
    Failures are ConfigErrors naming ``key``, the id and how to pre-download it."""
    value = str(value)
    if not looks_like_hub_id(value):
        return Path(value)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigErrors(
            [ConfigError(key, value, "a hub id needs huggingface_hub: pip install huggingface_hub")]
        ) from None
    try:
        return Path(snapshot_download(value, allow_patterns=list(MODEL_FILES)))
    except Exception as err:  # offline without a cache, unknown id, network error, ...
        raise ConfigErrors(
            [
                ConfigError(
                    key,
                    value,
                    f"cannot get this hub model ({type(err).__name__}: {str(err)[:200]}). "
                    f"Pre-download it where the network is reachable with "
                    f"`huggingface-cli download {value}` (same HF_HOME / HF_HUB_CACHE), or pass "
                    "a local directory",
                )
            ]
        ) from None
