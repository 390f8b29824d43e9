"""rlbatch-bench rollout --backend: the rollout backends side by side on the same workload.

    rlbatch-bench rollout --backend vllm,megatron [--models tiny,qwen0.5b] [--layers 2]
                          [--prompts 16] [--generations 4] [--prompt-len 32]
                          [--max-new-tokens 64] [--repeats 3] [--threads 1] [--json]

Each backend is built by the trainer's own factory (``build_rollout_engine``, the backend
``rollout.backend`` names) on one megatron-core policy built from the config alone (random
weights, seeded), and generates the same rows: ``--prompts`` random prompts of
``--prompt-len`` tokens, ``--generations`` samples each, at temperature 1 (top-p / top-k off)
for up to ``--max-new-tokens`` tokens. Models:

- ``tiny``: rlbatch's default tiny Qwen2 (hidden 64, vocabulary 264) with 2 heads of 32 (the
  narrowest head vLLM's CPU attention supports);
- ``qwen0.5b``: Qwen2.5-0.5B's widths (vocabulary 151,936, hidden 896, MLP 4864, 14 heads / 2
  KV heads, tied embeddings) with ``--layers`` of its 24 layers.

Reported per backend: generated tokens per CPU-second of this process (all its threads, the
in-process vLLM engine's included: on a shared machine it does not count time spent waiting
for a core) and, on CUDA, per GPU-second (wall seconds of the generate call, synchronised);
the start-up (from building the engine to its first sample, one row: vLLM's import, engine
start, first weight push and sampler compilation) and one weight sync (median: the policy's
weights streamed into the engine; 0 for megatron, which decodes on the policy's own weights),
each in CPU seconds and in wall seconds. The repeats run interleaved (megatron, vllm, megatron, ...), medians
reported. Each model runs in its own child process: vLLM keeps process-wide state, so a
process hosts one engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(num_attention_heads=2, num_query_groups=2),
    "qwen0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        ffn_hidden_size=4864,
        num_attention_heads=14,
        num_query_groups=2,
    ),
}
BACKENDS = ("megatron", "vllm")
EOS_ID = 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rlbatch-bench rollout --backend", description=__doc__.split("\n")[0]
    )
    p.add_argument("--backend", required=True, help=f"comma list of {','.join(BACKENDS)}")
    p.add_argument("--models", default="tiny,qwen0.5b", help=f"comma list of {','.join(SHAPES)}")
    p.add_argument("--layers", type=int, default=2, help="layers of the qwen0.5b shape")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # one model, in a child
    args = p.parse_args(argv)
    unknown = [b for b in args.backend.split(",") if b not in BACKENDS]
    unknown += [m for m in args.models.split(",") if m not in SHAPES]
    if unknown:
        p.error(f"unknown backend or model {', '.join(unknown)}")
    return args


def bench_config(model: str, args: argparse.Namespace) -> Any:
    """The RunConfig of one model's cell (rollout settings of the workload)."""
    from rlbatch.config.schema import RunConfig

    cfg = RunConfig()
    for key, value in SHAPES[model].items():
        setattr(cfg.model, key, value)
    if model != "tiny":
        cfg.model.name, cfg.model.num_layers = model, args.layers
    cfg.data.max_prompt_len = args.prompt_len
    cfg.rollout.max_new_tokens = args.max_new_tokens
    cfg.rollout.temperature = 1.0
    cfg.rollout.vllm.max_num_seqs = max(args.prompts * args.generations, 1)
    return cfg


def build_engine(cfg: Any, model: list[Any], backend: str) -> Any:
    """The engine the trainer would build for ``rollout.backend=backend``, all rows at once."""
    import dataclasses

    from rlbatch.config.schema import RolloutBackend
    from rlbatch.rollout.engines.builtin import build_rollout_engine

    rollout = dataclasses.replace(cfg.rollout, backend=RolloutBackend(backend))
    run = dataclasses.replace(cfg, rollout=rollout)
    return build_rollout_engine(run, model, eos_id=EOS_ID, pad_id=0, chunked=False)


