"""Before launch: does a rollout server serve the run's model?

A server of another shape (layers, widths, heads, vocabulary, architecture, tied head) or
dtype would take the first weight sync only in part: the update fails inside vLLM with a raw
error, or loads and leaves the server with weights of no model. One of the same shapes but
other RoPE or norm settings (rope_theta, rope_scaling, max_position_embeddings, rms_norm_eps)
takes the sync whole and samples every row from another model than the one trained. So rlbatch-train asks every
server what it serves and compares it, field by field, with the model the run's config
describes (the config.json rlbatch-serve writes for it), naming each field that differs.

What the server serves: ``GET /v1/models`` names its model directory (``root``), whose
config.json (the one rlbatch-serve wrote, with the dtype it serves in) is read when this
machine can read it, i.e. for a server of this machine or on a shared filesystem; a server
whose directory cannot be read here is left to the first sync's checks (an incomplete update,
the probe). vLLM's /server_info does not carry the model's config, and collecting its system
report can take longer than a pre-launch check may wait. The longest sequence the server holds
is rlbatch.rollout.servers.checks' own check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import RunConfig

FIELDS = (
    ("architectures", "model.architecture"),
    ("num_hidden_layers", "model.num_layers"),
    ("hidden_size", "model.hidden_size"),
    ("intermediate_size", "model.ffn_hidden_size"),
    ("num_attention_heads", "model.num_attention_heads"),
    ("num_key_value_heads", "model.num_query_groups"),
    ("head_dim", "model.head_dim"),
    ("vocab_size", "model.vocab_size"),
    ("tie_word_embeddings", "model.tie_word_embeddings"),
    ("rope_theta", "model.rope_theta"),
    ("rope_scaling", "model.rope_scaling"),
    ("max_position_embeddings", "model.max_position_embeddings"),
    ("rms_norm_eps", "model.rms_norm_eps"),
)
"""The Hugging Face config fields compared, and the run's config key each comes from. The
numeric ones (RoPE, the norms' epsilon) matter as much as the shapes: weights of the right
shapes take the sync whole, and the server then samples from another function of them, which
only the probe (when on, and when the difference exceeds its tolerance) would notice."""


def served_model(models: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The Hugging Face config a server serves, from its answer to ``GET /v1/models`` (the
    config.json of the model directory it names, when this machine can read it), with the
    ``dtype`` it serves in; None when that cannot be read."""
    try:
        folder = Path(str(models["data"][0]["root"]))
        config = json.loads((folder / "config.json").read_text())
    except (KeyError, IndexError, TypeError, OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    config["dtype"] = str(config.get("torch_dtype", config.get("dtype"))).removeprefix("torch.")
    return config


def model_differences(
    expected: dict[str, Any], served: dict[str, Any], dtype: str
) -> list[tuple[str, str, Any, Any]]:
    """(field, the run's config key, the run's value, the server's) of every field the served
    model differs in (fields either side does not state are not compared)."""
    out = []
    for name, key in FIELDS:
        if name in expected and name in served and expected[name] != served[name]:
            out.append((name, key, expected[name], served[name]))
    if served.get("dtype") not in (None, "None", "auto") and served["dtype"] != dtype:
        out.append(("dtype", "rollout.vllm.dtype", dtype, served["dtype"]))
    return out


def check_server_model(
    cfg: RunConfig, url: str, models: dict[str, Any], errors: list[ConfigError]
) -> None:
    """An error naming every field in which the model ``url`` serves (``models``: its answer
    to GET /v1/models) differs from the run's."""
    from rlbatch.config.vllm_rules import engine_dtype
    from rlbatch.engine.hf_config import hf_config_dict

    served = served_model(models)
    if served is None:
        return  # a server that does not say: the first sync's checks name it
    dtype = engine_dtype(cfg)
    expected = hf_config_dict(cfg.model, dtype)
    diffs = model_differences(expected, served, dtype)
    if not diffs:
        return
    fields = "; ".join(
        f"{name}: the run's {value!r} ({key}), the server's {theirs!r}"
        for name, key, value, theirs in diffs
    )
    errors.append(
        ConfigError(
            "rollout.servers.urls",
            url,
            f"serves another model than this run's: {fields}. Restart the server with"
            " rlbatch-serve and the run's recipe and overrides, or give the run the overrides"
            " the server was started with",
        )
    )
