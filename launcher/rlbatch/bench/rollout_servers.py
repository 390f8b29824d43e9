"""rlbatch-bench servers: GRPO steps with colocated vLLM against vLLM rollout servers.

    rlbatch-bench servers [--models tiny,qwen0.5b] [--layers 2] [--steps 3] [--warmup 1]
                          [--servers 1] [--transfer file[,broadcast]] [--async N] [--json]
                          [-- KEY=VALUE ...]

Each variant is one real ``rlbatch-train`` run (``+recipe=grpo_qwen``, a child process: the
launcher, its workers and, for servers, the ``--servers`` vLLM servers it starts on this
machine with rollout.servers.count), and its figures come from the run's metrics.jsonl, over
the steps after ``--warmup``:

- ``colocated``: rollout.backend=vllm (an engine inside every training rank);
- ``servers``: rollout.backend=vllm_server, rollout.servers.count=``--servers``, weights by
  file (rollout.servers.transfer=file); ``servers_broadcast``: the same with
  rollout.servers.transfer=broadcast, when ``--transfer`` names it;
- with ``--async N`` > 0, each of them again with grpo.num_steps_async=N (generation of the
  next round while the current one trains). A variant the config refuses (async on servers
  before it is supported) is reported as refused, with the reason.

Models: ``tiny`` (rlbatch's tiny Qwen2 with 2 heads of 32, the narrowest vLLM's CPU attention
runs) and ``qwen0.5b`` (Qwen2.5-0.5B's widths, vocabulary 151,936, with ``--layers`` of its 24
layers). Reported: mean step time, mean weight sync (rollout/weight_sync_s), the time each
step waited for its batch (batch_seconds: generation not hidden behind training), and the share
of generation hidden behind training, 1 - wait(async) / wait(sync) of the same backend (0 for a
synchronous run by definition). Each run includes its start (servers: ~1 minute on a 2-core
machine) in its wall time, not in these figures. Figures: docs/rollout.md "Rollout servers".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any, Optional

from rlbatch.bench.train_runs import cell, train_run

MODELS = {
    "tiny": ["model.num_attention_heads=2", "model.num_query_groups=2"],
    "qwen0.5b": ["model=qwen2_5_0_5b", "model.params_dtype=fp32"],
}
"""Overrides of each model shape (qwen0.5b: also model.num_layers=--layers)."""
BACKENDS = {
    "colocated": ["rollout.backend=vllm"],
    "servers": ["rollout.backend=vllm_server"],
}


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(prog="rlbatch-bench servers", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,qwen0.5b", help=f"comma list of {','.join(MODELS)}")
    p.add_argument("--layers", type=int, default=2, help="layers of the qwen0.5b shape")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the figures")
    p.add_argument("--servers", type=int, default=1, help="servers of the servers variant")
    p.add_argument(
        "--transfer",
        default="file",
        help="comma list of rollout.servers.transfer values for the servers variants",
    )
    p.add_argument("--async", dest="num_async", type=int, default=0,
                   help="grpo.num_steps_async of the async variants (0: none)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODELS)
    transfers = [t for t in args.transfer.split(",") if t]
    if (
        unknown
        or args.steps <= args.warmup
        or args.servers < 1
        or not transfers
        or (set(transfers) - {"file", "broadcast"})
    ):
        p.error(
            f"--models from {sorted(MODELS)}, --steps > --warmup, --servers >= 1, --transfer"
            " from file,broadcast"
        )
    return args, extra


def variants(args: argparse.Namespace) -> dict[str, list[str]]:
    """name -> rlbatch-train overrides of one model's runs (the plan, no process started)."""
    plans = {"colocated": [*BACKENDS["colocated"]]}
    for transfer in args.transfer.split(","):
        name = "servers" if transfer == "file" else f"servers_{transfer}"
        plans[name] = [
            *BACKENDS["servers"], f"rollout.servers.count={args.servers}",
            f"rollout.servers.transfer={transfer}",
        ]  # fmt: skip
    out = {}
    for name, overrides in plans.items():
        out[name] = [*overrides, "grpo.num_steps_async=0"]
        if args.num_async > 0:
            out[f"{name}_async"] = [*overrides, f"grpo.num_steps_async={args.num_async}"]
    return out


def _run(overrides: list[str], run_dir: Path) -> tuple[Optional[list[dict]], str]:
    """(metrics records, '') of one rlbatch-train run, or (None, why it did not run)."""
    quiet = ["logging.plot=false", "logging.tensorboard=false",
             "trainer.checkpoint.export_hf=false", "trainer.checkpoint.every_steps=0"]  # fmt: skip
    return train_run(["+recipe=grpo_qwen", *overrides, *quiet], run_dir)


def figures(records: list[dict[str, Any]], warmup: int) -> dict[str, Optional[float]]:
    """Means over the steps after ``warmup`` (None for a figure the run does not write)."""
    timed = [r for r in records if r.get("step", 0) > warmup]

    def mean(key: str) -> Optional[float]:
        values = [float(r[key]) for r in timed if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    return {
        "step_time_s": mean("step_time_s"),
        "weight_sync_s": mean("rollout/weight_sync_s"),
        "wait_s": mean("batch_seconds"),
    }


def hidden_share(row: dict[str, Any], sync: Optional[dict[str, Any]]) -> Optional[float]:
    """The share of the synchronous run's generation wait that the async run hides."""
    if sync is None or row.get("wait_s") is None or not sync.get("wait_s"):
        return None
    return max(0.0, 1.0 - row["wait_s"] / sync["wait_s"])


def measure(args: argparse.Namespace, extra: list[str]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    root = Path(tempfile.mkdtemp(prefix="rlbatch-bench-servers-"))
    try:
        for model in args.models.split(","):
            shape = MODELS[model] + ([f"model.num_layers={args.layers}"] if model != "tiny" else [])
            for name, overrides in variants(args).items():
                run_dir = root / f"{model}-{name}"
                run_dir.parent.mkdir(exist_ok=True)
                steps = f"trainer.max_steps={args.steps}"
                records, why = _run([*shape, *overrides, steps, *extra], run_dir)
                row: dict[str, Any] = {"model": model, "variant": name, "refused": why or None}
                row.update(figures(records, args.warmup) if records else {})
                sync = table.get(f"{model}/{name.removesuffix('_async')}")
                row["hidden_share"] = hidden_share(row, sync) if name.endswith("_async") else 0.0
                table[f"{model}/{name}"] = row
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return table


def render(table: dict[str, dict[str, Any]]) -> str:
    keys = ("step_time_s", "weight_sync_s", "wait_s", "hidden_share")
    lines = [f"{'model':<9} {'variant':<24} " + " ".join(f"{k:>14}" for k in keys)]
    for row in table.values():
        if row["refused"]:
            lines.append(f"{row['model']:<9} {row['variant']:<24} refused: {row['refused']}")
            continue
        cells = " ".join(f"{cell(row.get(k)):>14}" for k in keys)
        lines.append(f"{row['model']:<9} {row['variant']:<24} {cells}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args, extra = _parse(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    table = measure(args, extra)
    print(json.dumps(table, indent=1) if args.json else render(table))
    return 0
