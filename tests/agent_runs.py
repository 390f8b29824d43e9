"""rlbatch-train on the tiny model with an agent harness (env.harness), for the agent e2e tests:
the guess-the-number data rendered as chat (qwen template, byte tokenizer), four episodes per
row."""

from __future__ import annotations

import subprocess


def train(bin_dir, env, cwd, *overrides):
    """The run with ``overrides`` on top, in ``cwd`` (where the harness files are)."""
    return subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_guess_number", "logging.plot=false",
         "logging.tensorboard=false", "trainer.checkpoint.export_hf=false", "env=default",
         "data.chat_template=qwen", "data.max_prompt_len=192", "env.max_total_tokens=320",
         "rollout.max_new_tokens=16", "grpo.global_batch_size=16", "grpo.num_generations=4",
         "batching.train.max_tokens=1024", "batching.infer.max_tokens=2048", *overrides],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=600,
    )  # fmt: skip
