"""The pre-launch comparison of a server's model with the run's: every differing field named
with the run's key and both values."""

from __future__ import annotations

import json

from rlbatch.config.schema import RunConfig
from rlbatch.rollout.servers.model import check_server_model, model_differences, served_model

RUN = {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 260, "architectures": ["Q"]}


def test_equal_models_differ_in_nothing():
    assert model_differences(RUN, dict(RUN, dtype="float32"), "float32") == []


def test_each_differing_field_is_named_with_the_runs_key():
    served = dict(RUN, num_hidden_layers=3, hidden_size=128, dtype="bfloat16")
    assert model_differences(RUN, served, "float32") == [
        ("num_hidden_layers", "model.num_layers", 2, 3),
        ("hidden_size", "model.hidden_size", 64, 128),
        ("dtype", "rollout.vllm.dtype", "float32", "bfloat16"),
    ]


def _models(folder) -> dict:
    """A server's answer to GET /v1/models."""
    return {"data": [{"id": str(folder), "root": str(folder), "max_model_len": 64}]}


def test_the_served_model_is_read_from_the_servers_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(RUN, torch_dtype="float32")))
    assert served_model(_models(tmp_path)) == dict(RUN, torch_dtype="float32", dtype="float32")


def test_a_server_whose_directory_cannot_be_read_here_is_not_judged(tmp_path):
    assert served_model(_models(tmp_path / "elsewhere")) is None
    assert served_model({"data": []}) is None


def test_a_server_of_more_layers_is_an_error_naming_the_field(tmp_path):
    from rlbatch.engine.hf_config import hf_config_dict

    cfg = RunConfig()
    served = hf_config_dict(cfg.model) | {"num_hidden_layers": cfg.model.num_layers + 1}
    (tmp_path / "config.json").write_text(json.dumps(served))
    errors: list = []
    check_server_model(cfg, "http://h:1", _models(tmp_path), errors)
    assert len(errors) == 1
    text = str(errors[0])
    assert "rollout.servers.urls" in text and "http://h:1" in text
    n = cfg.model.num_layers
    assert f"num_hidden_layers: the run's {n} (model.num_layers), the server's {n + 1}" in text


def test_a_server_of_other_rope_and_norm_settings_is_an_error_naming_each_field(tmp_path):
    """Same shapes, other numerics: the sync would load whole and sample from another model."""
    from rlbatch.engine.hf_config import hf_config_dict

    cfg = RunConfig()
    served = hf_config_dict(cfg.model) | {
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(served))
    errors: list = []
    check_server_model(cfg, "http://h:1", _models(tmp_path), errors)
    assert len(errors) == 1
    text = str(errors[0])
    for field, key in (
        ("rope_theta", "model.rope_theta"), ("rms_norm_eps", "model.rms_norm_eps"),
        ("max_position_embeddings", "model.max_position_embeddings"),
        ("rope_scaling", "model.rope_scaling"),
    ):  # fmt: skip
        assert f"{field}: the run's " in text and f"({key}), the server's" in text, field
    assert "rope_theta: the run's 1000000.0 (model.rope_theta), the server's 10000.0" in text
