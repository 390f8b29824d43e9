"""Agents through an OpenAI-compatible endpoint (env.harness; docs/agents.md): the endpoint
(``endpoint``), the rendering of messages and tool calls (``chat``), episodes to samples
without re-tokenizing (``episodes``), harnesses (``harness``) and the rollout engine that runs
them (``engine``). A rollout-protocol implementation: nothing here imports rlbatch.train."""
