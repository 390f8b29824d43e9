"""rlbatch-bench rewards: sandboxed executions per second and judge requests per second.

    rlbatch-bench rewards [--workers 1,2] [--repeats 2] [--requests 200] [--concurrency 8]

Sandbox: the shipped code problems' reference answers (conf/data/code_sample.jsonl, every test
passes) scored with data.reward=code_exec, each stdin/stdout case and test_code one sandboxed
execution, at each pool size. Judge: a local OpenAI-compatible ``/v1/chat/completions`` server
(standard library, in this process, answering at once) asked ``--requests`` times through the
judge reward's client; the figure is the client's overhead ceiling, not a model's speed.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlbatch.config.rewards import CodeExecConfig, Isolation, JudgeConfig, ServedConfig
from rlbatch.config.store import conf_dir


def bench_sandbox(workers: int, repeats: int) -> dict[str, float]:
    from rlbatch.rewards.code_exec import CodeExecReward
    from rlbatch.rewards.sandbox import probe_isolation

    isolation, why = probe_isolation(Isolation.auto)
    if isolation is None:
        raise SystemExit(f"rlbatch-bench rewards: no sandbox here ({why})")
    rows = [
        json.loads(x) for x in (conf_dir() / "data" / "code_sample.jsonl").read_text().splitlines()
    ]
    rows = rows * repeats
    executions = sum(len(r.get("tests") or []) + bool(r.get("test_code")) for r in rows)
    reward = CodeExecReward(CodeExecConfig(num_workers=workers), isolation)
    started = time.perf_counter()
    out = reward.score([r["answer"] for r in rows], rows)
    seconds = time.perf_counter() - started
    assert all(s.value == 1.0 for s in out), "a reference answer failed its tests"
    return {"workers": workers, "executions": executions, "seconds": seconds,
            "executions_per_s": executions / seconds}  # fmt: skip


class _Judge(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "7"}}]}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def bench_judge(requests: int, concurrency: int) -> dict[str, float]:
    from rlbatch.rewards.judge import JudgeReward

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        judge = JudgeReward(url, JudgeConfig(), ServedConfig(max_concurrency=concurrency))
        messages = [judge.message(f"q{i}", "a", "a") for i in range(requests)]
        started = time.perf_counter()
        out = judge.score(messages, [f"sample {i}" for i in range(requests)])
        seconds = time.perf_counter() - started
        assert all(abs(s.value - 0.7) < 1e-9 for s in out)
    finally:
        server.shutdown()
        server.server_close()
    return {"requests": requests, "concurrency": concurrency, "seconds": seconds,
            "requests_per_s": requests / seconds}  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlbatch-bench rewards", description=__doc__)
    parser.add_argument("--workers", default="1,2", help="pool sizes, comma separated")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the 32 problems")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    for workers in (int(w) for w in args.workers.split(",")):
        r = bench_sandbox(workers, args.repeats)
        print(f"sandbox  workers={workers}: {r['executions']} executions in {r['seconds']:.2f} s"
              f" = {r['executions_per_s']:.1f} executions/s")  # fmt: skip
    r = bench_judge(args.requests, args.concurrency)
    print(f"judge    concurrency={args.concurrency}: {args.requests} requests in"
          f" {r['seconds']:.2f} s = {r['requests_per_s']:.0f} requests/s")  # fmt: skip
    return 0
