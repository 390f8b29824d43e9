"""The Megatron engine: the only package that knows megatron-core's names (docs/engine.md).

cpu_compat (CPU layer), adapter (config -> Megatron configs), parallel (init / destroy),
model (GPTModel chunks, DDP, optimizer), schedule (plan-driven forward/backward), logprobs
(chunked logprob passes), hf / hf_config (Hugging Face interop), tokenizer.
Nothing is imported here: ``import rlbatch.engine`` stays free of torch and megatron.
"""
