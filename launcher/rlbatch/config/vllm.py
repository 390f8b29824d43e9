"""Config section ``rollout.vllm``: the vLLM rollout engine (``rollout.backend=vllm``;
docs/rollout.md).

One in-process vLLM engine per training rank (colocated), started from the model config alone
and fed the policy's weights before every generation with a new policy version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class VllmConfig:
    tensor_parallel_size: int = 1
    """vLLM's own tensor-parallel size, independent of parallel.tp: 1 = one full engine on every
    training rank (a training layout of tp 2 generates with two identical full engines). Only 1
    is supported in this release (the CPU build cannot shard)."""
    dtype: Optional[str] = None
    """Engine dtype: float32, bfloat16 or float16; null = the training dtype
    (model.params_dtype)."""
    kv_cache_space_gb: float = 1.0
    """CPU build: memory reserved for vLLM's paged KV cache, in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.3
    """GPU build: share of the GPU's memory vLLM may take (weights and KV cache), beside the
    training process's own."""
    max_num_seqs: int = 64
    """Most sequences vLLM decodes at once (its continuous batch)."""
    max_model_len: Optional[int] = None
    """Longest sequence (prompt + response) vLLM accepts; null = the run's longest sequence
    (data.max_prompt_len + rollout.max_new_tokens, or evaluation's eval.data.max_prompt_len +
    eval.max_new_tokens when longer). At most model.max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (a group's G rows share their prompt). Reset
    after every weight sync."""
    enforce_eager: bool = True
    """true: no CUDA graphs / torch.compile (fastest start, the CPU default); false: vLLM
    compiles and captures graphs (GPUs: faster decoding after a slower start)."""
    block_size: Optional[int] = None
    """Tokens per KV-cache block; null = vLLM's default (CPU: 128). Only whole blocks are reused
    by the prefix cache."""
    segment_tokens: int = 32
    """Partial rollouts (grpo.partial_rollouts): tokens a row decodes per request before the
    stream checks whether its round can end and refills free slots. A row that goes on is sent
    again as prompt + its tokens so far (the prefix cache keeps its whole KV blocks; after a
    weight sync they are recomputed under the new weights). Smaller: a round ends closer to the
    token at which it could, and free slots refill sooner; larger: fewer requests."""
