"""rlbatch-bench rollout: rlbatch's generation against transformers' ``generate``, side by side.

    rlbatch-bench rollout [--models tiny,small] [--batch-sizes 4,16] [--spreads uniform,longtail]
                          [--max-new-tokens 64] [--rows 32] [--repeats 3] [--threads 2] [--json]
    rlbatch-bench rollout --env calculator    # multi-turn rollouts (rlbatch.bench.rollout_env)
    rlbatch-bench rollout --occupancy         # decode-slot occupancy on a long tail
                                              # (rlbatch.bench.rollout_occupancy)
    rlbatch-bench rollout --backend vllm,megatron  # the rollout backends side by side
                                              # (rlbatch.bench.rollout_backends)

Both generate from the same Hugging Face Qwen2 checkpoint (written by transformers with random
weights: ``tiny`` = vocab 512, hidden 128, 4 layers, 4 heads / 2 KV heads, tied; ``small`` =
~26M parameters) for the same prompts with the same sampling settings (temperature 1, no top-k
/ top-p, the same EOS id, ``--max-new-tokens``). Per cell (model x batch size x prompt-length
spread) the variants run interleaved in one process, ``--repeats`` times; the report gives the
median generated tokens per second of each and the ratio to transformers. Seconds are this
process's CPU seconds by default (``--clock cpu``, one thread): on a shared machine they do not
count time spent waiting for a core; ``--clock wall --threads N`` on a quiet one.

- ``hf``: ``model.generate`` on batches of ``batch size`` rows (left padding, KV cache);
- ``rlbatch``: ``MegatronRolloutEngine`` (continuous batching of ``batch size`` slots);
- ``rlbatch_lockstep``: the same engine through megatron's own forward in lockstep chunks.

Spreads: ``uniform`` prompt lengths 8-64; ``longtail`` 8-400 (most short, a few long).
With random weights a row meets EOS with probability ~1/vocab per token, so completion
lengths vary as in a task whose answers differ in length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    # Qwen2.5-0.5B's widths (vocabulary, hidden, MLP, heads) with 2 of its 24 layers
    "qwen0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
}
EOS_ID = 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlbatch-bench rollout", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,small", help=f"comma list of {','.join(MODELS)}")
    p.add_argument("--batch-sizes", default="4,16", help="rows decoded at once")
    p.add_argument("--spreads", default="uniform,longtail", help="prompt-length spreads")
    p.add_argument("--rows", type=int, default=32, help="completions per measurement")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="tokens per CPU or wall second"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return p.parse_args(argv)


def prompt_lengths(spread: str, rows: int, seed: int = 0) -> list[int]:
    """Prompt lengths of one workload; rows in groups of 4 generations share a prompt."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(0, rows, 4):
        if spread == "uniform":
            n = rng.randint(8, 64)
        else:  # long tail: Pareto-like, 8-400
            n = min(400, int(8 / rng.random() ** 0.9))
        out += [n] * 4
    return out[:rows]


def write_checkpoint(name: str, path: Path, *, eos_id: int = EOS_ID, pad_id: int = 0) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    fields = MODELS[name] | dict(
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    config = Qwen2Config(**fields)
    Qwen2ForCausalLM(config).save_pretrained(path)


def build_rlbatch(path: Path) -> Any:
    from rlbatch.config.schema import RunConfig
    from rlbatch.engine import hf, parallel
    from rlbatch.engine.model import build_model

    cfg = RunConfig()
    cfg.model.hf_path = str(path)
    cfg.model.max_position_embeddings = 2048
    cfg.model, _ = hf.resolve_model_config(cfg.model)
    if not parallel.is_initialized():
        parallel.initialize(cfg)
    model = build_model(cfg, wrap_ddp=False)
    hf.load_hf_into(model, str(path))
    return model


def run_hf(model: Any, prompts: list[list[int]], batch: int, max_new: int, seed: int) -> int:
    """Generated tokens (EOS included) of transformers' generate over batches of rows."""
    import torch

    torch.manual_seed(seed)
    count = 0
    for start in range(0, len(prompts), batch):
        part = prompts[start : start + batch]
        width = max(len(p) for p in part)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in part])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new,
                eos_token_id=EOS_ID,
                pad_token_id=0,
            )
        for row in out[:, width:].tolist():
            count += row.index(EOS_ID) + 1 if EOS_ID in row else len(row)
    return count


