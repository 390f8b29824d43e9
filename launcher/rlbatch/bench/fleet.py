"""rlbatch-bench fleet: an agent harness's episodes on vLLM rollout servers, affine routing
against least-loaded routing: the servers' prefix-cache hit rate and the step time.

    rlbatch-bench fleet [--urls URL,URL | --servers 2] [--turns 4] [--steps 3] [--warmup 1]
                        [--rows 8] [--generations 2] [--max-tokens 8]
                        [--policies affine,least_loaded] [--json] [-- KEY=VALUE ...]

Each policy is one real ``rlbatch-train`` run (``+recipe=grpo_qwen`` at the tiny model with
heads of 32, the overrides after ``--`` on top) of an openai-client harness of ``--turns``
completion calls per episode, each call's prompt the previous one, its completion and a short
"tool" line (so each call extends its episode's conversation, as a multi-turn agent's does),
on the same servers with ``rollout.servers.routing=affine`` (every call of an episode on the
server of its first call) and ``least_loaded`` (every call on the server with the fewest
requests in flight), one after the other in the order of ``--policies``. The servers are ``--urls`` (running rlbatch-serve servers of the same
model) or ``--servers`` that the bench starts with rlbatch-serve for the workload and stops at
the end; both runs use the same servers.

Reported per policy: the prefix-cache hit rate, vLLM's own counters read from every server's
``GET /metrics`` before and after the run (``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``, in prompt tokens, summed over the servers: every request of
the run, its weight syncs' probes included), the prompt tokens queried, the mean step time
over the steps after ``--warmup``, and the share of episodes whose calls all went to one server
(from the run's logging.samples). vLLM reuses whole KV blocks only (``rollout.vllm.block_size``):
prompts shorter than a block hit nothing under either policy. Figures: docs/agents.md, "Which
server an episode's calls go to".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any, Optional

from rlbatch.bench.train_runs import cell, train_run

POLICIES = ("affine", "least_loaded")
"""rollout.servers.routing values, in the order they run."""

MODEL = ["+recipe=grpo_qwen", "model.num_attention_heads=2", "model.num_query_groups=2"]
"""The tiny model with heads of width 32 (the narrowest vLLM's CPU attention runs)."""

HARNESS = '''
PREAMBLE = "You are a careful counter. Row {row}: count up from {row}, one number per turn.\\n"
TOOL = "\\ntool {turn}: ok\\n"


async def run(client, model, row):
    """row["turns"] completion calls; each prompt is the previous prompt, its completion and a
    tool line, so every call extends its episode's conversation token for token."""
    prompt, score = PREAMBLE.format(row=row["answer"]), 0.0
    for turn in range(row["turns"]):
        out = await client.completions.create(
            model=model, prompt=prompt, max_tokens=row["max_tokens"]
        )
        text = out.choices[0].text
        score += float(any(c.isdigit() for c in text)) / row["turns"]
        prompt += text + TOOL.format(turn=turn)
    return score
'''


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(prog="rlbatch-bench fleet", description=__doc__.split("\n")[0])
    p.add_argument("--urls", default="", help="comma list of running rlbatch-serve servers")
    p.add_argument("--servers", type=int, default=2, help="servers to start (without --urls)")
    p.add_argument("--turns", type=int, default=4, help="calls per episode")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the step time")
    p.add_argument("--rows", type=int, default=8, help="dataset rows (prompts per step / 1)")
    p.add_argument("--generations", type=int, default=2, help="episodes per row")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each call")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma list of rollout.servers.routing values, in the order they run")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    urls = [u for u in args.urls.split(",") if u]
    policies = [x for x in args.policies.split(",") if x]
    if (
        args.steps <= args.warmup
        or args.turns < 2
        or args.rows < 1
        or args.generations < 2
        or args.max_tokens < 1
        or (not urls and args.servers < 2)
        or not policies
        or set(policies) - set(POLICIES)
    ):
        p.error(
            "--steps > --warmup, --turns >= 2, --rows >= 1, --generations >= 2, --max-tokens"
            " >= 1, --servers >= 2 without --urls (routing needs a choice of servers), and"
            f" --policies from {','.join(POLICIES)}"
        )
    return args, extra


