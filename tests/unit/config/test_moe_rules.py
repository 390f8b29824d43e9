"""MoE keys and expert parallelism before launch: every error at once, each naming its key;
Qwen3-MoE's config.json mapped onto the megatron-named keys, fields of other MoE families
refused by name."""

from __future__ import annotations

import json

import pytest

from rlbatch.config.errors import ConfigErrors
from rlbatch.config.load import check_structure
from rlbatch.config.validate import check
from rlbatch.engine.hf_config import config_from_hf, hf_config_dict


def _errors_for(overrides: list[str]) -> dict[str, str]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.store import conf_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=["+recipe=grpo_qwen", *overrides])
    with pytest.raises(ConfigErrors) as info:
        check(*check_structure(OmegaConf.to_container(cfg, resolve=True)))
    messages: dict[str, str] = {}
    for e in info.value.errors:  # a key may have several errors: all of them
        messages[e.key] = messages.get(e.key, "") + str(e) + "\n"
    return messages


def _validates(overrides: list[str]) -> None:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.store import conf_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=["+recipe=grpo_qwen", *overrides])
    check(*check_structure(OmegaConf.to_container(cfg, resolve=True)))  # no error


def test_moe_layout_and_unsupported_keys_are_all_refused_at_once():
    errors = _errors_for(
        [
            "model=tiny_moe", "parallel.dp=2", "parallel.ep=3", "model.moe_router_topk=9",
            "model.moe_layer_freq=[1,0,1]", "model.moe_aux_loss_coeff=-0.01",
            "model.moe_expert_capacity_factor=0", "rollout.backend=megatron_dynamic",
        ]
    )  # fmt: skip
    assert "must divide parallel.dp * parallel.cp = 2" in errors["parallel.ep"]
    assert "must divide model.num_moe_experts = 4" in errors["parallel.ep"]
    assert "[1, model.num_moe_experts = 4]" in errors["model.moe_router_topk"]
    assert "one 0 (dense) / 1 (MoE) per layer" in errors["model.moe_layer_freq"]
    assert "must be >= 0" in errors["model.moe_aux_loss_coeff"]
    assert "dropless" in errors["model.moe_expert_capacity_factor"]
    assert "rollout.backend=megatron, vllm or vllm_server" in errors["rollout.backend"]


def test_expert_parallelism_with_pipeline_stages_validates_on_every_backend():
    """dp 2 x ep 2 x pp 2 x vpp 2 (4 processes) trains on the built-in rollout, on colocated
    vLLM and on vLLM servers (their weight syncs go stage by stage, each stage gathering its
    experts over its own expert group: tests/e2e/test_vllm_cli.py, test_vllm_servers.py)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.store import conf_dir, register_configs

    layout = ["model=tiny_moe", "model.num_layers=4", "parallel.dp=2", "parallel.ep=2",
              "parallel.pp=2", "parallel.vpp=2"]  # fmt: skip
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=["+recipe=grpo_qwen", *layout])
    check(*check_structure(OmegaConf.to_container(cfg, resolve=True)))  # no error
    _validates([*layout, "rollout.backend=vllm", "model.head_dim=32"])
    _validates([*layout, "rollout.backend=vllm_server", "model.head_dim=32",
                "rollout.servers.count=1"])  # fmt: skip


@pytest.mark.parametrize("backend", ["vllm", "vllm_server"])
def test_an_moe_policy_on_vllm_validates_without_a_capacity_only(backend):
    """vLLM rolls MoE policies out (dropless); a capacity factor, which vLLM's MoE layer does not
    apply, is refused there with the reason, and so is r3 (no routed experts on the CPU build)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.store import conf_dir, register_configs

    overrides = ["+recipe=grpo_qwen", "model=tiny_moe", f"rollout.backend={backend}",
                 "parallel.dp=2", "parallel.ep=2", "model.head_dim=32"]  # fmt: skip
    if backend == "vllm_server":
        overrides.append("rollout.servers.count=1")
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    check(*check_structure(OmegaConf.to_container(cfg, resolve=True)))  # no error
    errors = _errors_for(
        [*overrides[1:], "model.moe_expert_capacity_factor=1.0", "grpo.routing_replay=r3"]
    )
    assert "vLLM's MoE layer has no capacity" in errors["model.moe_expert_capacity_factor"]
    assert "routed_experts" in errors["grpo.routing_replay"]
    assert set(errors) == {"model.moe_expert_capacity_factor", "grpo.routing_replay"}
    from rlbatch.config.vllm_rules import cpu_build_installed

    if cpu_build_installed():  # tiny_moe's heads of width 16 are refused naming its key
        narrow = _errors_for([o for o in overrides[1:] if not o.startswith("model.head_dim")])
        assert "model.head_dim=32" in narrow["model.head_dim"]


