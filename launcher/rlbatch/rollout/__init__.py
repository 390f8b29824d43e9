"""Rollout backends behind one protocol (docs/rollout.md).

- :mod:`rlbatch.rollout.protocol`: ``TokenBackend`` (an engine that decodes token ids from its
  own copy of the weights and takes the policy's weights on demand) and ``SyncedRolloutEngine``,
  the ``RolloutEngine`` the GRPO loop calls on top of one: it syncs the weights whenever the
  policy version changes, derives one seed per row, and makes the ``Sample``s.
- :mod:`rlbatch.rollout.weights`: the policy's megatron-core parameters as a stream of Hugging
  Face-named full tensors, one at a time, under any tp / pp / vpp split.
- :mod:`rlbatch.rollout.vllm_engine`: ``rollout.backend=vllm``, an in-process vLLM engine.

The built-in engine and megatron_dynamic still live in rlbatch.grpo.rollout and
rlbatch.engine.dynamic_rollout.
"""
