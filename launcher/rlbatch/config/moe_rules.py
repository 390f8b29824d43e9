"""Rules of MoE models and expert parallelism (``model.num_moe_experts``, ``model.moe_*``,
``parallel.ep``), checked before launch with the other layout keys."""

from __future__ import annotations

import dataclasses

from rlbatch.config.errors import ConfigError
from rlbatch.config.moe import MOE_ARCHITECTURES, MoeFields
from rlbatch.config.schema import Architecture, RolloutBackend, RunConfig
from rlbatch.config.streaming import overlaps_generation

VLLM_BACKENDS = (RolloutBackend.vllm, RolloutBackend.vllm_server)


def check_expert_layout(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """``parallel.ep`` against the model and the other layout keys: run wherever the layout is
    checked (rlbatch-plan's preview too)."""
    p, experts = cfg.parallel, cfg.model.num_moe_experts
    if experts is None:
        if p.ep != 1:
            errors.append(
                ConfigError(
                    "parallel.ep", p.ep, "expert parallelism needs an MoE model "
                    "(model.num_moe_experts): set parallel.ep=1, or choose an MoE model",
                )
            )  # fmt: skip
        return
    if p.ep < 1:
        errors.append(ConfigError("parallel.ep", p.ep, "must be positive"))
        return
    if (p.dp * p.cp) % p.ep:
        errors.append(
            ConfigError(
                "parallel.ep",
                p.ep,
                f"must divide parallel.dp * parallel.cp = {p.dp * p.cp}: expert parallelism is "
                "carved out of the data-parallel ranks (it adds no processes)",
            )
        )
    if experts > 0 and experts % p.ep:
        errors.append(
            ConfigError(
                "parallel.ep", p.ep, f"must divide model.num_moe_experts = {experts}"
            )
        )  # fmt: skip


def check_moe_model(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """The expert keys fit the model: checked by every command that builds it (rlbatch-train,
    -logprobs, -eval, -serve)."""
    m = cfg.model
    if m.num_moe_experts is None:
        if Architecture(m.architecture) in MOE_ARCHITECTURES:
            errors.append(
                ConfigError(
                    "model.num_moe_experts",
                    None,
                    f"model.architecture={Architecture(m.architecture).value} needs experts: "
                    "set model.num_moe_experts",
                )
            )
        _check_dense(cfg, errors)
        return
    _check_sizes(cfg, errors)
    capacity = m.moe_expert_capacity_factor
    if capacity is not None and capacity <= 0:
        errors.append(
            ConfigError(
                "model.moe_expert_capacity_factor",
                capacity,
                "must be > 0, or null (dropless: no token is ever dropped)",
            )
        )


def check_moe_backend(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """The rollout backends an MoE model samples on (rlbatch-train, -eval and -serve)."""
    m = cfg.model
    if not m.num_moe_experts:
        return
    backend = RolloutBackend(cfg.rollout.backend)
    if backend == RolloutBackend.megatron_dynamic:
        errors.append(
            ConfigError(
                "rollout.backend",
                backend.value,
                "MoE models do not roll out on megatron's dynamic engine yet (its MoE "
                "inference path is not verified here): set rollout.backend=megatron, vllm or "
                "vllm_server",
            )
        )
    capacity = m.moe_expert_capacity_factor
    if capacity is not None and capacity > 0 and backend in VLLM_BACKENDS:
        errors.append(
            ConfigError(
                "model.moe_expert_capacity_factor",
                capacity,
                f"with rollout.backend={backend.value}: vLLM's MoE layer has no capacity (it "
                "never drops a token), so the rollout would route what the trainer drops and "
                "sample from another policy: set the factor to null (dropless), or "
                "rollout.backend=megatron",
            )
        )


def check_moe_scoring(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """rlbatch-logprobs scores every token of every row: a capacity factor would drop some of
    them, by how the rows happen to be batched, and change their scores without a trace."""
    capacity = cfg.model.moe_expert_capacity_factor
    if cfg.model.num_moe_experts and capacity is not None and capacity > 0:
        errors.append(
            ConfigError(
                "model.moe_expert_capacity_factor",
                capacity,
                "drops tokens by how the rows are batched, and rlbatch-logprobs scores every "
                "token as the model routes it: set it to null (dropless)",
            )
        )


def check_moe(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """What MoE does not support yet in training is refused with its reason (never ignored).
    The expert keys are :func:`check_moe_model`'s, the backends :func:`check_moe_backend`'s,
    the expert-parallel layout :func:`check_expert_layout`'s."""
    if (cfg.model.num_moe_experts or 0) < 1:
        return
    _check_unsupported(cfg, errors)


def _check_dense(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """A dense model takes no expert key: one set away from its default would do nothing."""
    defaults = MoeFields()
    for name in (f.name for f in dataclasses.fields(MoeFields)):
        value = getattr(cfg.model, name)
        if name != "num_moe_experts" and value != getattr(defaults, name):
            errors.append(
                ConfigError(
                    f"model.{name}",
                    value,
                    "applies to MoE models only, and this model is dense (model.num_moe_experts "
                    "is null): remove it, or choose an MoE model (model=tiny_moe, or a "
                    "Qwen3-MoE model.hf_path)",
                )
            )


def _check_sizes(cfg: RunConfig, errors: list[ConfigError]) -> None:
    m = cfg.model
    experts = m.num_moe_experts or 0
    if experts < 1:
        errors.append(ConfigError("model.num_moe_experts", experts, "must be positive (or null)"))
        return
    if not 1 <= m.moe_router_topk <= experts:
        errors.append(
            ConfigError(
                "model.moe_router_topk",
                m.moe_router_topk,
                f"must be in [1, model.num_moe_experts = {experts}]",
            )
        )
    if m.moe_ffn_hidden_size is not None and m.moe_ffn_hidden_size < 1:
        errors.append(
            ConfigError("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size, "must be positive")
        )
    pattern = list(m.moe_layer_freq)
    if pattern and (len(pattern) != m.num_layers or set(pattern) - {0, 1}):
        errors.append(
            ConfigError(
                "model.moe_layer_freq",
                pattern,
                f"must be [] (every layer MoE) or one 0 (dense) / 1 (MoE) per layer "
                f"(model.num_layers = {m.num_layers})",
            )
        )
    arch = Architecture(m.architecture)
    if arch not in MOE_ARCHITECTURES:
        errors.append(
            ConfigError(
                "model.architecture",
                arch.value,
                "an MoE model (model.num_moe_experts set) maps onto Hugging Face's Qwen3-MoE or "
                "Qwen2-MoE only: set model.architecture=qwen3_moe (or qwen2_moe)",
            )
        )
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None and shared < 1:
        errors.append(
            ConfigError(
                "model.moe_shared_expert_intermediate_size", shared, "must be positive (or null)"
            )
        )  # fmt: skip
    elif shared and arch == Architecture.qwen3_moe:
        errors.append(
            ConfigError(
                "model.moe_shared_expert_intermediate_size",
                shared,
                "Qwen3-MoE has no shared expert (its export would drop it): set "
                "model.architecture=qwen2_moe, or the size to null",
            )
        )


def _check_unsupported(cfg: RunConfig, errors: list[ConfigError]) -> None:
    m, p = cfg.model, cfg.parallel
    _check_aux_loss(cfg, errors)
    capacity = m.moe_expert_capacity_factor
    backend = RolloutBackend(cfg.rollout.backend)
    if m.lora.rank > 0:
        _check_lora(cfg, backend, errors)
    if (
        Architecture(m.architecture) == Architecture.qwen2_moe
        and not m.add_qkv_bias
        and backend in (RolloutBackend.vllm, RolloutBackend.vllm_server)
    ):
        errors.append(
            ConfigError(
                "model.add_qkv_bias",
                m.add_qkv_bias,
                f"a Qwen2-MoE without q/k/v biases cannot roll out on rollout.backend="
                f"{backend.value}: vLLM's Qwen2-MoE always has them (it would keep its own for "
                "the ones the weight sync never sends, and sample another model): set "
                "rollout.backend=megatron, or model.add_qkv_bias=true",
            )
        )
    if p.ep > 1 and overlaps_generation(cfg):
        errors.append(
            ConfigError(
                "parallel.ep",
                p.ep,
                "with generation overlapping training (grpo.num_steps_async > 0): the "
                "generation worker is a one-process world per training rank, so it holds no "
                "expert-parallel group: set grpo.overlap_generation=false (the due rounds are "
                "generated inline, the same samples) or parallel.ep=1",
            )
        )
    if p.tp > 1 and capacity is not None and capacity > 0:
        errors.append(
            ConfigError(
                "model.moe_expert_capacity_factor",
                capacity,
                f"at parallel.tp={p.tp} is not supported yet: after the drops the "
                "tensor-parallel ranks hold different numbers of tokens, which the token "
                "dispatcher's all-gather over them cannot take (gloo refuses uneven sizes; "
                "not verified on NCCL): set it to null (dropless) or parallel.tp=1 "
                "(parallel.ep scales the experts)",
            )
        )
    if p.tp > 1 and not p.sequence_parallel:
        errors.append(
            ConfigError(
                "parallel.sequence_parallel",
                p.sequence_parallel,
                f"an MoE model at parallel.tp={p.tp} trains with sequence parallelism only "
                "(megatron-core refuses the MoE layer's training forward without it): set "
                "parallel.sequence_parallel=true",
            )
        )


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ATTENTION_ONLY = "[q_proj,k_proj,v_proj,o_proj]"


def _check_lora(cfg: RunConfig, backend: RolloutBackend, errors: list[ConfigError]) -> None:
    """LoRA on an MoE model adapts the attention projections of every layer and a Qwen2-MoE's
    shared expert (its gate/up/down projections); the routed experts and the router keep their
    weights (docs/lora.md, "MoE models")."""
    from rlbatch.config.lora import ALL_LINEAR

    m, targets = cfg.model, list(cfg.model.lora.target_modules)
    key = "model.lora.target_modules"
    named = [t for t in targets if t in MLP_PROJECTIONS]
    shared = bool(m.moe_shared_expert_intermediate_size)
    dense_layers = [i for i, x in enumerate(m.moe_layer_freq) if x == 0]
    if named and not shared:
        errors.append(
            ConfigError(
                key,
                targets,
                f"names {named} on an MoE model without a shared expert: in its sparse layers "
                "these are the routed experts' projections, which LoRA here does not adapt (the "
                "experts stay frozen; train them with model.lora.rank=0), and in its dense layers "
                "PEFT under transformers 5 maps these names onto the routed experts when it "
                "loads a Qwen3-MoE adapter, so the exported adapter would not load as trained: "
                f"adapt the attention, model.lora.target_modules={ATTENTION_ONLY} or "
                f"[{ALL_LINEAR}]",
            )
        )
    elif (named or ALL_LINEAR in targets) and dense_layers:
        what = f"[{ALL_LINEAR}]" if ALL_LINEAR in targets else f"names {named}, which"
        errors.append(
            ConfigError(
                key,
                targets,
                f"{what} on an MoE model with dense layers {dense_layers} "
                "(model.moe_layer_freq) would adapt those layers' MLPs, or leave them out without "
                "saying so; adapters on the dense MLPs of an MoE model are not supported (PEFT "
                "under transformers 5 maps their names onto the routed experts when it loads a "
                "Qwen3-MoE adapter): name the attention projections, model.lora.target_modules="
                f"{ATTENTION_ONLY}",
            )
        )
    if backend in VLLM_BACKENDS:
        errors.append(
            ConfigError(
                "model.lora.rank",
                m.lora.rank,
                f"LoRA on an MoE model with rollout.backend={backend.value} is not supported "
                "yet (vLLM's LoRA on MoE models, Qwen3-MoE and Qwen2-MoE, is not verified "
                "here): set rollout.backend=megatron, or model.lora.rank=0",
            )
        )


def check_routing_replay(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """``grpo.routing_replay``: an MoE policy rolled out on the built-in engine (the only one
    that records routing here), a pass to replay for r2, and no layout whose token order the
    replay does not follow (docs/grpo_loss.md, "Routing replay")."""
    from rlbatch.config.enums import RoutingReplay
    from rlbatch.grpo.lcm import old_pass_runs

    mode = RoutingReplay(cfg.grpo.routing_replay)
    if mode == RoutingReplay.none:
        return
    key = "grpo.routing_replay"
    if cfg.model.num_moe_experts is None:
        errors.append(
            ConfigError(key, mode.value, "replays expert routing: it needs an MoE model "
                        "(model.num_moe_experts): set grpo.routing_replay=none")
        )  # fmt: skip
        return
    backend = RolloutBackend(cfg.rollout.backend)
    if mode == RoutingReplay.r3 and backend != RolloutBackend.megatron:
        errors.append(
            ConfigError(
                key,
                mode.value,
                f"r3 replays the rollout's routing, which rollout.backend={backend.value} does "
                "not return here (vLLM's CPU build refuses routed-expert capture: 'AuxOutput "
                "Connector requires Model Runner V2', which needs Triton; on GPUs vLLM's V2 "
                "runner returns it as the 'routed_experts' of each request, which rlbatch does "
                "not request yet; megatron's dynamic engine records none): set "
                "rollout.backend=megatron, or grpo.routing_replay=r2 or none",
            )
        )
    if mode == RoutingReplay.r2 and not old_pass_runs(cfg):
        errors.append(
            ConfigError(
                key,
                mode.value,
                "r2 replays the old-logprob pass's routing, and this run has no such pass (it "
                "runs for rounds of several optimizer steps under a rollout correction: "
                "grpo.num_iterations or grpo.steps_per_generation > 1 and "
                "grpo.rollout_correction != none); otherwise pi_old is the training forward "
                "itself, whose routing r2 would replay onto itself: set grpo.routing_replay=none "
                "or r3",
            )
        )
    if cfg.parallel.cp > 1:
        errors.append(
            ConfigError(
                "parallel.cp",
                cfg.parallel.cp,
                f"with grpo.routing_replay={mode.value} is not supported yet (the replayed "
                "routing is laid out per whole sequence, not per context-parallel chunk): set "
                "parallel.cp=1",
            )
        )


def _check_aux_loss(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """rlbatch's load-balancing loss is computed from the routers' logits over whole samples,
    on each pipeline stage for its own routers (rlbatch.grpo.balance); under full activation
    recompute its gradient reaches the routers through their recomputed forward
    (rlbatch.engine.routing.recompute_handoff); under sequence parallelism each sample's
    statistics are summed over the tensor-parallel ranks (rlbatch.engine.routing.load_balance).
    """
    m, p = cfg.model, cfg.parallel
    coeff = m.moe_aux_loss_coeff
    if coeff < 0:
        errors.append(ConfigError("model.moe_aux_loss_coeff", coeff, "must be >= 0"))
    if coeff <= 0:
        return
    if p.cp > 1:
        errors.append(
            ConfigError(
                "model.moe_aux_loss_coeff",
                coeff,
                f"with parallel.cp={p.cp} is not supported yet: each context-parallel rank's "
                "routers see some chunks of every sample, whose statistics would have to be "
                "summed over the context-parallel group as they are over the tensor-parallel "
                "one, which is neither built nor verified (context parallelism does not run on "
                "the CPU, where rlbatch is tested): set parallel.cp=1 or the coefficient to 0",
            )
        )
