"""rlbatch-bench rollout --env NAME: multi-turn rollout throughput of the built-in engine.

    rlbatch-bench rollout --env calculator [--rows 64] [--slots 16] [--max-new-tokens 16]
                          [--max-turns 3] [--repeats 3] [--threads 1] [--json]

The built-in environment NAME (calculator or guess_number, with its conf/env and conf/data
settings) drives episodes of the tiny CPU model (the grpo_calculator / grpo_guess_number
recipes' policy) through continuous batching across turns. A random policy almost never samples
EOS, so its turns would never end: the policy's EOS embedding is moved towards its mean final
hidden state, which makes turns end after a few tokens as a trained policy's do (the calculator
then gets final answers; a random policy writes no ``<calc>`` call, so its episodes have one
turn; guess_number's have several).

Reported (median over ``--repeats``): sampled (assistant) tokens per CPU second of the process
(robust on a shared machine; one thread by default) and all trajectory tokens (observations
included) per CPU second, turns per episode, and the fraction of decode slots
that decoded while at least one row waited on its environment (slot-steps that decoded / slot
steps that existed during those steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

ENVS = ("calculator", "guess_number")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rlbatch-bench rollout --env", description=__doc__.split("\n")[0]
    )
    p.add_argument("--env", choices=ENVS, required=True)
    p.add_argument("--rows", type=int, default=64, help="episodes per measurement")
    p.add_argument("--slots", type=int, default=16, help="rows decoded at once")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per assistant turn")
    p.add_argument("--max-turns", type=int, default=None, help="default: the env's conf")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _config(args: argparse.Namespace) -> Any:
    from rlbatch.cli.common import compose

    overrides = [f"+recipe=grpo_{args.env}", f"rollout.max_new_tokens={args.max_new_tokens}"]
    if args.max_turns is not None:
        overrides.append(f"env.max_turns={args.max_turns}")
    return compose(overrides, "rlbatch-bench")


def turn_ending_policy(cfg: Any) -> Any:
    """The recipe's tiny policy, its EOS embedding moved so that turns end (module docstring)."""
    import torch

    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model
    from rlbatch.engine.tokenizer import ByteTokenizer

    if not parallel.is_initialized():
        parallel.initialize(cfg)
    parallel.seed(cfg.trainer.seed)  # the same weights whatever ran before in this process
    (chunk,) = build_model(cfg, wrap_ddp=False)
    seen: list[Any] = []
    hook = chunk.decoder.final_layernorm.register_forward_hook(
        lambda mod, args, out: seen.append(out.detach())
    )
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.triu(torch.ones(24, 24, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        chunk.eval()
        chunk(ids, torch.arange(24)[None].expand(4, 24), mask)
        hook.remove()
        u = seen[0].reshape(-1, seen[0].shape[-1]).mean(0)
        chunk.embedding.word_embeddings.weight[ByteTokenizer.EOS] += 5.0 * u / u.norm()
    return chunk


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.env.driver import EnvDriver
    from rlbatch.env.loader import build_environment
    from rlbatch.grpo.data import load_prompts
    from rlbatch.rollout.engines.builtin import MegatronRolloutEngine, SamplingParams

    torch.set_num_threads(args.threads)
    cfg = _config(args)
    tokenizer = build_tokenizer(cfg.model)
    prompts = load_prompts(cfg.data, tokenizer, cfg.trainer.seed)[: args.rows]
    policy = turn_ending_policy(cfg)
    driver = EnvDriver(build_environment(cfg.env.path, cfg.env.kwargs), cfg, tokenizer)
    params = SamplingParams.from_config(cfg.rollout, eos_id=tokenizer.eos_id, pad_id=0)
    engine = MegatronRolloutEngine(
        policy, params, chunk_size=args.slots, driver=driver,
        max_total_tokens=cfg.env.max_total_tokens,
    )  # fmt: skip
    runs = []
    for r in range(args.repeats + 1):  # the first is a warm-up
        started = time.process_time()
        samples = engine.generate(prompts, 1, 0, seed=r)
        seconds = time.process_time() - started
        stats = engine.slot_stats
        runs.append({
            "sampled_tokens_per_s": sum(sum(s.loss_mask or []) for s in samples) / seconds,
            "tokens_per_s": sum(len(s.response_ids) for s in samples) / seconds,
            "turns_mean": statistics.mean((s.episode or {}).get("num_turns", 1) for s in samples),
            "busy_fraction_while_waiting": stats.busy_fraction_while_waiting,
            "decode_steps": stats.steps,
            "steps_with_waiting_rows": stats.waiting_steps,
        })  # fmt: skip
    driver.close()
    timed = runs[1:]
    return {key: statistics.median(run[key] for run in timed) for key in timed[0]} | {
        "env": args.env, "rows": len(prompts), "slots": args.slots,
    }  # fmt: skip


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"env {result['env']}: {result['rows']} episodes, {result['slots']} slots:"
            f" {result['sampled_tokens_per_s']:.0f} sampled tok/s,"
            f" {result['tokens_per_s']:.0f} trajectory tok/s, turns/episode"
            f" {result['turns_mean']:.2f}, slots busy while rows wait"
            f" {result['busy_fraction_while_waiting']:.2f}"
        )
    return 0
