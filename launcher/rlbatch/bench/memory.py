"""rlbatch-bench memory: peak memory and time of one train and one log-prob micro-batch, with the
output projection in chunks (model.logits_chunk_tokens) and without (full logits).

    rlbatch-bench memory [--tokens 4096,16384] [--prompt 1024] [--chunks 0,1024]
                         [--passes train,logprobs] [--rounds 1] [--json] [--quick]
    rlbatch-bench memory --lora 0,16 [--layers 2] [--quick]   # a whole step, LoRA vs full
                                                               # (rlbatch.bench.memory_lora)

Model: Qwen2.5-0.5B's width (vocabulary 151,936, hidden 896, 14 heads in 2 groups, SwiGLU
4864, tied embeddings) with 2 layers, random weights, fp32 on CPU (the params' dtype on GPU:
bf16). A micro-batch of T tokens is T / 4096 sequences of 4096 tokens (``--prompt`` of them a
prompt, the rest a response; only response positions are scored), padded rows. ``train`` is
one forward + backward with the GRPO loss (entropy metric included), ``logprobs`` one
forward-only log-prob pass scoring the responses.

Every measurement runs in a fresh subprocess, so each high-water mark is its own, and the
configurations alternate (unchunked, chunked, unchunked, ...; ``--rounds`` times). The child
resets the kernel's peak-RSS mark (``/proc/self/clear_refs``) right before the measured pass:
``pass_gb`` is the pass's peak RSS above the RSS before it (on GPU: CUDA max allocated above
allocated). ``body`` is the same pass with no position scored, so ``pass_gb - body_gb`` is
the memory of the output layer and the log-softmax; ``seconds`` (wall) and ``cpu_seconds``
(process CPU time) are medians of ``--repeats`` passes after the measured one, and
``time_vs_full`` compares CPU time on a CPU (robust to other processes on a shared machine) and
wall time on a GPU. A 64-token pass runs first (lazily allocated gradients and
caches are not the pass's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from rlbatch.bench.memory_probe import (
    BODY,
    SEQ_LEN,
    build,
    cuda,
    hwm_gb,
    logprob_pass,
    micro_batch,
    reset_hwm,
    rss_gb,
    train_pass,
)


def measure(pass_name: str, tokens: int, prompt: int, chunk: int, repeats: int) -> dict:
    """One configuration in this (fresh) process."""
    import torch

    cfg, model = build(chunk)
    mb, seqs = micro_batch(tokens, prompt, cfg.model.vocab_size)
    run = train_pass if pass_name == "train" else logprob_pass
    score = chunk != BODY
    small, small_seqs = micro_batch(64, 16, cfg.model.vocab_size)
    run(model, small, small_seqs, 16, score)  # lazy set-up (grad tensors, caches) not counted
    before = rss_gb()
    reset_hwm()
    if cuda():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_before = torch.cuda.memory_allocated()
    run(model, mb, seqs, prompt, score)
    row: dict[str, Any] = {"pass": pass_name, "tokens": tokens, "chunk": chunk}
    row["peak_rss_gb"] = hwm_gb()
    row["pass_gb"] = row["peak_rss_gb"] - before
    if cuda():
        row["cuda_pass_gb"] = (torch.cuda.max_memory_allocated() - cuda_before) / 2**30
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        run(model, mb, seqs, prompt, score)
        if cuda():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    row["seconds"] = statistics.median(times)
    row["cpu_seconds"] = statistics.median(cpu_times)
    print(json.dumps(row), file=sys.stderr)
    return row


# ------------------------------------------------------------------------------ the parent
def _child(pass_name: str, tokens: int, chunk: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "rlbatch.bench.memory", "--child", pass_name, str(tokens),
           str(chunk), "--prompt", str(args.prompt), "--repeats", str(args.repeats)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        return {"pass": pass_name, "tokens": tokens, "chunk": chunk,
                "error": (proc.stderr.strip().splitlines() or ["killed"])[-1][:200]}  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_all(args: argparse.Namespace) -> list[dict]:
    """Every (tokens, pass): the body once, then the chunk settings alternating, per round."""
    rows = []
    for tokens in args.tokens:
        for pass_name in args.passes:
            rows.append(_child(pass_name, tokens, BODY, args))
            for _ in range(args.rounds):
                rows += [_child(pass_name, tokens, c, args) for c in args.chunks]
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Median per (pass, tokens, chunk); output-layer memory = pass - body; ratios to chunk 0."""
    keys = sorted({(r["pass"], r["tokens"], r["chunk"]) for r in rows})
    out = []
    for key in keys:
        runs = [r for r in rows if (r["pass"], r["tokens"], r["chunk"]) == key]
        ok = [r for r in runs if "error" not in r]
        row: dict[str, Any] = dict(zip(("pass", "tokens", "chunk"), key, strict=True))
        if not ok:
            row["error"] = runs[0]["error"]
        for field in ("pass_gb", "peak_rss_gb", "cuda_pass_gb", "seconds", "cpu_seconds"):
            if ok and field in ok[0]:
                row[field] = statistics.median(r[field] for r in ok)
        out.append(row)
    for row in out:
        body = _find(out, row["pass"], row["tokens"], BODY)
        full = _find(out, row["pass"], row["tokens"], 0)
        if "pass_gb" in row and body and "pass_gb" in body:
            row["head_gb"] = max(row["pass_gb"] - body["pass_gb"], 0.0)
        clock = "seconds" if cuda() else "cpu_seconds"  # CPU time: robust on a shared CPU
        if full and clock in full and clock in row:
            row["time_vs_full"] = row[clock] / full[clock]
            if row.get("head_gb") and full.get("head_gb") is not None:
                row["head_reduction"] = full["head_gb"] / row["head_gb"]
    return out


