"""rlbatch-bench moe: an MoE policy's GRPO step against the dense model of equal active
parameters, at expert parallelism 1 and 2; and the planner's data-parallel balance with the MoE
cost model against token counts.

    rlbatch-bench moe [--steps 6] [--warmup 2] [--repeats 1] [--variants dense,moe_ep1,moe_ep2]
                      [--planner-only] [--model qwen3_30b_a3b] [--samples 4096] [--dp 16]
                      [--json] [-- KEY=VALUE ...]

**Step.** Each variant is one real ``rlbatch-train`` run (``+recipe=grpo_qwen``, two worker
processes, ``parallel.dp=2``, generation inline), its figures taken over the steps after
``--warmup`` (medians) from its metrics.jsonl:

- ``dense``: ``model=tiny_moe``'s attention, widths and vocabulary with one dense SwiGLU MLP of
  width k x moe_ffn_hidden_size (top-2 x 64 = 128): the same active parameters a token uses;
- ``moe_ep1``: ``model=tiny_moe`` (4 experts, top-2), every expert on both ranks;
- ``moe_ep2``: the same at ``parallel.ep=2``: each rank holds 2 experts, tokens go to the
  other rank's experts by all-to-all.

Reported: total and active parameters (active = the multiply-adds a token's forward takes
through the linear layers, attention and logits included, from rlbatch's cost model), the step
time, the train pass's seconds and tokens/s (forward + backward + optimizer; the rollout of a
single-turn MoE policy decodes in lockstep through megatron's forward, a dense one on the lean
continuous batch, so the step times also differ by that), the time the step waited for its
batch (the rollout), and the MoE layers' load imbalance.

**Planner.** Pure (no process): ``--samples`` sequences of a long-tailed length mix (long_cot)
planned over ``--dp`` data-parallel ranks three ways, by rlbatch's MoE cost model (a token's
active parameters: attention + router + k experts), by a cost model that counts every expert
(as a planner that prices a model by its total parameters would), and by computed tokens
alone; each plan's rank imbalance is then measured in the true (active) cost. Figures:
docs/benchmarks.md "MoE".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from rlbatch.bench.train_runs import train_run

VARIANTS: dict[str, list[str]] = {
    "dense": [
        "model=tiny_moe", "model.num_moe_experts=null", "model.moe_ffn_hidden_size=null",
        "model.architecture=qwen3", "model.ffn_hidden_size=128",
    ],
    "moe_ep1": ["model=tiny_moe"],
    "moe_ep2": ["model=tiny_moe", "parallel.ep=2"],
}  # fmt: skip
"""rlbatch-train overrides of each step variant (on top of COMMON)."""
COMMON = [
    "+recipe=grpo_qwen", "parallel.dp=2", "grpo.num_steps_async=0", "logging.plot=false",
    "logging.tensorboard=false", "trainer.checkpoint.export_hf=false",
    "trainer.checkpoint.every_steps=0",
]  # fmt: skip
PLANNERS = ("active", "total", "tokens")


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(prog="rlbatch-bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    p.add_argument("--repeats", type=int, default=1, help="runs of each variant, interleaved")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma list of {','.join(VARIANTS)}"
    )
    p.add_argument("--planner-only", action="store_true", help="the planner figures only")
    p.add_argument("--model", default="qwen3_30b_a3b", help="conf/model preset the planner prices")
    p.add_argument("--samples", type=int, default=4096, help="planner: sequences of the step")
    p.add_argument("--dp", type=int, default=16, help="planner: data-parallel ranks")
    p.add_argument("--max-tokens", type=int, default=32768, help="planner: micro-batch budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if (
        set(args.variants) - set(VARIANTS)
        or args.steps <= args.warmup
        or args.dp < 1
        or args.repeats < 1
    ):
        p.error(f"--variants from {sorted(VARIANTS)}, --steps > --warmup, --dp and --repeats >= 1")
    return args, extra


# ------------------------------------------------------------------------------ planner
def preset(name: str) -> Any:
    """The ModelConfig of a conf/model preset (its YAML over the schema's defaults)."""
    import yaml

    from rlbatch.config.schema import ModelConfig
    from rlbatch.config.store import conf_dir

    fields = yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text())
    return replace(ModelConfig(), **fields)


