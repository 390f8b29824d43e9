"""Shape twins: a recipe's parallel layout and options on a tiny model of the same architecture.

    python -m rlbatch.config.twin grpo_qwen2_5_7b      # prints the overrides, one per line
    rlbatch-train +recipe=grpo_qwen2_5_7b $(python -m rlbatch.config.twin grpo_qwen2_5_7b) \\
        data.path=math.jsonl

A twin keeps what makes a recipe's run shape: tensor parallelism with its sequence_parallel,
pipeline and virtual pipeline sizes, the distributed optimizer, overlap_grad_reduce, batching
modes and rounds, normalization, loss aggregation, steps_per_generation, num_steps_async,
aggregation settings, checkpointing and the environment of a multi-turn recipe (its
env.max_total_tokens grown to hold the twin's prompt length). It shrinks what only makes a run big: the model
(``model=tiny_twin``: layers a multiple of pp * vpp, 4 heads in 2 query groups, the byte
tokenizer; the recipe model's embedding tying, QKV bias and recompute copied; an MoE recipe's
twin is ``model=tiny_moe`` with the recipe's frozen router and ep within the twin's dp), tp and dp to at
most :data:`MAX_TP` / :data:`MAX_DP` (so it fits one machine), one node, the batch (whole groups
of ``num_generations`` on every DP rank), prompt and response lengths, and the step count. On
CPU the parameters are fp32 (megatron's bf16 optimizer needs CUDA).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from rlbatch.config.schema import RunConfig

MAX_TP = 2
MAX_DP = 2
NUM_STEPS = 2
NUM_GENERATIONS = 2
MAX_NEW_TOKENS = 8
MAX_PROMPT_LEN = 256
"""The twin's prompt cap, raised to the recipe's own up to :data:`MAX_PROMPT_CAP` (within
tiny_twin's max_position_embeddings): the twin's byte tokenizer spells a recipe's shipped prompts
in more tokens than the recipe model's tokenizer does."""
MAX_PROMPT_CAP = 384


def _value(value: Any) -> str:
    text = getattr(value, "value", value)
    return "null" if text is None else str(text).lower() if isinstance(text, bool) else str(text)


def twin_overrides(cfg: RunConfig, *, cpu: bool = True) -> list[str]:
    """Hydra overrides turning the composed recipe ``cfg`` into its shape twin."""
    p, m = cfg.parallel, cfg.model
    tp, dp = min(p.tp, MAX_TP), min(p.dp, MAX_DP)
    stages = p.pp * max(p.vpp, 1)
    num_layers = stages * max(1, -(-2 // stages))  # at least 2 layers
    # one prompt per DP rank per optimizer step, whole groups: the smallest valid batch
    global_batch = NUM_GENERATIONS * dp
    prompt_len = max(MAX_PROMPT_LEN, min(cfg.data.max_prompt_len, MAX_PROMPT_CAP))
    out = [
        "model=tiny_twin",
        f"model.num_layers={num_layers}",
        f"model.tie_word_embeddings={_value(m.tie_word_embeddings)}",
        f"model.add_qkv_bias={_value(m.add_qkv_bias)}",
        f"model.recompute={_value(m.recompute)}",
        f"parallel.tp={tp}",
        f"parallel.dp={dp}",
        "parallel.nnodes=1",
        "parallel.node_rank=0",
        "parallel.nproc_per_node=null",
        "parallel.rdzv_endpoint=null",
        "parallel.backend=auto",
        f"trainer.max_steps={NUM_STEPS}",
        f"grpo.num_generations={NUM_GENERATIONS}",
        f"grpo.global_batch_size={global_batch}",
        "grpo.generation_batch_size=null",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        f"data.max_prompt_len={prompt_len}",
        "grpo.aggregation.rollout_micro_batch_size=1",
        "grpo.aggregation.ref_logps_micro_batch_size=1",
        "grpo.aggregation.old_logps_micro_batch_size=1",
        "grpo.aggregation.teacher_logps_micro_batch_size=1",
        "grpo.aggregation.train_micro_batch_size=1",
        "rollout.micro_batch_size=1",
    ]
    if cfg.env.path:  # a trajectory holds the (longer) twin prompt and every turn
        per_turn = MAX_NEW_TOKENS + cfg.env.max_observation_tokens
        out.append(f"env.max_total_tokens={prompt_len + cfg.env.max_turns * per_turn}")
    if m.num_moe_experts:  # an MoE recipe: the tiny MoE, expert parallelism within the twin's dp
        out[0] = "model=tiny_moe"
        out += [f"parallel.ep={math.gcd(p.ep, dp)}", "model.moe_layer_freq=[]",
                f"model.moe_freeze_router={_value(m.moe_freeze_router)}"]  # fmt: skip
    if cpu:
        out.append("model.params_dtype=fp32")
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the twin overrides of the recipe named in argv (extra overrides are applied first)."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m rlbatch.config.twin RECIPE [OVERRIDE ...]", file=sys.stderr)
        return 2
    print("\n".join(twin_overrides(compose_recipe(args[0], args[1:]))))
    return 0


def compose_recipe(name: str, overrides: list[str] | None = None) -> RunConfig:
    """The recipe's config, read for its shape: only the model section is validated (its
    site-specific keys, e.g. data.path or a multi-node rendezvous, may still be unset)."""
    from rlbatch.cli.common import compose

    return compose([f"+recipe={name}", *(overrides or [])], "twin", scope=frozenset({"model"}))


if __name__ == "__main__":
    raise SystemExit(main())
