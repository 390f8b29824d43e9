"""rlbatch-bench batching: planner quality and speed on synthetic long-tailed workloads.

    rlbatch-bench batching [--sizes 512,8192,65536] [--dp 8,64] [--workloads grpo_math,...]
                           [--modes naive,fixed,dynamic,packed,pool] [--max-tokens 16384]
                           [--round 8] [--json]

For each workload x N x dp x mode it plans one pass (one thread) and prints k (micro-batches per
rank), the lower bound LB, k/LB, micro-batches over the budget, padding efficiency, token and
cost imbalance, lockstep efficiency and planner seconds. ``naive`` is the baseline most systems
ship: contiguous DP shards in data order, micro_batch_size samples per micro-batch padded to the
longest, no budget. The cost model is Qwen2.5-7B's (a*L + b*L^2 from its dimensions).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rlbatch.batching import (
    GROUP_SIZE,
    CostModel,
    MicroBatch,
    compute_stats,
    cost_model_for,
    lower_bound,
    make_workload,
    plan_pass,
)
from rlbatch.config.schema import (
    BatchingMode,
    BatchingPassConfig,
    ModelConfig,
    OversizePolicy,
    Workload,
)

QWEN2_5_7B = ModelConfig(
    name="qwen2_5_7b",
    num_layers=28,
    hidden_size=3584,
    ffn_hidden_size=18944,
    num_attention_heads=28,
    num_query_groups=4,
    vocab_size=152064,
)
MODES = ["naive", "fixed", "dynamic", "packed", "pool"]
TARGETS = {
    "k_over_lb": 1.02,
    "cost_imbalance": 1.005,
    "lockstep_efficiency": 0.98,
    "padding_dynamic": 0.97,
    "padding_packed": 0.995,
    "seconds_8192": 0.020,
    "seconds_65536": 0.3,
}


def naive_plan(
    lengths: Sequence[int], cfg: BatchingPassConfig, dp: int, cost: CostModel
) -> tuple[int, Any]:
    """The baseline: contiguous shards, fixed-size micro-batches in data order, no budget."""
    started = time.perf_counter()
    r, size = cfg.sequence_length_round, cfg.micro_batch_size
    n = len(lengths)
    ranks: list[list[MicroBatch]] = []
    for rank in range(dp):
        shard = list(range(rank * n // dp, (rank + 1) * n // dp))
        mbs = []
        for i in range(0, len(shard), size):
            chunk = shard[i : i + size]
            lens = tuple(lengths[s] for s in chunk)
            padded = -(-max(lens) // r) * r
            mbs.append(MicroBatch(tuple(chunk), lens, padded, padded * len(chunk), sum(lens)))
        ranks.append(mbs)
    count = max(len(m) for m in ranks)
    for m in ranks:  # ragged shards: a rank short of micro-batches runs an empty one
        m.extend(MicroBatch((), (), r, r, 0, filler=True) for _ in range(count - len(m)))
    rounded = [-(-x // r) * r for x in lengths]
    stats = compute_stats(
        ranks,
        max_tokens=cfg.max_tokens,
        sequence_length_round=r,
        cost=cost,
        lower_bound=lower_bound(rounded, dp, cfg.max_tokens),
        planner_seconds=0.0,
        oversize=0,
        truncated_tokens=0,
    )
    stats = replace(stats, planner_seconds=time.perf_counter() - started)
    return count, (stats, ranks)


def measure(
    lengths: Sequence[int], mode: str, dp: int, args: argparse.Namespace, group: int
) -> dict[str, Any]:
    cfg = BatchingPassConfig(
        mode=BatchingMode.fixed if mode == "naive" else BatchingMode(mode),
        max_tokens=args.max_tokens,
        sequence_length_round=args.round,
        micro_batch_size=args.micro_batch_size,
        oversize=OversizePolicy.isolate,
        pool_size=args.pool_size,
    )
    cost = cost_model_for(QWEN2_5_7B, cfg)
    best = best_cpu = float("inf")
    for _ in range(args.repeats):  # best of several: the machine may be shared
        cpu = time.thread_time()
        if mode == "naive":
            k, (stats, ranks) = naive_plan(lengths, cfg, dp, cost)
        else:
            plan = plan_pass(lengths, cfg, dp=dp, cost=cost, group_size=group)
            k, stats = plan.num_micro_batches, plan.stats
            ranks = [rp.micro_batches for rp in plan.ranks]
        best_cpu = min(best_cpu, time.thread_time() - cpu)
        best = min(best, stats.planner_seconds)
    over = sum(
        1 for mbs in ranks for mb in mbs if mb.computed_tokens > args.max_tokens and not mb.oversize
    )
    lb = stats.lower_bound
    return {
        "mode": mode,
        "k": k,
        "lower_bound": lb,
        "k_over_lb": k / lb if lb else 1.0,
        "over_budget": over,
        "padding_efficiency": stats.padding_efficiency,
        "token_imbalance": stats.token_imbalance,
        "cost_imbalance": stats.cost_imbalance,
        "lockstep_efficiency": stats.lockstep_efficiency,
        "fillers": stats.fillers,
        "planner_seconds": best,
        "planner_cpu_seconds": best_cpu,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for workload in args.workloads:
        for n in args.sizes:
            lengths = make_workload(workload, n, seed=args.seed)
            for dp in args.dp:
                for mode in args.modes:
                    row = measure(lengths, mode, dp, args, GROUP_SIZE[Workload(workload)])
                    rows.append({"workload": workload, "num_samples": n, "dp": dp, **row})
    return rows


def _seconds(row: dict[str, Any]) -> float:
    """Planner time judged against the targets: thread CPU time (wall time on a shared machine
    also counts other processes' turns)."""
    return float(row["planner_cpu_seconds"])


def check_targets(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, each 'met' or the rows that miss it (dynamic/packed modes)."""
    misses: list[str] = []
    for row in rows:
        name = f"{row['workload']} N={row['num_samples']} dp={row['dp']} {row['mode']}"
        if row["mode"] == "naive":
            continue
        if row["over_budget"]:
            misses.append(f"{name}: {row['over_budget']} over budget")
        if row["mode"] not in ("dynamic", "packed"):
            continue
        big = row["num_samples"] >= 8192
        checks = [
            (big and row["mode"] == "packed" and row["k_over_lb"] > TARGETS["k_over_lb"], "k/LB"),
            (big and row["cost_imbalance"] > TARGETS["cost_imbalance"], "cost imbalance"),
            (big and row["lockstep_efficiency"] < TARGETS["lockstep_efficiency"], "lockstep"),
            (
                row["padding_efficiency"]
                < TARGETS["padding_packed" if row["mode"] == "packed" else "padding_dynamic"],
                "padding",
            ),
            (
                row["num_samples"] == 8192 and _seconds(row) > TARGETS["seconds_8192"],
                "time",
            ),
            (
                row["num_samples"] == 65536 and _seconds(row) > TARGETS["seconds_65536"],
                "time",
            ),
        ]
        misses.extend(f"{name}: {what}" for bad, what in checks if bad)
    return misses


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"rlbatch-bench batching: max_tokens={args.max_tokens}, round={args.round}, "
        f"cost=Qwen2.5-7B, micro_batch_size={args.micro_batch_size} (naive/fixed), "
        f"pool_size={args.pool_size}"
    )
    cols = ["workload", "N", "dp", "mode", "k", "LB", "k/LB", "over", "pad eff", "tok imb",
            "cost imb", "lockstep", "fillers", "wall ms", "cpu ms"]  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("workload", "mode") else "right")
    for r in rows:
        table.add_row(
            r["workload"], str(r["num_samples"]), str(r["dp"]), r["mode"], str(r["k"]),
            str(r["lower_bound"]), f"{r['k_over_lb']:.3f}", str(r["over_budget"]),
            f"{r['padding_efficiency']:.4f}", f"{r['token_imbalance']:.4f}",
            f"{r['cost_imbalance']:.4f}", f"{r['lockstep_efficiency']:.4f}", str(r["fillers"]),
            f"{1000 * r['planner_seconds']:.1f}", f"{1000 * r['planner_cpu_seconds']:.1f}",
        )  # fmt: skip
    console = Console(highlight=False, width=max(Console().width, 150))
    console.print(table)
    misses = check_targets(rows)
    console.print(f"targets (N >= 8192 for k/LB, balance, lockstep): {len(misses)} misses")
    for miss in misses:
        console.print(f"  miss: {miss}")


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (docs/benchmarks.md)."""
    head = (
        "| workload | N | dp | mode | k | LB | k/LB | over | pad eff | tok imb | cost imb "
        "| lockstep | fillers | wall ms | cpu ms |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['num_samples']} | {r['dp']} | {r['mode']} | {r['k']} | "
            f"{r['lower_bound']} | {r['k_over_lb']:.3f} | {r['over_budget']} | "
            f"{r['padding_efficiency']:.4f} | {r['token_imbalance']:.4f} | "
            f"{r['cost_imbalance']:.4f} | {r['lockstep_efficiency']:.4f} | {r['fillers']} | "
            f"{1000 * r['planner_seconds']:.1f} | {1000 * r['planner_cpu_seconds']:.1f} |"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlbatch-bench batching", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=_ints, default=[512, 8192, 65536], help="samples per pass")
    p.add_argument("--dp", type=_ints, default=[8, 64], help="data-parallel sizes")
    p.add_argument(
        "--workloads",
        type=lambda s: [Workload(x).value for x in s.split(",")],
        default=[w.value for w in Workload],
    )
    p.add_argument(
        "--modes",
        type=lambda s: [m for m in s.split(",") if m in MODES or p.error(f"unknown mode {m}")],
        default=MODES,
    )
    p.add_argument("--max-tokens", type=int, default=16384, help="micro-batch token budget B")
    p.add_argument("--round", type=int, default=8, help="sequence_length_round r")
    p.add_argument("--micro-batch-size", type=int, default=8, help="naive / fixed mode rows")
    p.add_argument("--pool-size", type=int, default=64, help="pool mode: samples per rank pool")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; the fastest counts")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table instead")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    if args.json:
        print(json.dumps({"rows": rows, "misses": check_targets(rows), "targets": TARGETS}))
    elif args.markdown:
        print(markdown(rows))
        print("\nTarget misses: " + ("; ".join(check_targets(rows)) or "none"))
    else:
        print_table(rows, args)
    return 0
