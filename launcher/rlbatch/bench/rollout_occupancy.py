"""rlbatch-bench rollout --occupancy: decode-slot occupancy of the built-in (round) engine on
the long-tailed response-length workload.

    rlbatch-bench rollout --occupancy [--chunk-prompts 8,4,2,1] [--rounds 20] [--prompts 8]
        [--generations 8] [--max-new-tokens 128] [--median 12] [--sigma 1.0] [--json]

The default recipe's model (``+recipe=grpo_qwen``, its random initialisation) generates
``--rounds`` rounds of ``--prompts`` prompts x ``--generations`` rows; every row stops at its
own lognormal-drawn length (debug.response_length_median / response_length_sigma, as
``rlbatch-bench grpo --async --workload longtail``). Per decoding batch of ``chunk`` prompts
(``chunk x generations`` slots: rollout.micro_batch_size) and path (continuous batching, where
a finished row's slot takes the next row of the round; lockstep chunks, where a chunk runs
until its last row ends): the occupancy (busy slot-steps / slot-steps, ``DecodeStats``) per
round, and the decode steps and generated tokens per round. On a GPU a decode step costs about
the same however many slots are busy, so tokens per decode step is the throughput; a round
still ends with its longest row, which is what partial rollouts remove.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rlbatch-bench rollout --occupancy", description=__doc__.split("\n")[0]
    )
    p.add_argument("--occupancy", action="store_true", help="this benchmark (required)")
    p.add_argument("--chunk-prompts", default="8,4,2,1", help="prompts per decoding batch")
    p.add_argument("--rounds", type=int, default=20, help="rounds (seeds 0..rounds-1)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per round")
    p.add_argument("--generations", type=int, default=8, help="rows per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--median", type=int, default=12, help="debug.response_length_median")
    p.add_argument("--sigma", type=float, default=1.0, help="debug.response_length_sigma")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return p.parse_args(argv)


def overrides(args: argparse.Namespace) -> list[str]:
    return [
        "+recipe=grpo_qwen",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"debug.response_length_median={args.median}",
        f"debug.response_length_sigma={args.sigma}",
    ]


def measure(engine: Any, prompts: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """Occupancy, decode steps and tokens of each round on this engine configuration."""
    from rlbatch.rollout.engines.builtin import DecodeStats

    occupancy, steps, tokens = [], [], []
    for r in range(args.rounds):
        engine.decode_stats = DecodeStats()
        block = prompts[r * args.prompts : (r + 1) * args.prompts]
        out = engine.generate(block, args.generations, 0, seed=r)
        occupancy.append(engine.decode_stats.occupancy)
        steps.append(engine.decode_stats.steps)
        tokens.append(sum(len(s.response_ids) for s in out))
    return {
        "occupancy_mean": statistics.fmean(occupancy),
        "occupancy_min": min(occupancy),
        "occupancy_max": max(occupancy),
        "decode_steps_per_round": statistics.fmean(steps),
        "tokens_per_round": statistics.fmean(tokens),
        "tokens_per_decode_step": sum(tokens) / sum(steps),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rlbatch.bench.grpo import bench_sampling
    from rlbatch.cli.common import compose
    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model
    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.grpo.data import load_prompts
    from rlbatch.rollout.engines.builtin import MegatronRolloutEngine

    torch.set_num_threads(1)
    cfg = compose(overrides(args), "rlbatch-bench rollout --occupancy")
    cfg.data.num_prompts = max(cfg.data.num_prompts, args.rounds * args.prompts)
    if not parallel.is_initialized():
        parallel.initialize(cfg)
    parallel.seed(cfg.trainer.seed)
    model = build_model(cfg, wrap_ddp=False)
    tokenizer = build_tokenizer(cfg.model)
    prompts = load_prompts(cfg.data, tokenizer, cfg.trainer.seed)
    params = bench_sampling(cfg, tokenizer)  # the run's whole EOS set, as training stops
    cells = []
    for chunk in [int(c) for c in args.chunk_prompts.split(",")]:
        for path, continuous in (("continuous", True), ("lockstep", False)):
            engine = MegatronRolloutEngine(model, params, chunk_size=chunk, continuous=continuous)
            cell = measure(engine, prompts, args)
            cells.append({"slots": chunk * args.generations, "path": path} | cell)
    setup = vars(args) | {"rows_per_round": args.prompts * args.generations}
    return {"cells": cells, "setup": setup}


def format_report(result: dict[str, Any]) -> str:
    rows = result["setup"]["rows_per_round"]
    lines = [
        f"rows per round: {rows}",
        "slots  path        occupancy (min-max)   decode steps/round  tokens/round  tokens/step",
    ]
    for c in result["cells"]:
        lines.append(
            f"{c['slots']:>5}  {c['path']:<10} {c['occupancy_mean']:>6.3f} ({c['occupancy_min']:.2f}"
            f"-{c['occupancy_max']:.2f}) {c['decode_steps_per_round']:>19.1f}"
            f" {c['tokens_per_round']:>13.1f} {c['tokens_per_decode_step']:>12.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0
