"""rlbatch-plan's body: load lengths, plan the chosen pass, print a rich summary or one JSON.

``run_plan_command(cfg) -> exit code`` (0 ok, 2 bad input). Imports no torch. The JSON document
is ``PassPlan.to_json()``. The lengths are planned as ONE pass, exactly as training plans the
pass of its first optimizer step over the same lengths: the same planner, cost model, layout,
``grpo.num_generations`` sibling groups and seed (``trainer.seed``, step 1; pool mode's stream
shuffle depends on both). A test compares the two (docs/batching.md, "rlbatch-plan").
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlbatch.batching import (
    GROUP_SIZE,
    CostModel,
    PassPlan,
    attention_flops_per_token_pair,
    cost_model_for,
    linear_flops_per_token,
    make_workload,
    micro_batch_cost,
    plan_pass,
)
from rlbatch.config.schema import BatchingPassConfig, PassKind, RunConfig, Workload

EXIT_OK = 0
EXIT_BAD_INPUT = 2


class PlanInputError(ValueError):
    """Bad rlbatch-plan input: printed as one line, exit code 2."""


def load_lengths(cfg: RunConfig) -> tuple[list[int], int]:
    """(lengths, sibling group size) from plan.lengths (a JSON list of ints) or plan.synthetic."""
    plan = cfg.plan
    if plan.lengths is not None and plan.synthetic is not None:
        raise PlanInputError("set only one of plan.lengths=FILE and plan.synthetic=WORKLOAD")
    if plan.synthetic is not None:
        workload = Workload(plan.synthetic)
        return make_workload(workload, plan.num_samples, plan.seed), GROUP_SIZE[workload]
    if plan.lengths is None:
        raise PlanInputError(
            "no input: set plan.lengths=FILE (a JSON list of ints) or "
            "plan.synthetic=grpo_math|long_cot|bimodal|agentic|uniform"
        )
    path = Path(plan.lengths)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanInputError(f"plan.lengths={plan.lengths}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise PlanInputError(f"plan.lengths={plan.lengths}: cannot read ({err})") from None
    except json.JSONDecodeError as err:
        raise PlanInputError(f"plan.lengths={plan.lengths}: not JSON ({err})") from None
    if not isinstance(data, list):
        raise PlanInputError(f"plan.lengths={plan.lengths}: expected a JSON list of ints")
    for i, x in enumerate(data):
        if type(x) is not int or x < 1:
            raise PlanInputError(
                f"plan.lengths={plan.lengths}: item {i} is {x!r}, expected an int >= 1"
            )
    return data, max(cfg.grpo.num_generations, 1)


def _pass_config(cfg: RunConfig) -> tuple[str, BatchingPassConfig]:
    kind = PassKind(cfg.plan.pass_)
    return kind.value, (cfg.batching.train if kind == PassKind.train else cfg.batching.infer)


def build_document(cfg: RunConfig) -> tuple[dict[str, Any], list[PassPlan], CostModel]:
    """Plan as configured. Returns the JSON document, the plan (a one-item list) and the cost
    model."""
    lengths, group = load_lengths(cfg)
    name, pcfg = _pass_config(cfg)
    par = cfg.parallel
    cost = cost_model_for(cfg.model, pcfg)
    plan = plan_pass(
        lengths, pcfg, dp=par.dp, pp=par.pp, vpp=par.vpp,
        microbatch_group_size=par.microbatch_group_size_per_vp_stage, group_size=group,
        cost=cost, seed=cfg.trainer.seed, step=1, pass_name=name,
    )  # fmt: skip
    doc = plan.to_json()
    doc["cost_model"] = {
        "a": cost.a,
        "b": cost.b,
        "linear_flops_per_token": linear_flops_per_token(cfg.model),
        "attention_flops_per_token_pair": attention_flops_per_token_pair(cfg.model),
    }
    return doc, [plan], cost


def print_summary(
    doc: dict[str, Any], plans: Sequence[PassPlan], cost: CostModel, cfg: RunConfig
) -> None:
    """Rich tables: per rank (micro-batches, samples, tokens, cost, padding), then the stats."""
    from rich.console import Console
    from rich.table import Table

    name, pcfg = _pass_config(cfg)
    r = pcfg.sequence_length_round
    dp = doc["dp"]
    rows = []
    for rank in range(dp):
        mbs = [mb for p in plans for mb in p.ranks[rank].micro_batches]
        real = sum(mb.real_tokens for mb in mbs)
        computed = sum(mb.computed_tokens for mb in mbs)
        rank_cost = sum(micro_batch_cost(mb, cost, r) for mb in mbs)
        rows.append((rank, mbs, real, computed, rank_cost))
    mean_cost = sum(x[4] for x in rows) / max(dp, 1) or 1.0
    console = Console(highlight=False)
    title = (
        f"rlbatch-plan: {name} pass, mode={doc['mode']}, max_tokens={pcfg.max_tokens}, "
        f"dp={dp}, {doc['num_micro_batches']} micro-batches per rank"
    )
    table = Table(title=title)
    for col in ("rank", "micro-batches", "fillers", "samples", "real tokens", "computed tokens",
                "padding eff", "cost / mean"):  # fmt: skip
        table.add_column(col, justify="right")
    for rank, mbs, real, computed, rank_cost in rows:
        table.add_row(
            str(rank),
            str(len(mbs)),
            str(sum(mb.filler for mb in mbs)),
            str(sum(len(mb.samples) for mb in mbs)),
            f"{real:,}",
            f"{computed:,}",
            f"{real / computed:.4f}" if computed else "-",
            f"{rank_cost / mean_cost:.4f}",
        )
    console.print(table)
    stats = Table(title="plan statistics", show_header=False)
    stats.add_column("figure")
    stats.add_column("value", justify="right")
    s = doc["stats"]
    k = doc["num_micro_batches"]
    lb = s["lower_bound"]
    stats.add_row("micro-batches per rank (k)", str(k))
    stats.add_row("lower bound (LB)", str(lb))
    stats.add_row("k / LB", f"{k / lb:.4f}" if lb else "-")
    stats.add_row("microbatch_group_size (N)", str(doc["microbatch_group_size"]))
    for key in ("padding_efficiency", "token_imbalance", "cost_imbalance", "lockstep_efficiency"):
        stats.add_row(key.replace("_", " "), f"{s[key]:.4f}")
    stats.add_row(
        "max computed tokens", f"{s['max_computed_tokens']:,} (budget {pcfg.max_tokens:,})"
    )
    stats.add_row("oversize samples", str(s["oversize"]))
    stats.add_row("truncated tokens", str(s.get("truncated_tokens", 0)))
    stats.add_row("filler micro-batches", str(s["fillers"]))
    stats.add_row("planner seconds", f"{s['planner_seconds']:.4f}")
    model = doc["cost_model"]
    active = " (MoE: router + top-k experts active)" if cfg.model.num_moe_experts else ""
    stats.add_row(
        "cost model a*L + b*L^2",
        f"a={cost.a:.4g}, b={cost.b:.4g}; {model['linear_flops_per_token']:.4g} linear FLOPs "
        f"per token{active}",
    )
    console.print(stats)


def run_plan_command(cfg: RunConfig) -> int:
    """rlbatch-plan: 0 on success, 2 on bad input (one clear line on stderr)."""
    try:
        doc, plans, cost = build_document(cfg)
    except ValueError as err:  # PlanInputError and the planner's own input errors
        print(f"rlbatch-plan: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if cfg.plan.json:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        print_summary(doc, plans, cost, cfg)
    return EXIT_OK
