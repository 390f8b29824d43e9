"""The Qwen2 / Qwen2.5 policy as megatron-core GPTModel chunks, its DDP wrapper and optimizer.

    chunks = build_model(cfg)                 # one GPTModel per virtual pipeline stage
    optimizer, scheduler = build_optimizer(cfg, chunks)

Local layer spec on CPU (transformer_engine cannot be installed there), the Transformer
Engine spec on GPU when it is importable. Needs :func:`rlbatch.engine.parallel.initialize`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch

from rlbatch.config.schema import ModelConfig, RopeScaling, RunConfig
from rlbatch.engine import adapter, lm_head, lora


def have_transformer_engine() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def layer_spec(config: Any, vp_stage: Optional[int] = None, *, allow_te: bool = True) -> Any:
    """TE spec on GPU with transformer_engine (and ``allow_te``: LoRA adapters hook megatron's
    own parallel linears, so an adapted model takes the local spec), else megatron's local spec
    (RMSNorm) with
    rlbatch.engine.attention's THD-capable core attention and the CPU layer's RMSNorm (which,
    unlike megatron's torch norm, supports sequence parallelism) for every norm, the final one
    included: a whole block spec for this (virtual) pipeline stage. An MoE model
    (``config.num_moe_experts``) gets megatron's MoE layer (sequential experts) in the layers
    ``config.moe_layer_freq`` marks, the dense layer elsewhere."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    te = allow_te and have_transformer_engine()
    if te and not config.num_moe_experts:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    if config.num_moe_experts:
        layers = specs.get_gpt_decoder_layer_specs(
            config, use_transformer_engine=te, normalization="RMSNorm"
        )
    else:
        layers = [
            specs.get_gpt_layer_local_spec(
                normalization="RMSNorm", qk_layernorm=config.qk_layernorm
            )
        ] * config.num_layers
    if not te:
        for spec in {id(s): s for s in layers}.values():
            _use_cpu_capable_modules(spec, config)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    if te:
        from megatron.core.extensions.transformer_engine import TENorm

        norm: Any = TENorm
    else:
        from rlbatch.engine.cpu_compat import SequenceParallelRMSNorm

        norm = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(
        layer_specs=layers[offset : offset + num_layers], layer_norm=norm
    )


def _use_cpu_capable_modules(spec: Any, config: Any) -> None:
    """The local spec's core attention and norms replaced by rlbatch's (packed micro-batches as
    THD; norms that support sequence parallelism)."""
    from rlbatch.engine.attention import SegmentedDotProductAttention
    from rlbatch.engine.cpu_compat import SequenceParallelRMSNorm

    spec.submodules.self_attention.submodules.core_attention = SegmentedDotProductAttention
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    if config.qk_layernorm:  # Qwen3: per-head norms; megatron all-reduces their grads over TP
        spec.submodules.self_attention.submodules.q_layernorm = SequenceParallelRMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = SequenceParallelRMSNorm


@contextlib.contextmanager
def sequence_parallel_off(model: Sequence[Any]) -> Iterator[None]:
    """Run ``model`` (this rank's chunks) without sequence parallelism for the duration.

    Generation decodes one token per step, which sequence parallelism (splitting the sequence
    over the tensor-parallel ranks) cannot shard. Megatron reads the switch at forward time in
    three places, all turned off here and restored after: the shared TransformerConfig
    (transformer block, rotary length, attention), every layer's own ``sequence_parallel`` flag
    (column/row-parallel linears, TE's linears and layernorm-linears) and the embeddings'
    ``reduce_scatter_embeddings``. Tensor parallelism stays: the linears then all-reduce instead
    of reduce-scatter / all-gather, which gives the same activations. The parameters' own
    ``sequence_parallel`` marks only steer gradient reduction and are left alone."""
    flipped: list[tuple[Any, str]] = []
    for chunk in model:
        for module in chunk.modules():
            for name in ("sequence_parallel", "reduce_scatter_embeddings"):
                if module.__dict__.get(name) is True:
                    flipped.append((module, name))
            config = module.__dict__.get("config")
            if getattr(config, "sequence_parallel", False) is True:
                flipped.append((config, "sequence_parallel"))
    flipped = list({(id(obj), name): (obj, name) for obj, name in flipped}.values())
    for obj, name in flipped:
        setattr(obj, name, False)
    try:
        yield
    finally:
        for obj, name in flipped:
            setattr(obj, name, True)


def check_model_config(model: ModelConfig, tp: int = 1, pp: int = 1, vpp: int = 1) -> None:
    errors = []
    if model.num_attention_heads % model.num_query_groups:
        errors.append("model.num_query_groups must divide model.num_attention_heads")
    if model.head_dim is None and model.hidden_size % model.num_attention_heads:
        errors.append("model.num_attention_heads must divide model.hidden_size")
    if model.num_query_groups % tp:
        errors.append(
            f"parallel.tp={tp} must divide model.num_query_groups={model.num_query_groups}"
        )
    if model.vocab_size % tp:
        errors.append(f"parallel.tp={tp} must divide model.vocab_size={model.vocab_size}")
    if model.num_layers % (pp * vpp):
        errors.append(f"parallel.pp*vpp={pp * vpp} must divide model.num_layers={model.num_layers}")
    if errors:
        raise ValueError("invalid model/parallel config: " + "; ".join(errors))


def build_chunk(
    model: ModelConfig,
    config: Any,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: Optional[int],
) -> Any:
    """One GPTModel (a pipeline stage, or a virtual one)."""
    from megatron.core.models.gpt import GPTModel

    chunk = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, vp_stage, allow_te=not lora.targeted(model.lora)),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        vp_stage=vp_stage,
        **adapter.rope_kwargs(model),
    )
    if model.rope_scaling == RopeScaling.llama3:
        _set_llama3_bands(chunk.rotary_pos_emb, model)
    lm_head.make_output_switchable(chunk, model.logits_chunk_tokens)
    return chunk


