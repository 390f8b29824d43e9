"""Each validation rule rejects its bad config with a message naming the dotted key, and all
errors are reported at once, before anything heavy runs."""

from __future__ import annotations

import subprocess

import pytest

from rlbatch.cli.common import compose
from rlbatch.config.errors import ConfigErrors
from rlbatch.config.load import check_structure, load_run_config, to_container
from rlbatch.config.schema import RunConfig
from rlbatch.config.validate import check, validate

BASE = ["+recipe=grpo_qwen"]

# (overrides, dotted key that must be named, a word of the fix)
CASES = [
    (["+trainer.max_stepz=3"], "trainer.max_stepz", "trainer.max_steps"),
    (["trainer.max_steps=abc"], "trainer.max_steps", "integer"),
    (["logging.progress=maybe"], "logging.progress", "true or false"),
    (["batching.train.mode=dynamc"], "batching.train.mode", "packed"),
    (["grpo.scale_rewards=std"], "grpo.scale_rewards", "group"),
    (["trainer.max_steps=0"], "trainer.max_steps", "positive"),
    (["batching.infer.max_tokens=-1"], "batching.infer.max_tokens", "positive"),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens", "positive"),
    (
        ["grpo.aggregation.ref_logps_micro_batch_size=0"],
        "grpo.aggregation.ref_logps_micro_batch_size",
        "positive",
    ),
    (
        ["parallel.tp=2", "batching.train.sequence_length_round=3"],
        "batching.train.sequence_length_round",
        "multiple",
    ),
    (["batching.train.max_tokens=16"], "batching.train.max_tokens", "oversize"),
    (["parallel.vpp=2"], "parallel.vpp", "pp"),
    (["parallel.pp=2", "parallel.vpp=2", "model.num_layers=6"], "model.num_layers", "divisible"),
    (["grpo.num_generations=6"], "grpo.global_batch_size", "multiple"),
    (
        ["grpo.steps_per_generation=2", "grpo.generation_batch_size=128"],
        "grpo.generation_batch_size",
        "exclusive",
    ),
    (["parallel.dp=2", "parallel.nproc_per_node=1"], "parallel.nproc_per_node", "tp*pp*cp*dp"),
    (["grpo.aggregation.train_micro_batch_size=16"], "grpo.aggregation", "LCM"),
    (["grpo.num_generations=1"], "grpo.num_generations", ">= 2"),
    (["grpo.num_steps_async=2", "grpo.max_staleness=1"], "grpo.max_staleness", "num_steps_async"),
    (["data=jsonl"], "data.path", "data.path"),
    (["trainer.resume=/nonexistent/ckpt"], "trainer.resume", "auto"),
    (["data.reward_weights=[1.0,abc]"], "data.reward_weights[1]", "number"),
    (["data.source=hf_disk", "data.path=/nonexistent"], "data.path", "save_to_disk"),
    (["env=calculator", "parallel.tp=2"], "parallel.tp", "env.path=null"),
    (["env=calculator", "parallel.pp=2", "model.num_layers=2"], "parallel.pp", "KV"),
    (["env=calculator", "rollout.kv_cache=false"], "rollout.kv_cache", "env.path"),
    (["env=calculator", "env.max_total_tokens=16"], "env.max_total_tokens", "no room"),
    (["env=calculator", "env.max_turns=0"], "env.max_turns", "positive"),
    (["env=calculator", "env.kwargs=3"], "env.kwargs", "mapping"),
    (["env=calculator", "env.on_error=ignore"], "env.on_error", "zero_reward"),
    (["data.served.on_error=skip"], "data.served.on_error", "zero_reward"),
    (
        ["env=calculator", "env.max_total_tokens=1000", "batching.train.max_tokens=512"],
        "batching.train.max_tokens",
        "env.max_total_tokens = 1000",
    ),
    (["model.logits_chunk_tokens=-1"], "model.logits_chunk_tokens", ">= 0"),
    (["debug.response_length_median=-1"], "debug.response_length_median", "[0, rollout"),
    (
        ["debug.response_length_median=17"],  # the recipe's rollout.max_new_tokens is 16
        "debug.response_length_median",
        "max_new_tokens=16",
    ),
    (["debug.response_length_sigma=0"], "debug.response_length_sigma", "> 0"),
    (["env=calculator", "debug.response_length_median=4"], "env.path", "single-turn"),
    (
        ["rollout.backend=megatron_dynamic", "debug.response_length_median=4"],
        "rollout.backend",
        "built-in engine",
    ),
]


