"""Rollout: everything that turns prompts into ``Sample``s (docs/rollout.md).

Nothing is imported here: ``import rlbatch.rollout`` stays free of torch.

- :mod:`rlbatch.rollout.engines.builtin`: the ``RolloutEngine`` protocol the GRPO loop calls, the
  built-in engine (``rollout.backend=megatron``: continuous batching or lockstep decoding on the
  policy's own weights) and ``build_rollout_engine``, the table of backends.
- :mod:`rlbatch.rollout.engines.megatron_dynamic`: ``rollout.backend=megatron_dynamic``, megatron-core's
  own inference engine (rlbatch.engine.dynamic_inference; CUDA only) as a ``RolloutEngine``.
- :mod:`rlbatch.rollout.protocol`: ``TokenBackend`` (an engine that decodes token ids from its
  own copy of the weights and takes the policy's weights on demand) and ``SyncedRolloutEngine``,
  the ``RolloutEngine`` on top of one: it syncs the weights whenever the policy version changes,
  derives one seed per row, and makes the ``Sample``s.
- :mod:`rlbatch.rollout.engines.vllm_engine`: ``rollout.backend=vllm``, an in-process vLLM engine.
- :mod:`rlbatch.rollout.weights`: the policy's megatron-core parameters as a stream of Hugging
  Face-named full tensors, one at a time, under any tp / pp / vpp split.
- :mod:`rlbatch.rollout.sampling`: keyed sampling (same seed, same samples, whatever the batch).
- :mod:`rlbatch.rollout.multiturn` / :mod:`rlbatch.rollout.partial`: the decode loops for
  environment turns and for partial rollouts that span weight swaps;
  :mod:`rlbatch.rollout.turns` / :mod:`rlbatch.rollout.segments` run them on a ``TokenBackend``
  (vLLM: a turn, or a segment of a partial rollout, per request), and ``build_turn_driver``
  shares one environment over a model-parallel group.
- :mod:`rlbatch.rollout.generation` / :mod:`rlbatch.rollout.streaming` /
  :mod:`rlbatch.rollout.generation_worker`: the per-rank generate function the training loop
  consumes, the streams that feed it, and the process that can run it beside the trainer.
- :mod:`rlbatch.rollout.servers`: rollout servers (``rollout.backend=vllm_server``).
- :mod:`rlbatch.rollout.agent`: the OpenAI-compatible endpoint agent harnesses call.

The model forwards the built-in engine decodes with (KV cache, pipeline send / receive) live in
:mod:`rlbatch.engine.generation`, which knows nothing of samples or rewards.
"""
