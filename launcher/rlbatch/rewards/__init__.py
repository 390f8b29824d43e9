"""Rewards users bring: programs run in a sandbox against tests (``code_exec``), rewards
served over HTTP (``http``) or by an LLM judge (``judge``), and a local reward model
(``reward_model``). Each kind scores a batch of :class:`rlbatch.grpo.rewards.RewardInput` into
:class:`Scored` values (a reward and the reason of every failure); rlbatch.grpo.rewards
dispatches ``data.reward`` / ``data.reward_fn`` entries to them."""