def workload(args: argparse.Namespace, folder: Path) -> list[str]:
    """Write the harness and its rows into ``folder``; the runs' overrides for them."""
    (folder / "fleet_harness.py").write_text(HARNESS)
    chat = [{"role": "system", "content": "count"}, {"role": "user", "content": "go"}]
    rows = [
        {"prompt": chat, "answer": str(k), "turns": args.turns, "max_tokens": args.max_tokens}
        for k in range(args.rows)
    ]
    (folder / "fleet_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the last call's prompt and completion: the preamble (73 tokens of the byte tokenizer for
    # rows 0-9), every call's completion and the tool lines (12) between them, and a margin
    total = 80 + args.turns * args.max_tokens + (args.turns - 1) * 12 + 16
    return [
        "env.harness=fleet_harness.py:run", "data.source=jsonl",
        f"data.path={folder / 'fleet_rows.jsonl'}", "data.reward=none",
        "data.chat_template=qwen", "data.max_prompt_len=96", f"env.max_total_tokens={total}",
        f"env.max_turns={args.turns}", f"rollout.max_new_tokens={args.max_tokens}",
        f"grpo.num_generations={args.generations}",
        f"grpo.global_batch_size={args.rows * args.generations}",
    ]  # fmt: skip


def cache_counters(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache hits, queries) in prompt tokens, summed over the servers' /metrics."""
    hits = queries = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
            text = answer.read().decode()
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name == "vllm:prefix_cache_hits_total":
                hits += float(line.rsplit(" ", 1)[1])
            elif name == "vllm:prefix_cache_queries_total":
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_servers(count: int, overrides: list[str], folder: Path) -> list[subprocess.Popen]:
    """``count`` rlbatch-serve servers of the runs' config, each in a process group of its own
    (its log: folder/serve-PORT.log); their URLs are read by :func:`server_urls`."""
    serve = Path(sys.executable).parent / "rlbatch-serve"
    procs = []
    for _ in range(count):
        port = _free_port()
        with open(folder / f"serve-{port}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [
                        str(serve) if serve.exists() else "rlbatch-serve",
                        *overrides,
                        f"rollout.servers.port={port}",
                    ],
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    cwd=folder,
                    start_new_session=True,
                )
            )
    return procs


def server_urls(procs: list[subprocess.Popen]) -> list[str]:
    """The URL each server prints once healthy; RuntimeError when one ended first."""
    urls = []
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("http"):
            raise RuntimeError(f"rlbatch-serve did not start (exit code {proc.poll()})")
        urls.append(line)
    return urls


def stop_servers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def one_server_share(run_dir: Path) -> Optional[float]:
    """The share of the run's episodes whose calls all went to one server (logging.samples:
    each episode's last line lists its calls, each with the server that answered it)."""
    episodes = []
    for path in sorted((run_dir / "samples").glob("step_*.jsonl")):
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            if sample["segment"] == sample["segments"] - 1:
                episodes.append(len({call["server"] for call in sample["turns"]}) == 1)
    return sum(episodes) / len(episodes) if episodes else None


def step_time(records: list[dict[str, Any]], warmup: int) -> Optional[float]:
    values = [float(r["step_time_s"]) for r in records if r.get("step", 0) > warmup]
    return statistics.fmean(values) if values else None


def measure(args: argparse.Namespace, extra: list[str]) -> dict[str, dict[str, Any]]:
    root = Path(tempfile.mkdtemp(prefix="rlbatch-bench-fleet-"))
    base = [*MODEL, *workload(args, root), *extra]
    procs: list[subprocess.Popen] = []
    try:
        urls = [u.rstrip("/") for u in args.urls.split(",") if u]
        if not urls:
            procs = start_servers(args.servers, base, root)
            urls = server_urls(procs)
        table: dict[str, dict[str, Any]] = {}
        for policy in [x for x in args.policies.split(",") if x]:
            hits0, queries0 = cache_counters(urls)
            quiet = [
                "logging.plot=false", "logging.tensorboard=false",
                "trainer.checkpoint.export_hf=false", "trainer.checkpoint.every_steps=0",
                "logging.samples=true",
            ]  # fmt: skip
            records, why = train_run(
                [*base, "rollout.backend=vllm_server", "rollout.servers.urls=[" + ",".join(urls)
                 + "]", f"rollout.servers.routing={policy}", f"trainer.max_steps={args.steps}",
                 *quiet],
                root / policy,
            )  # fmt: skip
            hits, queries = cache_counters(urls)
            hits, queries = hits - hits0, queries - queries0
            table[policy] = {
                "policy": policy,
                "refused": why or None,
                "prefix_cache_hit_rate": hits / queries if queries else None,
                "prompt_tokens": queries,
                "step_time_s": step_time(records, args.warmup) if records else None,
                "one_server_episodes": one_server_share(root / policy) if records else None,
                "servers": len(urls),
            }
        return table
    finally:
        stop_servers(procs)
        shutil.rmtree(root, ignore_errors=True)


def render(table: dict[str, dict[str, Any]]) -> str:
    keys = ("prefix_cache_hit_rate", "prompt_tokens", "step_time_s", "one_server_episodes")
    lines = [f"{'routing':<14} " + " ".join(f"{k:>22}" for k in keys)]
    for row in table.values():
        if row["refused"]:
            lines.append(f"{row['policy']:<14} refused: {row['refused']}")
            continue
        lines.append(f"{row['policy']:<14} " + " ".join(f"{cell(row[k]):>22}" for k in keys))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args, extra = _parse(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    table = measure(args, extra)
    print(json.dumps(table, indent=1) if args.json else render(table))
    return 0
