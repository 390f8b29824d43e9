"""Multi-turn environments and tool calls (``env.*``, docs/environments.md).

- :mod:`rlbatch.env.protocol`: what an environment is (``reset`` / ``step``) and what ``step``
  returns;
- :mod:`rlbatch.env.loader`: loading by import path and the checks the driver runs before
  launch (the same loader as reward functions);
- :mod:`rlbatch.env.driver`: the multi-turn driver the rollout engine calls: it runs the
  environment's calls, renders observations to token ids and applies the limits;
- :mod:`rlbatch.env.calculator`, :mod:`rlbatch.env.guess_number`: the built-in environments,
  ordinary users of the protocol.
"""
