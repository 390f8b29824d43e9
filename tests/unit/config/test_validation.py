"""Each validation rule rejects its bad config with a message naming the dotted key, and all
errors are reported at once, before anything heavy runs."""

from __future__ import annotations

import subprocess

import pytest

from rlbatch.cli.common import compose
from rlbatch.config.errors import ConfigErrors
from rlbatch.config.load import check_structure, load_run_config, to_container
from rlbatch.config.validate import check

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
    (["model.logits_chunk_tokens=-1"], "model.logits_chunk_tokens", ">= 0"),
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
    assert "num_layers: 2 -> 6" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compose(BASE + [f"model.hf_path={hf}", "parallel.pp=4"], "t")
    assert "model.num_layers=6" in capsys.readouterr().err


def test_unusable_hf_directory_is_a_config_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "mistral"}')
    with pytest.raises(SystemExit):
        compose(BASE + [f"model.hf_path={tmp_path}"], "t")
    err = capsys.readouterr().err
    assert "model.hf_path" in err and "mistral" in err and "qwen3" in err
