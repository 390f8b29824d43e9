"""rlbatch config -> megatron-core configs: the one place that spells Megatron's field names.

``transformer_config`` (TransformerConfig), ``ddp_config`` (DistributedDataParallelConfig),
``optimizer_config`` (OptimizerConfig) and ``lr_scheduler`` (OptimizerParamScheduler). The rest
of rlbatch reads its own schema (rlbatch.config.schema) and calls these.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from rlbatch.config.errors import ConfigError, ConfigErrors
from rlbatch.config.schema import (
    Dtype,
    LrSchedule,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    Recompute,
    RopeScaling,
)

DTYPES = {Dtype.fp32: torch.float32, Dtype.bf16: torch.bfloat16, Dtype.fp16: torch.float16}


def torch_dtype(dtype: Dtype | str) -> torch.dtype:
    return DTYPES[Dtype(dtype)]


def on_gpu() -> bool:
    return torch.cuda.is_available()


def have_fused_softmax() -> bool:
    """Whether megatron's fused masked-softmax CUDA kernel is installed."""
    import importlib.util

    return importlib.util.find_spec("scaled_masked_softmax_cuda") is not None


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    calculate_per_token_loss: bool = False,
    microbatch_group_size: Optional[int] = None,
) -> Any:
    """Qwen2-architecture TransformerConfig (RMSNorm, SwiGLU, RoPE, GQA, QKV bias).

    ``variable_seq_lengths=True`` always (the plan's micro-batches differ in shape); megatron
    0.16.1 then requires moe_token_dispatcher_type="alltoall" even for dense models. The
    parallel layout, precision / device and recompute settings come from the helpers below.
    """
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        **_architecture_kwargs(model),
        **_parallel_kwargs(parallel, microbatch_group_size),
        **_device_kwargs(model),
        **_recompute_kwargs(model),
        **moe_kwargs(model, parallel),
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=calculate_per_token_loss,
    )
    if model.rope_scaling == RopeScaling.yarn:
        _set_yarn_attributes(config, model)
    return config


def _architecture_kwargs(model: ModelConfig) -> dict[str, Any]:
    """The Qwen2 architecture: sizes, RMSNorm, SwiGLU, GQA, QKV bias, no dropout."""
    return dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim or model.hidden_size // model.num_attention_heads,
        qk_layernorm=model.qk_layernorm,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
    )


def moe_kwargs(model: ModelConfig, parallel: ParallelConfig) -> dict[str, Any]:
    """The MoE layer (``model.num_moe_experts`` set; {} for a dense model): megatron's
    sequential experts (the grouped GEMM needs its CUDA library), the all-to-all dispatcher
    without permute fusion (a TE kernel), the router in fp32 with a softmax score, top-k taken
    on the logits then softmaxed over the k (= HF's softmax, top-k, renormalise:
    ``moe_norm_topk_prob``) or softmax over every expert then top-k (not renormalised), expert
    parallelism ``parallel.ep`` with the experts' tensor parallelism equal to ``parallel.tp``.
    megatron's load-balancing losses stay off: ``model.moe_aux_loss_coeff`` weights rlbatch's
    (rlbatch.grpo.balance)."""
    if not model.num_moe_experts:
        return {}
    kwargs: dict[str, Any] = dict(
        num_moe_experts=model.num_moe_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
        moe_layer_freq=list(model.moe_layer_freq) or 1,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_dtype="fp32",
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not model.moe_norm_topk_prob,
        # rlbatch's own load-balancing loss (per sample, padding masked, normalized with the
        # policy loss: rlbatch.engine.routing.load_balance); megatron's are per micro-batch
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_expert_capacity_factor=model.moe_expert_capacity_factor,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.tp,
    )
    if model.moe_shared_expert_intermediate_size:  # Qwen2-MoE: sigmoid(gate(x)) * shared(x)
        kwargs.update(
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=True,
        )
    return kwargs


def _parallel_kwargs(
    parallel: ParallelConfig, microbatch_group_size: Optional[int]
) -> dict[str, Any]:
    """tp / pp / vpp / cp / sequence parallelism. With interleaving (vpp > 1):
    overlap_p2p_comm=True and batch_p2p_comm=False (the default batched p2p is silently wrong
    with pp=2, where the previous and next rank are the same peer)."""
    interleaved = parallel.vpp > 1
    kwargs: dict[str, Any] = dict(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if interleaved else None,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.sequence_parallel and parallel.tp > 1,
    )
    if interleaved:
        kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
        if microbatch_group_size is not None:
            kwargs["microbatch_group_size_per_vp_stage"] = microbatch_group_size
    return kwargs


