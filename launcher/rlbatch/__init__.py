"""rlbatch: GRPO training on megatron-core with exact, waste-free dynamic batching."""

__version__ = "0.1.0"