def test_list_keys_take_one_value_or_a_list(tmp_path):
    """data.reward_fn=f.py:fn is a one-element list; lists survive resolved.yaml."""
    from rlbatch.config.load import dump_run_config

    cfg = compose(BASE + ["data.reward_fn=f.py:fn", "logging.wandb.tags=[a,b]"], "t")
    assert cfg.data.reward_fn == ["f.py:fn"] and cfg.logging.wandb.tags == ["a", "b"]
    dump_run_config(cfg, tmp_path / "resolved.yaml")
    assert load_run_config(tmp_path / "resolved.yaml") == cfg


def _errors_for(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.store import conf_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=BASE + overrides)
    container = OmegaConf.to_container(cfg, resolve=True)
    with pytest.raises(ConfigErrors) as info:
        check(*check_structure(container))
    return info.value


@pytest.mark.parametrize(("overrides", "key", "fix"), CASES, ids=[c[1] for c in CASES])
def test_rule_names_key_and_fix(overrides, key, fix):
    err = _errors_for(overrides)
    matching = [e for e in err.errors if e.key == key]
    assert matching, f"no error for {key}: {err}"
    assert fix in str(matching[0])


def test_every_error_reported_at_once():
    err = _errors_for(
        ["trainer.max_steps=abc", "+grpo.typo=1", "parallel.vpp=2", "batching.train.max_tokens=16"]
    )
    keys = {e.key for e in err.errors}
    assert {"trainer.max_steps", "grpo.typo", "parallel.vpp", "batching.train.max_tokens"} <= keys