def planner_figures(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per cost model the planner balanced with: the plan's rank imbalance in the true
    (active-parameter) cost and in computed tokens, and its lockstep efficiency."""
    from rlbatch.batching import make_workload, plan_pass
    from rlbatch.batching.cost import TOKEN_COUNT, CostModel, cost_model_for
    from rlbatch.batching.stats import compute_stats
    from rlbatch.config.schema import BatchingMode, BatchingPassConfig, Workload

    model = preset(args.model)
    cfg = BatchingPassConfig(mode=BatchingMode.dynamic, max_tokens=args.max_tokens)
    active = cost_model_for(model, cfg)
    experts = model.num_moe_experts or model.moe_router_topk
    every = cost_model_for(replace(model, moe_router_topk=experts), cfg)
    priced: dict[str, CostModel] = {"active": active, "total": every, "tokens": TOKEN_COUNT}
    lengths = make_workload(Workload.long_cot, args.samples, args.seed)
    out: dict[str, dict[str, float]] = {}
    for name, cost in priced.items():
        plan = plan_pass(lengths, cfg, dp=args.dp, cost=cost, group_size=8)
        ranks = [r.micro_batches for r in plan.ranks]
        true = compute_stats(
            ranks, max_tokens=cfg.max_tokens, sequence_length_round=cfg.sequence_length_round,
            cost=active, lower_bound=plan.stats.lower_bound, planner_seconds=0.0, oversize=0,
            truncated_tokens=0,
        )  # fmt: skip
        out[name] = {
            "cost_b_over_a": cost.b / cost.a if cost.a else float("inf"),
            "cost_imbalance": true.cost_imbalance,
            "token_imbalance": true.token_imbalance,
            "lockstep_efficiency": true.lockstep_efficiency,
            "micro_batches": plan.num_micro_batches,
        }
    return out


# ------------------------------------------------------------------------------ step
def _run(overrides: list[str], run_dir: Path) -> tuple[Optional[list[dict]], str]:
    """(metrics records, '') of one rlbatch-train run, or (None, why it did not run)."""
    return train_run([*COMMON, *overrides], run_dir)


def active_parameters(run_dir: Path) -> float:
    """Multiply-adds of one token's forward through the run's linear layers (QKV, output, the
    MLP or router + k experts, the logits): its active parameters (rlbatch's cost model)."""
    from rlbatch.batching.cost import linear_flops_per_token
    from rlbatch.config.load import load_run_config

    return linear_flops_per_token(load_run_config(run_dir / "resolved.yaml").model) / 2.0


def step_figures(runs: list[list[dict[str, Any]]], warmup: int) -> dict[str, Optional[float]]:
    """Medians over the steps after ``warmup`` of every run of a variant (a step slowed by
    another process on a shared machine moves a median less than a mean; None for a figure
    the runs do not write)."""
    timed = [r for records in runs for r in records if r.get("step", 0) > warmup]

    def median(key: str) -> Optional[float]:
        values = [float(r[key]) for r in timed if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "parameters": float(runs[0][0]["trainable_params"]),
        "step_time_s": median("step_time_s"),
        "train_s": median("train_seconds"),
        "train_tokens_per_s": median("train_tokens_per_s"),
        "wait_s": median("batch_seconds"),
        "load_imbalance": median("moe/load_imbalance"),
    }


def measure_steps(args: argparse.Namespace, extra: list[str]) -> dict[str, dict[str, Any]]:
    """Each variant ``--repeats`` times, the rounds interleaved (dense, ep1, ep2, dense, ...):
    on a shared machine a burst of other work then falls on every variant alike. A variant's
    figures are taken over the timed steps of all its runs."""
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in args.variants}
    table: dict[str, dict[str, Any]] = {}
    root = Path(tempfile.mkdtemp(prefix="rlbatch-bench-moe-"))
    try:
        for repeat in range(args.repeats):
            for name in args.variants:
                if table.get(name, {}).get("refused"):
                    continue
                run_dir = root / f"{name}-{repeat}"
                steps = f"trainer.max_steps={args.steps}"
                records, why = _run([*VARIANTS[name], steps, *extra], run_dir)
                row: dict[str, Any] = {"variant": name, "refused": why or None}
                if records:
                    runs[name].append(records)
                    row.update(step_figures(runs[name], args.warmup))
                    row["active_parameters"] = active_parameters(run_dir)
                    row["runs"] = len(runs[name])
                table[name] = row
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return table


# ------------------------------------------------------------------------------ output
def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:,.0f}" if isinstance(value, float) and value >= 1000 else f"{value:.3f}"


def render(steps: dict[str, dict[str, Any]], planner: dict[str, dict[str, float]]) -> str:
    lines: list[str] = []
    if steps:
        keys = ("parameters", "active_parameters", "step_time_s", "train_s",
                "train_tokens_per_s", "wait_s", "load_imbalance")  # fmt: skip
        lines.append(f"{'variant':<9} " + " ".join(f"{k:>18}" for k in keys))
        for row in steps.values():
            if row["refused"]:
                lines.append(f"{row['variant']:<9} refused: {row['refused']}")
                continue
            lines.append(
                f"{row['variant']:<9} " + " ".join(f"{_cell(row.get(k)):>18}" for k in keys)
            )
        lines.append("")
    plan_keys = ("cost_b_over_a", "cost_imbalance", "token_imbalance", "lockstep_efficiency",
                 "micro_batches")  # fmt: skip
    lines.append(f"{'planned by':<10} " + " ".join(f"{k:>19}" for k in plan_keys))
    for name, row in planner.items():
        cells = " ".join(
            f"{row[k]:>19.3g}" if k == "cost_b_over_a" else f"{_cell(row[k]):>19}"
            for k in plan_keys
        )
        lines.append(f"{name:<10} {cells}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args, extra = _parse(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    planner = planner_figures(args)
    steps = {} if args.planner_only else measure_steps(args, extra)
    if args.json:
        print(json.dumps({"steps": steps, "planner": planner}, indent=1))
    else:
        print(render(steps, planner))
    return 0