def _device_kwargs(model: ModelConfig) -> dict[str, Any]:
    """Precision and device: ``model.params_dtype`` for parameters and the pipeline; on CPU
    (no CUDA) CPU initialisation and every CUDA fusion off (docs/engine.md)."""
    gpu = on_gpu()
    dtype = torch_dtype(model.params_dtype)
    return dict(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not gpu,
        perform_initialization=True,
        bias_activation_fusion=gpu,
        # megatron's fused softmax is a compiled extension (apex / Megatron-LM's kernels) that a
        # plain megatron-core install lacks: with it missing, megatron would import it mid-forward
        masked_softmax_fusion=gpu and have_fused_softmax(),
        persist_layer_norm=gpu,
        bias_dropout_fusion=gpu,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )


def _recompute_kwargs(model: ModelConfig) -> dict[str, Any]:
    """Activation recomputation (``model.recompute``): full = every layer, uniformly."""
    if model.recompute == Recompute.full:
        return dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    if model.recompute == Recompute.selective:
        return dict(recompute_granularity="selective")
    return {}


def _set_yarn_attributes(config: Any, model: ModelConfig) -> None:
    """YaRN's settings: optional attributes (not dataclass fields) that GPTModel and attention
    read from the config."""
    config.yarn_rotary_scaling_factor = model.rope_scaling_factor
    config.yarn_original_max_position_embeddings = (
        model.rope_original_max_position_embeddings or model.max_position_embeddings
    )
    config.yarn_beta_fast = model.rope_beta_fast
    config.yarn_beta_slow = model.rope_beta_slow
    config.yarn_mscale = 1.0
    config.yarn_mscale_all_dim = 0.0
    config.yarn_correction_range_round_to_int = True


def rope_kwargs(model: ModelConfig) -> dict[str, Any]:
    """GPTModel's position-embedding arguments for ``model.rope_*`` (llama3's band factors
    are applied by :func:`rlbatch.engine.model.build_chunk`)."""
    scaling = RopeScaling(model.rope_scaling)
    kwargs: dict[str, Any] = dict(
        position_embedding_type="yarn" if scaling == RopeScaling.yarn else "rope",
        rotary_percent=1.0,
        rotary_base=model.rope_theta,
    )
    if scaling == RopeScaling.linear:
        kwargs["seq_len_interpolation_factor"] = model.rope_scaling_factor
    elif scaling == RopeScaling.llama3:
        kwargs.update(rope_scaling=True, rope_scaling_factor=model.rope_scaling_factor)
    return kwargs


def ddp_config(parallel: ParallelConfig) -> Any:
    """Megatron DistributedDataParallelConfig: fp32 grad buffers and reduction; with the
    distributed optimizer the buffers are reduce-scattered instead of all-reduced."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )


def optimizer_config(optim: OptimConfig, model: ModelConfig, parallel: ParallelConfig) -> Any:
    """Megatron OptimizerConfig: AdamW; FP32 on CPU (megatron's bf16/fp16 optimizers expect CUDA
    tensors), mixed precision on GPU; the distributed optimizer (optimizer state sharded over
    DP) wherever it is asked for (on CPU through rlbatch.engine.cpu_compat)."""
    from megatron.core.optimizer import OptimizerConfig

    gpu = on_gpu()
    dtype = torch_dtype(model.params_dtype)
    if not gpu and dtype != torch.float32:
        raise ConfigErrors(
            [
                ConfigError(
                    "model.params_dtype",
                    model.params_dtype,
                    "megatron-core's bf16/fp16 optimizers need CUDA: on CPU train with "
                    "model.params_dtype=fp32 (forward-only rlbatch-logprobs runs bf16 on CPU)",
                )
            ]
        )
    return OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=gpu and dtype == torch.bfloat16,
        fp16=gpu and dtype == torch.float16,
        params_dtype=dtype if gpu else torch.float32,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )


_DECAY_STYLE = {
    LrSchedule.constant: "constant",
    LrSchedule.linear: "linear",
    LrSchedule.cosine: "cosine",
}


def lr_scheduler(optimizer: Any, optim: OptimConfig, max_steps: int) -> Any:
    """OptimizerParamScheduler over ``max_steps`` optimizer steps (one increment per step)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = min(optim.warmup_steps, max(max_steps - 1, 0))
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=min(optim.min_lr, optim.lr),
        lr_warmup_steps=warmup,
        lr_decay_steps=max(max_steps, warmup + 1),
        lr_decay_style=_DECAY_STYLE[LrSchedule(optim.schedule)],
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(max_steps, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def unwrap(chunk: Any) -> Any:
    """The GPTModel inside a DDP (or other) wrapper."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