def run_rlbatch(model: Any, prompts: list[list[int]], batch: int, max_new: int, seed: int, *,
                continuous: bool) -> int:  # fmt: skip
    from rlbatch.grpo.types import Prompt
    from rlbatch.rollout.engines.builtin import MegatronRolloutEngine, SamplingParams

    params = SamplingParams(max_new_tokens=max_new, eos_id=EOS_ID)
    engine = MegatronRolloutEngine(model, params, chunk_size=batch, continuous=continuous)
    rows = [Prompt(index=i, prompt_ids=tuple(p), answer="") for i, p in enumerate(prompts)]
    return sum(len(s.response_ids) for s in engine.generate(rows, 1, 0, seed))


def _clock(args: argparse.Namespace) -> float:
    """CPU seconds of this process (--clock cpu: robust on a shared machine with one thread)
    or wall-clock seconds (--clock wall)."""
    return time.process_time() if args.clock == "cpu" else time.perf_counter()


def measure_cell(hf_model: Any, model: Any, args: argparse.Namespace, batch: int, spread: str):
    import random

    rng = random.Random(1)
    vocab = hf_model.config.vocab_size
    prompts = []
    for k, n in enumerate(prompt_lengths(spread, args.rows)):
        if k % 4 == 0:
            prompt = [rng.randrange(2, vocab) for _ in range(n)]
        prompts.append(prompt)
    variants = {
        "hf": lambda s: run_hf(hf_model, prompts, batch, args.max_new_tokens, s),
        "rlbatch": lambda s: run_rlbatch(
            model, prompts, batch, args.max_new_tokens, s, continuous=True
        ),
        "rlbatch_lockstep": lambda s: run_rlbatch(
            model, prompts, batch, args.max_new_tokens, s, continuous=False
        ),
    }
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn(0)  # warm-up
    for r in range(args.repeats):
        for name, fn in variants.items():
            t0 = _clock(args)
            tokens = fn(r + 1)
            rates[name].append(tokens / (_clock(args) - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratios = [a / b for a, b in zip(rates["rlbatch"], rates["hf"], strict=True)]
    return {
        "tokens_per_s": med,
        "rlbatch_over_hf": statistics.median(ratios),
        "prompt_tokens": sum(len(p) for p in prompts),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(args.threads)
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = Path(tmp) / name
            write_checkpoint(name, path)
            hf_model = Qwen2ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
            model = build_rlbatch(path)
            params = sum(p.numel() for p in hf_model.parameters())
            for batch in [int(b) for b in args.batch_sizes.split(",")]:
                for spread in args.spreads.split(","):
                    cell = measure_cell(hf_model, model, args, batch, spread)
                    print(name, batch, spread, json.dumps(cell), file=sys.stderr, flush=True)
                    cells.append({"model": name, "params": params, "batch": batch,
                                  "spread": spread} | cell)  # fmt: skip
    return {"cells": cells, "setup": vars(args)}


def format_report(result: dict[str, Any]) -> str:
    lines = ["model  params  batch spread    hf tok/s  rlbatch tok/s  lockstep tok/s  rlbatch/hf"]
    for c in result["cells"]:
        t = c["tokens_per_s"]
        lines.append(
            f"{c['model']:<6} {c['params'] / 1e6:5.1f}M {c['batch']:>5} {c['spread']:<9}"
            f" {t['hf']:>8.0f} {t['rlbatch']:>14.0f} {t['rlbatch_lockstep']:>15.0f}"
            f" {c['rlbatch_over_hf']:>11.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if any(a == "--backend" or a.startswith("--backend=") for a in argv):  # backends compared
        from rlbatch.bench import rollout_backends

        return rollout_backends.main(argv)
    if any(a == "--env" or a.startswith("--env=") for a in argv):  # multi-turn: its own bench
        from rlbatch.bench import rollout_env

        return rollout_env.main(argv)
    if "--occupancy" in argv:  # slot occupancy of the round engine: its own bench
        from rlbatch.bench import rollout_occupancy

        return rollout_occupancy.main(argv)
    args = parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0