def _set_llama3_bands(rope: Any, model: ModelConfig) -> None:
    """Megatron's llama3 scaling with this model's band factors and original context (its
    RotaryEmbedding applies the Llama-3.1 values 1 / 4 / 8192 itself)."""
    dim = rope.inv_freq.numel() * 2
    base = 1.0 / (
        model.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rope.inv_freq.device) / dim)
    )
    rope.inv_freq = rope._apply_scaling(
        base,
        factor=model.rope_scaling_factor,
        low_freq_factor=model.rope_low_freq_factor,
        high_freq_factor=model.rope_high_freq_factor,
        original_max_position_embeddings=(
            model.rope_original_max_position_embeddings or model.max_position_embeddings
        ),
    )


def build_model(
    cfg: RunConfig,
    wrap_ddp: bool = True,
    *,
    calculate_per_token_loss: bool = False,
) -> list[Any]:
    """This rank's model chunks (one per virtual pipeline stage; one when vpp == 1), wrapped in
    Megatron DDP when ``wrap_ddp`` (training). The schedule hooks (no_sync, finalize grads) are
    set on the shared TransformerConfig.

    ``calculate_per_token_loss``: Megatron's per-token loss mode (the loss function returns
    (sum, count, metrics); no 1/num_microbatches; finalize_model_grads divides by the DP sum of
    the counts)."""
    from megatron.core import parallel_state as ps

    p = cfg.parallel
    check_model_config(cfg.model, p.tp, p.pp, p.vpp)
    config = adapter.transformer_config(
        cfg.model,
        p,
        calculate_per_token_loss=calculate_per_token_loss,
        microbatch_group_size=p.microbatch_group_size_per_vp_stage,
    )
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        chunk = build_chunk(
            cfg.model,
            config,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    # before DDP: frozen base weights get no gradient buffer and no optimizer state
    lora.attach_adapters(chunks, cfg.model, cfg.trainer.seed)
    if cfg.model.moe_freeze_router:
        freeze_routers(chunks)
    if wrap_ddp:
        chunks = wrap_in_ddp(chunks, cfg)
    return chunks


def freeze_routers(chunks: list[Any]) -> int:
    """``model.moe_freeze_router``: every MoE router's weights out of training (before DDP:
    no gradient buffer, no optimizer state). Returns the number of router tensors frozen."""
    frozen = 0
    for chunk in chunks:
        for name, param in adapter.unwrap(chunk).named_parameters():
            if ".mlp.router." in f".{name}":
                param.requires_grad_(False)
                frozen += 1
    return frozen


def wrap_in_ddp(chunks: list[Any], cfg: RunConfig) -> list[Any]:
    """Megatron DistributedDataParallel per chunk (bucketing on the first chunk only) and the
    schedule hooks: no_sync_func and finalize_model_grads_func."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    config = chunks[0].config
    ddp = adapter.ddp_config(cfg.parallel)
    wrapped = [
        DistributedDataParallel(
            config=config, ddp_config=ddp, module=chunk, disable_bucketing=(i > 0)
        )
        for i, chunk in enumerate(chunks)
    ]
    no_sync = [m.no_sync for m in wrapped]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(cfg: RunConfig, model: list[Any]) -> tuple[Any, Any]:
    """Megatron optimizer (get_megatron_optimizer: FP32 AdamW on CPU; bf16 / distributed on GPU
    when configured) and its LR scheduler (trainer.optim over trainer.max_steps; call
    ``scheduler.step(increment=1)`` after each optimizer step)."""
    from megatron.core.optimizer import get_megatron_optimizer

    opt_cfg = adapter.optimizer_config(cfg.trainer.optim, cfg.model, cfg.parallel)
    optimizer = get_megatron_optimizer(opt_cfg, model)
    scheduler = adapter.lr_scheduler(optimizer, cfg.trainer.optim, cfg.trainer.max_steps)
    return optimizer, scheduler


def num_parameters(model: list[Any]) -> int:
    """Parameters on this rank (a tied embedding counted once per stage that holds it)."""
    return sum(p.numel() for chunk in model for p in chunk.parameters())


def num_trainable_parameters(model: list[Any]) -> int:
    """Parameters on this rank that train (all of them, or the LoRA adapters)."""
    return sum(p.numel() for chunk in model for p in chunk.parameters() if p.requires_grad)


def count_parameters(model: list[Any]) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model: every tensor-parallel shard, pipeline
    stage and routed expert once (a tensor replicated over tp counted on tp rank 0, the last stage's copy
    of a tied embedding not at all). Collective over the world: every rank calls."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from rlbatch.distributed import all_gather_object

    trainable = total = 0
    first_copy = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    first_expert_copy = ps.get_expert_data_parallel_rank() == 0
    for chunk in model:
        for p in adapter.unwrap(chunk).parameters():
            if getattr(p, "shared", False) or not param_is_not_tensor_parallel_duplicate(p):
                continue
            # a routed expert's weights (megatron: allreduce=False) live on one expert-parallel
            # rank, which may be any data-parallel rank
            if not (first_copy if getattr(p, "allreduce", True) else first_expert_copy):
                continue
            total += p.numel()
            trainable += p.numel() if p.requires_grad else 0
    counts = all_gather_object((trainable, total))
    return sum(c[0] for c in counts), sum(c[1] for c in counts)
