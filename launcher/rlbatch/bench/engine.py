"""rlbatch-bench engine: forward+backward tokens/s of the Megatron engine per batching mode.

    rlbatch-bench engine [--models tiny,small] [--num-samples 256] [--max-tokens 2048]
                         [--micro-batch-size 8] [--repeats 3] [--json] [--quick]

One process (world of 1), CPU or GPU. A long-tailed length sample (the grpo_math workload
scaled to the model's 512-token context) is cut into micro-batches four ways and each pass is
timed through rlbatch.engine.schedule.run_pass (forward + backward, next-token loss):

- naive:   micro_batch_size samples in data order, padded to the longest (the usual baseline);
- fixed:   the planner's fixed mode (micro_batch_size rows, sorted by length);
- dynamic: the planner's padded micro-batches under the token budget (max_tokens);
- packed:  the planner's packed micro-batches (one row, THD: per-sequence attention, with
           Transformer Engine on GPU and rlbatch.engine.attention on CPU).

tokens/s counts real tokens only; the ratio column is tokens/s over naive's. Models: ``tiny``
(the CPU default, ~110k parameters) and ``small`` (4 layers, hidden 256: ~3M parameters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": dict(
        name="small",
        num_layers=4,
        hidden_size=256,
        ffn_hidden_size=704,
        num_attention_heads=8,
        num_query_groups=4,
    ),
}
MODES = ["naive", "fixed", "dynamic", "packed"]
ROUND = 8


def sample_lengths(num_samples: int, max_len: int, seed: int) -> list[int]:
    """grpo_math's long-tailed lengths scaled to ``max_len``."""
    from rlbatch.batching import MAX_LENGTH, make_workload
    from rlbatch.config.schema import Workload

    raw = make_workload(Workload.grpo_math, num_samples, seed)
    scale = max_len / MAX_LENGTH[Workload.grpo_math]
    return [min(max(2, round(x * scale)), max_len) for x in raw]


def naive_plan(lengths: Sequence[int], rows: int) -> Any:
    """micro_batch_size samples in data order, padded to the longest (no budget)."""
    from rlbatch.batching import MicroBatch, PassPlan, PlanStats, RankPlan

    mbs = []
    for start in range(0, len(lengths), rows):
        idx = tuple(range(start, min(start + rows, len(lengths))))
        lens = tuple(lengths[i] for i in idx)
        width = -(-max(lens) // ROUND) * ROUND
        mbs.append(MicroBatch(idx, lens, width, width * len(idx), sum(lens)))
    real = sum(lengths)
    computed = sum(mb.computed_tokens for mb in mbs)
    stats = PlanStats(
        0, real / computed, 1.0, 1.0, 1.0, max(m.computed_tokens for m in mbs), 0.0, 0, 0
    )
    return PassPlan("naive", 1, len(mbs), 1, (RankPlan(0, tuple(mbs)),), stats)


def make_plan(mode: str, lengths: Sequence[int], args: argparse.Namespace, max_len: int) -> Any:
    from rlbatch.batching import plan_pass
    from rlbatch.config.schema import BatchingMode, BatchingPassConfig

    if mode == "naive":
        return naive_plan(lengths, args.micro_batch_size)
    budget = args.max_tokens if mode != "fixed" else args.micro_batch_size * max_len
    cfg = BatchingPassConfig(
        mode=BatchingMode(mode),
        max_tokens=budget,
        micro_batch_size=args.micro_batch_size,
        sequence_length_round=ROUND,
    )
    return plan_pass(lengths, cfg, dp=1)


def time_pass(model: Any, plan: Any, seqs: list[list[int]], repeats: int) -> float:
    """Median seconds of one forward+backward pass over the plan."""
    from rlbatch.engine import schedule

    def batch_fn(mb: Any) -> Any:
        return schedule.make_inputs([seqs[i] for i in mb.samples], mb, round_to=ROUND)

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        schedule.run_pass(model, plan.ranks[0], plan, batch_fn, schedule.next_token_loss)
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from rlbatch.config.schema import RunConfig
    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model, num_parameters

    cfg = RunConfig()
    cfg.model = replace(cfg.model, **MODELS[name])
    parallel.seed(args.seed)
    model = build_model(cfg)
    max_len = cfg.model.max_position_embeddings
    lengths = sample_lengths(args.num_samples, max_len, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    seqs = [torch.randint(0, cfg.model.vocab_size, (n,), generator=g).tolist() for n in lengths]
    warm = naive_plan(lengths[: args.micro_batch_size], args.micro_batch_size)
    time_pass(model, warm, seqs, 1)
    rows = []
    for mode in args.modes:
        plan = make_plan(mode, lengths, args, max_len)
        seconds = time_pass(model, plan, seqs, args.repeats)
        computed = sum(mb.computed_tokens for mb in plan.ranks[0].micro_batches)
        rows.append(
            {
                "model": name,
                "parameters": num_parameters(model),
                "mode": mode,
                "micro_batches": plan.num_micro_batches,
                "real_tokens": sum(lengths),
                "computed_tokens": computed,
                "padding_efficiency": sum(lengths) / computed,
                "seconds": seconds,
                "tokens_per_s": sum(lengths) / seconds,
            }
        )
    base = next((r["tokens_per_s"] for r in rows if r["mode"] == "naive"), rows[0]["tokens_per_s"])
    for r in rows:
        r["ratio"] = r["tokens_per_s"] / base
    return rows


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"engine forward+backward, {args.num_samples} samples (grpo_math scaled to 512), "
        f"max_tokens={args.max_tokens}, micro_batch_size={args.micro_batch_size}, {device}"
    )
    for col in ("model", "params", "mode", "MBs", "pad eff", "s/pass", "tokens/s", "x naive"):
        table.add_column(col, justify="left" if col in ("model", "mode") else "right")
    for r in rows:
        table.add_row(
            r["model"],
            f"{r['parameters'] / 1e6:.2f}M",
            r["mode"],
            str(r["micro_batches"]),
            f"{r['padding_efficiency']:.3f}",
            f"{r['seconds']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['ratio']:.2f}",
        )
    Console().print(table)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlbatch-bench engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,small", help="comma list of: " + ",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES), help="comma list of: " + ",".join(MODES))
    p.add_argument("--num-samples", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=2048, help="budget of dynamic/packed")
    p.add_argument("--micro-batch-size", type=int, default=8, help="rows of naive/fixed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON document only")
    p.add_argument("--quick", action="store_true", help="tiny model, 32 samples, 1 repeat")
    args = p.parse_args(list(argv))
    if args.quick:
        args.models, args.num_samples, args.repeats = "tiny", 32, 1
    args.models = [m for m in args.models.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.models if m not in MODELS] + [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown model/mode: {', '.join(bad)}")
    return args


def main(argv: Sequence[str] = ()) -> int:
    args = parse(argv)
    import torch

    from rlbatch.config.schema import RunConfig
    from rlbatch.engine import parallel

    if not parallel.is_initialized():
        parallel.initialize(RunConfig())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    device += f", {torch.get_num_threads()} threads"
    rows = [r for name in args.models for r in bench_model(name, args)]
    if args.json:
        print(json.dumps({"device": device, "args": vars(args), "rows": rows}, indent=2))
    else:
        print_table(rows, args, device)
    return 0