def test_what_an_moe_run_cannot_do_yet_is_refused_before_launch():
    """Each of these used to launch and then die (or hang) after the model was built."""
    overlap = _errors_for(
        ["model=tiny_moe", "parallel.dp=2", "parallel.ep=2", "grpo.num_steps_async=1",
         "grpo.max_staleness=1", "grpo.beta=0"]
    )  # fmt: skip
    assert "grpo.overlap_generation=false" in overlap["parallel.ep"]
    tp = _errors_for(["model=tiny_moe", "parallel.tp=2"])
    assert "parallel.sequence_parallel=true" in tp["parallel.sequence_parallel"]
    harness = _errors_for(
        ["+env.harness=agent.py:run", "data.chat_template=qwen", "model=tiny_moe",
         "parallel.dp=2", "parallel.ep=2", "grpo.routing_replay=r3"]
    )  # fmt: skip
    assert "parallel.ep" not in harness  # the built-in engine keeps the expert group in step
    assert "agent harnesses (env.harness)" in harness["grpo.routing_replay"]
    assert "splices the calls' sampled tokens" in harness["grpo.routing_replay"]
    # on vLLM servers too: they sync at every round's start, on every rank
    _validates(["+env.harness=agent.py:run", "data.chat_template=qwen", "model=tiny_moe",
                "model.head_dim=32", "parallel.dp=2", "parallel.ep=2",
                "rollout.backend=vllm_server", "rollout.servers.count=1"])  # fmt: skip
    partial = _errors_for(  # on vLLM, which returns no routing here
        ["model=tiny_moe", "model.head_dim=32", "grpo.partial_rollouts=true",
         "grpo.num_steps_async=1", "grpo.max_staleness=3", "grpo.routing_replay=r3",
         "rollout.backend=vllm"]
    )  # fmt: skip
    assert "AuxOutput Connector" in partial["grpo.routing_replay"]
    assert "model.num_moe_experts" not in partial
    # tensor parallelism (with the sequence parallelism MoE needs there): routers see a slice
    sliced = _errors_for(
        ["model=tiny_moe", "parallel.tp=2", "parallel.sequence_parallel=true",
         "model.moe_expert_capacity_factor=1.0", "model.moe_aux_loss_coeff=0.01",
         "grpo.routing_replay=r2", "grpo.num_iterations=2"]
    )  # fmt: skip
    assert "gloo refuses uneven sizes" in sliced["model.moe_expert_capacity_factor"]
    assert "model.moe_aux_loss_coeff" not in sliced  # summed over the tp ranks
    assert "grpo.routing_replay" not in sliced  # r2 records the whole sequence at any tp
    few = _errors_for(["model=tiny_moe", "parallel.dp=2", "parallel.ep=2", "eval.max_prompts=1"])
    assert "set eval.max_prompts=2 or more" in few["eval.max_prompts"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["env=guess_number", "parallel.dp=2", "parallel.ep=2"],
        ["env=guess_number", "parallel.dp=2", "parallel.ep=2", "grpo.routing_replay=r2",
         "grpo.num_iterations=2"],
        ["env=guess_number", "parallel.dp=2", "parallel.ep=2", "grpo.routing_replay=r3"],
        ["env=guess_number", "parallel.dp=2", "parallel.ep=2", "rollout.backend=vllm",
         "model.head_dim=32"],
        ["+env.harness=agent.py:run", "data.chat_template=qwen", "parallel.dp=2"],
        ["+env.harness=agent.py:run", "data.chat_template=qwen", "parallel.dp=2",
         "parallel.ep=2", "grpo.routing_replay=r2", "grpo.num_iterations=2"],
        ["grpo.partial_rollouts=true", "grpo.num_steps_async=1", "grpo.max_staleness=3",
         "grpo.overlap_generation=false", "parallel.dp=2", "parallel.ep=2",
         "grpo.routing_replay=r3"],
    ],
    ids=["env_dp2_ep2", "env_r2", "env_r3", "env_vllm", "harness_dp2_ep1", "harness_dp2_ep2",
         "partial_dp2_ep2"],
)  # fmt: skip
def test_an_moe_policy_validates_with_per_row_decoding(overrides, tmp_path):
    """The per-row decoder computes MoE blocks: multi-turn environments at any expert
    parallelism (the expert group kept in step), r2 and r3 (the decoder records the rollout's
    routing), agent harnesses and partial rollouts at any expert parallelism (the built-in
    engine decodes an expert group's calls, and its rounds, together)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.store import conf_dir, register_configs

    (tmp_path / "agent.py").write_text("async def run(client, model, row):\n    return 0.0\n")
    overrides = [o.replace("agent.py", str(tmp_path / "agent.py")) for o in overrides]
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(
            config_name="config", overrides=["+recipe=grpo_qwen", "model=tiny_moe", *overrides]
        )
    check(*check_structure(OmegaConf.to_container(cfg, resolve=True)))  # no error


def test_yarn_rope_is_refused_where_the_per_row_decoder_would_run():
    errors = _errors_for(
        ["+model.rope_scaling=yarn", "+model.rope_scaling_factor=4.0", "grpo.partial_rollouts=true",
         "grpo.num_steps_async=1", "grpo.max_staleness=3"]
    )  # fmt: skip
    assert (
        "yarn" in errors["model.rope_scaling"]
        and "partial rollouts" in errors["model.rope_scaling"]
    )


def test_expert_parallelism_needs_an_moe_model():
    errors = _errors_for(["parallel.dp=2", "parallel.ep=2"])
    assert "needs an MoE model" in errors["parallel.ep"]


def test_the_tiny_moe_preset_at_dp2_ep2_validates():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.store import conf_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(
            config_name="config",
            overrides=["+recipe=grpo_qwen", "model=tiny_moe", "parallel.dp=2", "parallel.ep=2"],
        )
    run = check(*check_structure(OmegaConf.to_container(cfg, resolve=True)))
    assert run.model.num_moe_experts == 4 and run.parallel.ep == 2


def _write(tmp_path, **fields):
    base = {
        "model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 264, "moe_intermediate_size": 24,
        "num_local_experts": 8, "num_experts_per_tok": 2,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(base | fields))
    return tmp_path


def test_qwen3_moe_config_maps_onto_the_megatron_keys(tmp_path):
    fields = config_from_hf(
        _write(tmp_path, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    )
    # transformers' rule: sparse when not in mlp_only_layers and (i + 1) % step == 0
    assert fields["moe_layer_freq"] == [0, 1, 0, 0]
    assert (fields["num_moe_experts"], fields["moe_router_topk"]) == (8, 2)
    assert (fields["moe_ffn_hidden_size"], fields["ffn_hidden_size"]) == (24, 64)
    assert fields["moe_norm_topk_prob"] is True and fields["qk_layernorm"] is True
    assert config_from_hf(_write(tmp_path))["moe_layer_freq"] == []  # every layer sparse


def test_fields_of_other_moe_families_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigErrors) as info:
        config_from_hf(_write(tmp_path, shared_expert_intermediate_size=32, n_group=4))
    keys = {e.key for e in info.value.errors}
    assert keys == {"shared_expert_intermediate_size", "n_group"}
    assert "qwen2_moe only" in str(info.value)


def test_qwen2_moe_config_maps_its_shared_expert_and_biases(tmp_path):
    """Qwen2-MoE: a shared expert (model.moe_shared_expert_intermediate_size), q/k/v biases, no
    QK-norm, top-k not renormalised by default; the export writes it back as Qwen2-MoE. The
    shared expert on a Qwen3-MoE model is refused; vLLM rollouts validate."""
    from dataclasses import replace

    from rlbatch.config.schema import ModelConfig

    qwen2 = {"model_type": "qwen2_moe", "shared_expert_intermediate_size": 40, "head_dim": None}
    fields = config_from_hf(_write(tmp_path, **qwen2))
    assert fields["moe_shared_expert_intermediate_size"] == 40
    assert fields["add_qkv_bias"] is True and fields["qk_layernorm"] is False
    assert fields["moe_norm_topk_prob"] is False
    model = replace(ModelConfig(), **{k: v for k, v in fields.items() if k != "name"})
    out = hf_config_dict(model)
    assert out["architectures"] == ["Qwen2MoeForCausalLM"] and out["qkv_bias"] is True
    assert out["shared_expert_intermediate_size"] == 40 and "head_dim" not in out
    errors = _errors_for(
        [
            "model=tiny_moe",
            "model.moe_shared_expert_intermediate_size=32",
            "model.lora.rank=8",
            "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
        ]  # fmt: skip
    )
    assert "Qwen3-MoE has no shared expert" in errors["model.moe_shared_expert_intermediate_size"]
    assert "model.lora.rank" not in errors  # LoRA adapts a shared expert (Qwen2-MoE)
    for backend in ("vllm", "vllm_server"):  # vLLM's Qwen2MoeForCausalLM takes the sync
        qwen2_moe = [
            "model=tiny_moe",
            "model.architecture=qwen2_moe",
            "model.qk_layernorm=false",
            "model.head_dim=null",  # vLLM's Qwen2-MoE takes hidden_size / heads = 32
            "model.num_attention_heads=2",
            "model.num_query_groups=2",
            "model.moe_shared_expert_intermediate_size=40",
            f"rollout.backend={backend}",
            *(["rollout.servers.count=1"] if backend == "vllm_server" else []),
        ]  # fmt: skip
        _validates([*qwen2_moe, "model.add_qkv_bias=true"])
        # without q/k/v biases vLLM's Qwen2-MoE (which always has them) would sample another
        # model: refused, as it is not on the built-in engine
        errors = _errors_for([*qwen2_moe, "model.add_qkv_bias=false"])
        assert "vLLM's Qwen2-MoE always has them" in errors["model.add_qkv_bias"]
        built_in = [o for o in qwen2_moe if not o.startswith("rollout.")]
        _validates([*built_in, "model.add_qkv_bias=false", "rollout.backend=megatron"])


def test_export_config_round_trips(tmp_path):
    from dataclasses import replace

    from rlbatch.config.schema import ModelConfig

    fields = config_from_hf(_write(tmp_path, mlp_only_layers=[1], norm_topk_prob=True))
    model = replace(ModelConfig(), **{k: v for k, v in fields.items() if k != "name"})
    out = hf_config_dict(model)
    assert out["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (out["mlp_only_layers"], out["num_experts"], out["moe_intermediate_size"]) == (
        [1], 8, 24,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(out))
    assert config_from_hf(tmp_path)["moe_layer_freq"] == fields["moe_layer_freq"]


def test_rlbatch_plan_refuses_the_expert_layouts_training_refuses(bin_dir, subprocess_env):
    """The preview validates parallel.ep as rlbatch-train does: a plan it prints is one the
    run can take."""
    import subprocess

    proc = subprocess.run(
        [str(bin_dir / "rlbatch-plan"), "+recipe=grpo_qwen", "model=tiny_moe", "parallel.dp=2",
         "parallel.ep=3", "plan.synthetic=grpo_math", "batching.train.max_tokens=65536"],
        capture_output=True, text=True, env=subprocess_env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "parallel.ep=3: must divide parallel.dp * parallel.cp = 2" in proc.stdout + proc.stderr


def test_routing_replay_needs_an_moe_model():
    errors = _errors_for(["grpo.routing_replay=r3"])
    assert "needs an MoE model" in errors["grpo.routing_replay"]


def test_routing_replay_refusals_name_their_keys_all_at_once():
    errors = _errors_for(
        [
            "model=tiny_moe", "grpo.routing_replay=r2", "grpo.num_iterations=1",
            "model.recompute=full", "parallel.dp=2", "parallel.cp=2", "grpo.num_steps_async=1",
            "grpo.partial_rollouts=true", "grpo.max_staleness=4",
        ]
    )  # fmt: skip
    # r2 without an old-logprob pass would replay the training forward onto itself
    assert "has no such pass" in errors["grpo.routing_replay"]
    assert "model.recompute" not in errors  # the recomputed forward replays too
    assert "set parallel.cp=1" in errors["parallel.cp"]
    assert "model.num_moe_experts" not in errors  # partial rollouts run r2 (and none)


def test_r3_is_refused_on_a_backend_that_returns_no_routing():
    errors = _errors_for(["model=tiny_moe", "grpo.routing_replay=r3", "rollout.backend=vllm"])
    assert "AuxOutput Connector requires Model Runner V2" in errors["grpo.routing_replay"]


def test_r2_with_an_old_pass_validates():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.store import conf_dir, register_configs

    register_configs()
    overrides = ["+recipe=grpo_qwen", "model=tiny_moe", "grpo.routing_replay=r2",
                 "grpo.num_iterations=2"]  # fmt: skip
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    check(*check_structure(OmegaConf.to_container(cfg, resolve=True)))


def test_the_balance_loss_validates_where_routers_see_a_slice_of_the_sequence():
    """Pipeline stages take the loss (each adds its own routers' share) and so does sequence
    parallelism (each sample's statistics summed over the tensor-parallel ranks): both exact,
    tests/dist/test_moe_balance_pipeline.py. Context parallelism is refused with its reason,
    naming the coefficient (NCCL: on gloo cp is refused on its own)."""
    _validates(["model=tiny_moe", "model.moe_aux_loss_coeff=0.01", "parallel.pp=2",
                "parallel.tp=2", "parallel.sequence_parallel=true"])  # fmt: skip
    _validates(["model=tiny_moe", "model.moe_aux_loss_coeff=0.01", "parallel.pp=2",
                "parallel.dp=2", "parallel.ep=2"])  # fmt: skip
    errors = _errors_for(["model=tiny_moe", "model.moe_aux_loss_coeff=0.01", "parallel.cp=2",
                          "parallel.dp=2", "parallel.backend=nccl"])  # fmt: skip
    message = errors["model.moe_aux_loss_coeff"]
    assert "parallel.cp=2" in message and "set parallel.cp=1 or the coefficient to 0" in message


@pytest.mark.parametrize("pp", [1, 2])
def test_the_balance_loss_and_replay_validate_with_every_recompute(pp):
    """Full recompute runs each layer without autograd first; the loss's gradient reaches the
    routers through their recomputed forward, which replays the micro-batch's routing again
    (equal to recompute=none's: tests/dist/test_moe_balance_pipeline.py), so no recompute mode
    is refused with a coefficient or with routing replay."""
    for recompute in ("none", "selective", "full"):
        _validates(["model=tiny_moe", "model.moe_aux_loss_coeff=0.01",
                    f"model.recompute={recompute}", f"parallel.pp={pp}"])  # fmt: skip
    for replay in (["grpo.routing_replay=r3"],
                   ["grpo.routing_replay=r2", "grpo.num_iterations=2"]):  # fmt: skip
        _validates(["model=tiny_moe", "model.moe_aux_loss_coeff=0.01", "model.recompute=full",
                    f"parallel.pp={pp}", *replay])  # fmt: skip


def test_expert_keys_on_a_dense_preset(bin_dir, subprocess_env, tmp_path):
    """Every preset has the expert keys: a plain override works on a dense preset whose
    model.hf_path is a Qwen3-MoE checkpoint (the experts come from its config.json); on a
    dense model the same key would do nothing, so rlbatch-train refuses it before launch."""
    import subprocess

    hf = _write(tmp_path)
    plan = subprocess.run(
        [str(bin_dir / "rlbatch-plan"), "+recipe=grpo_qwen", f"model.hf_path={hf}",
         "model.tokenizer=bytes", "model.moe_expert_capacity_factor=1.5",
         "plan.synthetic=grpo_math", "batching.train.max_tokens=65536"],
        capture_output=True, text=True, env=subprocess_env, timeout=120,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    train = subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_qwen", "model.moe_aux_loss_coeff=0.01",
         "model.moe_router_topk=3"],
        capture_output=True, text=True, env=subprocess_env, timeout=120,
    )  # fmt: skip
    assert train.returncode == 2, train.stdout[-2000:] + train.stderr[-2000:]
    for key in ("model.moe_aux_loss_coeff=0.01", "model.moe_router_topk=3"):
        assert f"{key}: applies to MoE models only" in train.stderr


def test_lora_on_moe_adapts_the_attention_and_refuses_experts_and_routers_by_name():
    """LoRA on an MoE model: the MLP projections (the routed experts' in a sparse layer),
    all-linear beside dense layers (their MLPs would be left out), the router or experts by
    name, and a vLLM rollout are refused, each naming model.lora.* and the reason."""
    mlp = _errors_for(["model=tiny_moe", "model.lora.rank=8",
                       "model.lora.target_modules=[q_proj,down_proj]", "rollout.backend=vllm"])  # fmt: skip
    assert "names ['down_proj'] on an MoE model" in mlp["model.lora.target_modules"]
    assert "routed experts" in mlp["model.lora.target_modules"]
    assert "rollout.backend=vllm is not supported yet" in mlp["model.lora.rank"]
    dense = _errors_for(["model=tiny_moe", "model.num_layers=3", "model.moe_layer_freq=[1,0,1]",
                         "model.lora.rank=8"])  # fmt: skip
    assert "dense layers [1]" in dense["model.lora.target_modules"]
    assert (
        "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"
        in dense["model.lora.target_modules"]
    )
    router = _errors_for(["model=tiny_moe", "model.lora.rank=8",
                          "model.lora.target_modules=[q_proj,gate,experts]"])  # fmt: skip
    assert (
        "names ['gate', 'experts']: LoRA does not adapt MoE routers or routed experts"
        in router["model.lora.target_modules"]
    )


QWEN2_MOE = ["model=tiny_moe", "model.architecture=qwen2_moe", "model.qk_layernorm=false",
             "model.moe_shared_expert_intermediate_size=40", "model.lora.rank=8"]  # fmt: skip


def test_lora_on_a_shared_expert_model_adapts_it_and_refuses_the_routed_experts():
    """A Qwen2-MoE's shared expert is adapted by all-linear and by its projections' names (its
    PEFT names verified through rlbatch-export in tests/e2e/test_moe_cli.py); the router, the
    routed experts and the shared expert by module name stay refused with their message, and
    so do MLP names beside dense layers."""
    _validates(QWEN2_MOE)
    _validates([*QWEN2_MOE, "model.lora.target_modules=[q_proj,v_proj,gate_proj,down_proj]"])
    named = _errors_for([*QWEN2_MOE, "model.lora.target_modules=[q_proj,gate,shared_expert]"])
    assert "LoRA does not adapt MoE routers or routed experts" in named["model.lora.target_modules"]
    assert (
        "shared expert is adapted through its projections' names"
        in named["model.lora.target_modules"]
    )
    dense = _errors_for([*QWEN2_MOE, "model.num_layers=3", "model.moe_layer_freq=[1,0,1]",
                         "model.lora.target_modules=[q_proj,up_proj]"])  # fmt: skip
    assert "dense layers [1]" in dense["model.lora.target_modules"]


def test_lora_on_an_all_sparse_moe_validates_with_all_linear():
    """tiny_moe (every layer sparse) at dp 2 x ep 2 with all-linear validates: it means the
    attention there."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.store import conf_dir, register_configs

    register_configs()
    overrides = ["+recipe=grpo_qwen", "model=tiny_moe", "model.lora.rank=32", "parallel.dp=2",
                 "parallel.ep=2"]  # fmt: skip
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    check(*check_structure(OmegaConf.to_container(cfg, resolve=True)))


def _composed(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.store import conf_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=["+recipe=grpo_qwen", *overrides])
    cfg, structural = check_structure(OmegaConf.to_container(cfg, resolve=True))
    assert structural == []
    return cfg


def test_every_command_that_builds_an_moe_model_checks_its_expert_keys():
    """rlbatch-logprobs, -eval and -serve build the model too: its expert keys are checked there
    as in training (a factor <= 0, experts on a dense architecture), rlbatch-logprobs refuses a
    capacity factor (it would drop tokens by how the rows are batched and change their scores
    silently), and rlbatch-eval an MoE rollout on megatron's dynamic engine."""
    from rlbatch.config.validate import EVAL_SCOPE, LOGPROBS_SCOPE, SERVE_SCOPE, validate

    def keys(overrides, scope):
        return {e.key: str(e) for e in validate(_composed(overrides), scope)}

    dropping = keys(["model=tiny_moe", "model.moe_expert_capacity_factor=0.5"], LOGPROBS_SCOPE)
    assert "rlbatch-logprobs scores every token" in dropping["model.moe_expert_capacity_factor"]
    assert "model.moe_expert_capacity_factor" not in keys(["model=tiny_moe"], LOGPROBS_SCOPE)
    for scope in (LOGPROBS_SCOPE, EVAL_SCOPE, SERVE_SCOPE):
        negative = keys(["model=tiny_moe", "model.moe_expert_capacity_factor=-1"], scope)
        assert "must be > 0" in negative["model.moe_expert_capacity_factor"]
        dense_with_experts = keys(["model=tiny", "model.num_moe_experts=4"], scope)
        assert "model.architecture=qwen3_moe" in dense_with_experts["model.architecture"]
    dynamic = keys(["model=tiny_moe", "rollout.backend=megatron_dynamic"], EVAL_SCOPE)
    assert "dynamic engine" in dynamic["rollout.backend"]


def test_an_evaluation_too_small_for_the_expert_group_is_refused_before_launch():
    """At dp 2 x ep 2 every rank evaluates as many blocks of held-out prompts (each MoE forward
    of the built-in engine is an all-to-all over the expert group): one prompt is refused before
    launch naming eval.data.num_prompts (it stopped the workers after launch). On vLLM too: its
    weight sync before the first generate call gathers the experts over the group, and a rank
    with no block never made it (a review saw the run hang)."""
    from rlbatch.grpo.preflight import check_eval_inputs

    small = ["model=tiny_moe", "parallel.dp=2", "parallel.ep=2", "eval.data.num_prompts=1"]
    cfg = _composed(small)
    cfg.eval.every_steps = 1
    errors: list = []
    check_eval_inputs(cfg, errors)
    (error,) = errors
    assert error.key == "eval.data.num_prompts" and "1 held-out prompt(s)" in str(error)
    assert "evaluate at least 2 prompts" in str(error)
    cfg = _composed([*small, "rollout.backend=vllm", "model.head_dim=32"])
    cfg.eval.every_steps = 1
    errors = []
    check_eval_inputs(cfg, errors)
    assert [e.key for e in errors] == ["eval.data.num_prompts"]


def test_an_moe_teacher_is_dropless_and_must_split_over_the_expert_group(tmp_path):
    """The student's capacity factor is a training setting: the distillation teacher scores
    every token as its checkpoint routes it (a dropping teacher gave log-probs 1e-2 off, with no
    count). An MoE teacher whose experts ep does not divide is refused before launch."""
    from rlbatch.grpo.teacher import teacher_errors, teacher_model_config

    (tmp_path / "teacher").mkdir()
    teacher = _write(tmp_path / "teacher")
    cfg = _composed(["model=tiny_moe", "model.moe_expert_capacity_factor=0.5"])
    cfg.grpo.distill.teacher = str(teacher)
    model = teacher_model_config(cfg)
    assert model.num_moe_experts == 8 and model.moe_expert_capacity_factor is None
    cfg.parallel.dp, cfg.parallel.ep = 3, 3
    (error,) = [e for e in teacher_errors(cfg) if "experts" in str(e)]
    assert error.key == "grpo.distill.teacher" and "8 experts" in str(error)


def test_layouts_gloo_cannot_run_are_refused_before_launch():
    """On gloo (this machine: no CUDA) tp > 1 with ep > 1 crashed at the first training forward
    (the expert-tensor-parallel all-gather of uneven token counts) and cp > 1 stopped every
    worker after launch: both are refused before launch, naming the key. rlbatch-plan, which
    previews a layout for any machine, does not apply them; an explicit NCCL backend is left to
    the workers."""
    import torch

    from rlbatch.config.validate import PLAN_SCOPE, validate

    if torch.cuda.is_available():
        pytest.skip("gloo is not this machine's backend")
    tp_ep = ["model=tiny_moe", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2",
             "parallel.sequence_parallel=true"]  # fmt: skip
    errors = _errors_for(tp_ep)
    assert "gloo refuses uneven sizes" in errors["parallel.ep"]
    assert "context parallelism needs CUDA" in _errors_for(["parallel.cp=2"])["parallel.cp"]
    keys = {e.key for e in validate(_composed(tp_ep), PLAN_SCOPE)}
    assert "parallel.ep" not in keys
    nccl = {e.key for e in validate(_composed([*tp_ep, "parallel.backend=nccl"]))}
    assert "parallel.ep" not in nccl