class Clock:
    """CPU seconds of this process and, on CUDA, synchronised wall seconds."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()

    def now(self) -> tuple[float, float]:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.process_time(), time.perf_counter()

    def since(self, start: tuple[float, float]) -> tuple[float, float]:
        """(CPU, wall) seconds since ``start``."""
        cpu, wall = self.now()
        return cpu - start[0], wall - start[1]


def measure_cell(model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model: every backend's start-up, weight sync and generation rates (this process)."""
    import torch

    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model
    from rlbatch.grpo.types import Prompt

    torch.set_num_threads(args.threads)  # before vLLM, which makes it a no-op
    cfg = bench_config(model_name, args)
    parallel.initialize(cfg)  # rlbatch's world first, then vLLM
    torch.manual_seed(0)
    model = build_model(cfg, wrap_ddp=False)
    params = sum(p.numel() for chunk in model for p in chunk.parameters())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, cfg.model.vocab_size, (args.prompts, args.prompt_len), generator=g)
    prompts = [Prompt(index=i, prompt_ids=tuple(r), answer="") for i, r in enumerate(ids.tolist())]
    clock = Clock()
    backends = args.backend.split(",")
    engines: dict[str, Any] = {}
    out: dict[str, dict[str, Any]] = {}
    for name in backends:
        start = clock.now()
        engines[name] = build_engine(cfg, model, name)
        engines[name].generate(prompts[:1], 1, policy_version=0, seed=0)  # the first sample
        out[name] = {"start": clock.since(start), "rates": [], "syncs": []}
    for r in range(args.repeats):
        for name in backends:
            engine, figures = engines[name], out[name]
            if hasattr(engine, "ensure_version"):  # a backend with its own copy of the weights
                start = clock.now()
                engine.ensure_version(r + 1)  # a new version: the weights are streamed in
                figures["syncs"].append(clock.since(start))
            cpu0, wall0 = clock.now()
            samples = engine.generate(prompts, args.generations, policy_version=r + 1, seed=r + 1)
            cpu1, wall1 = clock.now()
            tokens = sum(len(s.response_ids) for s in samples)
            figures["rates"].append((tokens, cpu1 - cpu0, wall1 - wall0))
    return {
        "model": model_name,
        "params": params,
        "rows": args.prompts * args.generations,
        "backends": {name: summarize(out[name], clock.cuda) for name in backends},
        "load_average": os.getloadavg()[0],  # the machine's, at the end of the cell
    }


def summarize(figures: dict[str, Any], cuda: bool) -> dict[str, Any]:
    rates, syncs = figures["rates"], figures["syncs"] or [(0.0, 0.0)]
    return {
        "tokens_per_cpu_s": statistics.median(t / cpu for t, cpu, _ in rates),
        "tokens_per_gpu_s": statistics.median(t / wall for t, _, wall in rates) if cuda else None,
        "tokens": statistics.median(t for t, _, _ in rates),
        "start_cpu_s": figures["start"][0],
        "start_s": figures["start"][1],
        "weight_sync_cpu_s": statistics.median(cpu for cpu, _ in syncs),
        "weight_sync_s": statistics.median(wall for _, wall in syncs),
    }


def run_child(model: str, argv: list[str]) -> dict[str, Any]:
    """measure_cell(model) in a fresh process; its JSON document comes back on stdout."""
    cmd = [sys.executable, "-m", "rlbatch.bench.rollout_backends", *argv, "--cell", model]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"the {model} cell failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def format_report(cells: list[dict[str, Any]]) -> str:
    gpu = any(b["tokens_per_gpu_s"] is not None for c in cells for b in c["backends"].values())
    head = "model     params  rows backend   tok/CPU-s" + ("  tok/GPU-s" if gpu else "")
    lines = [head + "  start CPU-s (wall)  sync CPU-s (wall)  vs megatron"]
    for c in cells:
        base = c["backends"].get("megatron", {}).get("tokens_per_cpu_s")
        for name, b in c["backends"].items():
            ratio = f"{b['tokens_per_cpu_s'] / base:10.2f}x" if base else ""
            per_gpu = f" {b['tokens_per_gpu_s']:10.0f}" if gpu else ""
            lines.append(
                f"{c['model']:<8} {c['params'] / 1e6:6.1f}M {c['rows']:>5} {name:<9}"
                f" {b['tokens_per_cpu_s']:>9.0f}{per_gpu} {b['start_cpu_s']:>11.1f}"
                f" ({b['start_s']:>5.1f}) {b['weight_sync_cpu_s']:>10.3f} ({b['weight_sync_s']:.3f})"
                f" {ratio}"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.cell is not None:
        print(json.dumps(measure_cell(args.cell, args)))
        return 0
    own = [a for a in argv if not a.startswith("--json")]
    cells = []
    for model in args.models.split(","):
        cells.append(run_child(model, own))
        print(model, json.dumps(cells[-1]), file=sys.stderr, flush=True)
    result = {"cells": cells, "setup": vars(args) | {"cell": None}}
    print(json.dumps(result, indent=2) if args.json else format_report(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