def _find(rows: list[dict], pass_name: str, tokens: int, chunk: int) -> dict | None:
    match = [r for r in rows if (r["pass"], r["tokens"], r["chunk"]) == (pass_name, tokens, chunk)]
    return match[0] if match else None


def print_table(rows: list[dict], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"memory of one micro-batch (vocab 151,936, hidden 896, 2 layers), {device}"
    )
    cols = ("pass", "tokens", "chunk", "pass GB", "head GB", "head x less", "s", "cpu s",
            "time/full")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col == "pass" else "right")

    def fmt(row: dict, key: str, spec: str) -> str:
        return format(row[key], spec) if key in row else "-"

    for r in rows:
        chunk = "body" if r["chunk"] == BODY else ("full" if r["chunk"] == 0 else str(r["chunk"]))
        table.add_row(
            r["pass"], str(r["tokens"]), chunk, fmt(r, "pass_gb", ".2f"), fmt(r, "head_gb", ".2f"),
            fmt(r, "head_reduction", ".1f"), fmt(r, "seconds", ".2f"), fmt(r, "cpu_seconds", ".2f"),
            fmt(r, "time_vs_full", ".2f") if "error" not in r else r["error"][:40],
        )  # fmt: skip
    Console().print(table)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlbatch-bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096,16384", help="micro-batch sizes (comma list)")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens of each sequence")
    p.add_argument("--chunks", default="0,1024", help="logits_chunk_tokens values (0 = full)")
    p.add_argument("--passes", default="train,logprobs", help="comma list of: train,logprobs")
    p.add_argument("--rounds", type=int, default=1, help="alternations of the chunk settings")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per measurement")
    p.add_argument("--json", action="store_true", help="print one JSON document only")
    p.add_argument("--quick", action="store_true", help="512-token micro-batches, 128 prompt")
    p.add_argument(
        "--lora",
        default=None,
        help="LoRA ranks (comma list, 0 = full fine-tuning): measure a whole GRPO step instead",
    )
    p.add_argument("--layers", type=int, default=2, help="layers of the model (--lora)")
    p.add_argument("--child", nargs=3, metavar=("PASS", "TOKENS", "CHUNK"), help=argparse.SUPPRESS)
    args = p.parse_args(list(argv))
    if args.quick:
        args.tokens, args.prompt = "512", 128
    args.tokens = [int(t) for t in str(args.tokens).split(",") if t]
    args.chunks = [int(c) for c in str(args.chunks).split(",") if c]
    args.passes = [x for x in str(args.passes).split(",") if x]
    bad = [x for x in args.passes if x not in ("train", "logprobs")]
    bad += [str(t) for t in args.tokens if t % min(t, SEQ_LEN) or t <= args.prompt]
    if bad:
        p.error(f"bad pass / tokens (multiples of {SEQ_LEN} above --prompt): {', '.join(bad)}")
    return args


def main(argv: Sequence[str] = ()) -> int:
    args = parse(argv)
    if args.lora is not None:
        from rlbatch.bench import memory_lora

        ranks = [int(r) for r in str(args.lora).split(",") if r]
        return memory_lora.run(ranks, args.layers, args.tokens[0], args.prompt, args.json)
    if args.child:
        pass_name, tokens, chunk = args.child[0], int(args.child[1]), int(args.child[2])
        print(json.dumps(measure(pass_name, tokens, args.prompt, chunk, args.repeats)))
        return 0
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    device += f", {torch.get_num_threads()} threads"
    raw = run_all(args)
    rows = summarize(raw)
    if args.json:
        print(json.dumps({"device": device, "args": vars(args), "rows": rows, "runs": raw}))
    else:
        print_table(rows, device)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