def test_another_checks_error_hides_no_rule_on_the_same_key():
    """An error rlbatch-train's own checks found on a key (the dataset, the reward, the
    environment) is reported beside the rules' errors on that key, not instead of them; an
    error that left the key at its default (a bad type) still hides the rule's verdict on
    that default."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.errors import ConfigError
    from rlbatch.config.store import conf_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=[*BASE, "batching.train.max_tokens=16"])
    run_cfg, structural = check_structure(OmegaConf.to_container(cfg, resolve=True))
    other = ConfigError("batching.train.max_tokens", 16, "another check's own problem")
    with pytest.raises(ConfigErrors) as info:
        check(run_cfg, structural, found=[other, other])
    on_key = [e for e in info.value.errors if e.key == "batching.train.max_tokens"]
    assert on_key[0] == other and len(on_key) == 2  # the repeat dropped, the rule kept
    assert "oversize" in on_key[1].message
    with pytest.raises(ConfigErrors) as info:
        check(run_cfg, [other])
    assert info.value.errors == [other]


def test_oversize_isolate_allows_small_budget():
    cfg = compose(BASE + ["batching.train.max_tokens=16", "batching.train.oversize=isolate"], "t")
    assert cfg.batching.train.max_tokens == 16


def test_enum_accepts_value_spelling():
    cfg = compose(BASE + ["grpo.loss_agg_mode=seq-mean-token-sum"], "t")
    assert cfg.grpo.loss_agg_mode.value == "seq-mean-token-sum"


def test_cli_exits_2_without_traceback(bin_dir, subprocess_env):
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), *BASE, "trainer.max_steps=0", "parallel.vpp=2"],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "trainer.max_steps" in proc.stderr and "parallel.vpp" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_resolved_yaml_round_trip(tmp_path):
    """What the driver writes, the worker reads back identically (no Hydra in the worker)."""
    from rlbatch.config.load import dump_run_config

    cfg = compose(BASE + ["plan.pass=infer", "grpo.loss_agg_mode=seq_mean_token_sum_norm"], "t")
    path = tmp_path / "resolved.yaml"
    dump_run_config(cfg, path)
    assert load_run_config(path) == cfg
    assert "pass: infer" in path.read_text()
    assert to_container(cfg)["plan"]["pass"] == "infer"


PLAN_ONLY_LAYOUT = ["parallel.dp=8", "parallel.pp=2", "parallel.vpp=2", "model.num_layers=2"]


def test_plan_checks_only_what_planning_uses():
    """rlbatch-plan builds no model and generates nothing: a layout the tiny model cannot train
    with (2 layers over pp*vpp=4, one prompt per rank) still plans; training rejects it."""
    from rlbatch.config.validate import PLAN_SCOPE

    cfg = compose(BASE + PLAN_ONLY_LAYOUT, "t", PLAN_SCOPE)
    assert (cfg.parallel.dp, cfg.parallel.vpp) == (8, 2)
    with pytest.raises(SystemExit):
        compose(BASE + PLAN_ONLY_LAYOUT, "t")


def test_plan_still_rejects_bad_batching_and_layout(capsys):
    from rlbatch.config.validate import PLAN_SCOPE

    bad = ["parallel.tp=2", "batching.train.sequence_length_round=3", "parallel.pp=1"]
    with pytest.raises(SystemExit):
        compose(BASE + bad + ["parallel.vpp=2", "batching.infer.max_tokens=0"], "t", PLAN_SCOPE)
    err = capsys.readouterr().err
    for key in (
        "batching.train.sequence_length_round",
        "parallel.vpp",
        "batching.infer.max_tokens",
    ):
        assert key in err


def _hf_dir(tmp_path, layers):
    import json

    config = {
        "model_type": "qwen2", "num_hidden_layers": layers, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 300, "max_position_embeddings": 512, "tie_word_embeddings": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_architecture_of_hf_checkpoint_is_validated_not_the_presets(tmp_path, capsys):
    """model.hf_path's config.json replaces the preset before the rules run: the preset's 2
    layers would reject pp=3, the checkpoint's 6 layers split fine; 6 over pp=4 is rejected."""
    hf = _hf_dir(tmp_path, layers=6)
    cfg = compose(BASE + [f"model.hf_path={hf}", "parallel.pp=3"], "t")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.vocab_size) == (6, 64, 300)
    assert "num_layers: 2 -> 6" in " ".join(capsys.readouterr().err.split())  # wrapped lines
    with pytest.raises(SystemExit):
        compose(BASE + [f"model.hf_path={hf}", "parallel.pp=4"], "t")
    assert "model.num_layers=6" in " ".join(capsys.readouterr().err.split())


def test_unusable_hf_directory_is_a_config_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "mistral"}')
    with pytest.raises(SystemExit):
        compose(BASE + [f"model.hf_path={tmp_path}"], "t")
    err = capsys.readouterr().err
    assert "model.hf_path" in err and "mistral" in err and "qwen3" in err


def test_objective_keys_are_checked_all_at_once():
    err = _errors_for(
        [
            "grpo.rollout_correction_lower=3.0",
            "grpo.rollout_correction_cap=2.0",
            "grpo.overlong_buffer_len=100000",
            "grpo.max_generation_rounds=0",
            "grpo.sapo_tau_neg=-1",
            "grpo.entropy_coef=-0.1",
            "grpo.policy_loss=ppo",
        ]
    )
    text = {e.key: str(e) for e in err.errors}
    assert "below grpo.rollout_correction_cap = 2.0" in text["grpo.rollout_correction_lower"]
    assert "rollout.max_new_tokens" in text["grpo.overlong_buffer_len"]
    assert "must be positive" in text["grpo.max_generation_rounds"]
    assert "must be positive" in text["grpo.sapo_tau_neg"]
    assert "must be >= 0" in text["grpo.entropy_coef"]
    assert "grpo.policy_loss" in text


