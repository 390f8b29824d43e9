"""The engines that decode a run's rollouts.

Nothing is imported here (``import rlbatch.rollout.engines`` stays free of torch):

- :mod:`.builtin`: the ``RolloutEngine`` protocol, the built-in engine on the policy's own
  weights (``rollout.backend=megatron``) and ``build_rollout_engine``, the table of backends.
- :mod:`.megatron_dynamic`: megatron-core's own inference engine (CUDA only).
- :mod:`.vllm_engine` / :mod:`.vllm_moe_repack`: an in-process vLLM engine per rank
  (``rollout.backend=vllm``) and its CPU build's MoE weight layout after an update.
"""