def test_objective_keys_the_run_ignores_are_warned_about():
    from rlbatch.config.objectives import objective_warnings
    from rlbatch.config.schema import AdvantageEstimator, RunConfig, ScaleRewards

    cfg = RunConfig()
    assert objective_warnings(cfg) == []
    cfg.grpo.sapo_tau_neg = 2.0
    cfg.grpo.rollout_correction_lower = 0.5
    cfg.grpo.advantage_estimator = AdvantageEstimator.rloo
    cfg.grpo.scale_rewards = ScaleRewards.batch
    cfg.debug.perturb_behaviour_logps = 0.1
    text = "\n".join(objective_warnings(cfg))
    assert "grpo.sapo_tau_neg=2.0 is ignored: grpo.policy_loss is not sapo" in text
    assert "grpo.rollout_correction_lower=0.5 is ignored" in text
    assert "grpo.scale_rewards=batch is ignored" in text
    assert "debug.perturb_behaviour_logps=0.1" in text


def test_qkv_biases_are_refused_where_the_hugging_face_form_has_none():
    """Qwen3 (MoE too) and Llama have no q/k/v-only biases in Hugging Face's classes (their
    attention_bias adds an o_proj bias as well): trained biases would be dropped by the export,
    so a model of those architectures with model.add_qkv_bias=true is refused before launch."""
    from rlbatch.config.schema import Architecture

    for arch in (Architecture.qwen3, Architecture.llama):
        cfg = RunConfig()
        cfg.model.architecture = arch
        (error,) = [e for e in validate(cfg) if e.key == "model.add_qkv_bias"]
        assert f"model.architecture={arch.value}" in str(error)
        cfg.model.add_qkv_bias = False
        assert not [e for e in validate(cfg) if e.key == "model.add_qkv_bias"]
    for arch in (Architecture.qwen2, Architecture.qwen2_moe):  # q/k/v biases: Qwen2's own
        cfg = RunConfig()
        cfg.model.architecture = arch
        assert not [e for e in validate(cfg) if e.key == "model.add_qkv_bias"]


def test_qk_norm_follows_the_hugging_face_architecture():
    """Qwen3 (MoE too) always has query/key RMSNorm in Hugging Face's classes, Qwen2 (MoE
    too) and Llama never: a model whose model.qk_layernorm says otherwise would export (and
    sync to vLLM) as another model than the one trained (e.g. ``model=tiny_moe
    model.architecture=qwen2_moe`` kept the preset's QK-norm), so it is refused before launch,
    naming the value that fits."""
    from rlbatch.config.schema import Architecture

    for arch in Architecture:
        fits = arch in (Architecture.qwen3, Architecture.qwen3_moe)
        cfg = RunConfig()
        cfg.model.architecture = arch
        cfg.model.qk_layernorm = not fits
        (error,) = [e for e in validate(cfg) if e.key == "model.qk_layernorm"]
        assert f"model.architecture={arch.value}" in str(error)
        assert f"set model.qk_layernorm={str(fits).lower()}" in str(error)
        cfg.model.qk_layernorm = fits
        assert not [e for e in validate(cfg) if e.key == "model.qk_layernorm"]


def test_widths_tensor_parallelism_cannot_split_are_refused_before_launch():
    """An MLP width (dense, expert or shared expert) that parallel.tp does not divide: the
    workers would start and die in megatron's split; refused naming each key."""
    cfg = RunConfig()
    cfg.parallel.tp, cfg.model.ffn_hidden_size = 2, 41
    (error,) = [str(e) for e in validate(cfg) if e.key == "model.ffn_hidden_size"]
    assert "model.ffn_hidden_size=41: must be divisible by parallel.tp = 2" in error, error
    cfg.model.ffn_hidden_size = 42
    assert not [e for e in validate(cfg) if e.key == "model.ffn_hidden_size"]
    cfg.model.num_moe_experts, cfg.model.moe_ffn_hidden_size = 4, 41
    cfg.model.moe_shared_expert_intermediate_size = 9
    keys = {e.key for e in validate(cfg)}
    assert {"model.moe_ffn_hidden_size", "model.moe_shared_expert_intermediate_size"} <= keys
    cfg.parallel.tp = 1
    keys = {e.key for e in validate(cfg)}
    assert not keys & {"model.moe_ffn_hidden_size", "model.moe_shared_expert_intermediate_size"}
