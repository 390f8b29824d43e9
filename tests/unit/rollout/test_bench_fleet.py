"""rlbatch-bench fleet's pure parts, without a server: the prefix-cache counters read from a
vLLM-style /metrics page (a stdlib HTTP server), the share of episodes on one server from
logged samples, the harness the runs train (its calls extend each other), and the options."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from types import SimpleNamespace

import pytest

from rlbatch.bench.fleet import HARNESS, _parse, cache_counters, one_server_share, workload

PAGE = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 480.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 99.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
"""


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        body = PAGE.encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_counters_are_vllms_hits_and_queries_summed_over_the_servers():
    servers = [http.server.HTTPServer(("127.0.0.1", 0), _Metrics) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
        assert cache_counters(urls) == (960.0, 2400.0)  # the external cache's line left out
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_the_one_server_share_reads_each_episodes_last_line(tmp_path):
    lines = [  # an episode split in two (its calls on its last line), two more episodes
        {"segment": 0, "segments": 2, "turns": []},
        {"segment": 1, "segments": 2, "turns": [{"server": "a"}, {"server": "a"}]},
        {"segment": 0, "segments": 1, "turns": [{"server": "a"}, {"server": "b"}]},
        {"segment": 0, "segments": 1, "turns": [{"server": "b"}]},
    ]
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "step_00001.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines)
    )
    assert one_server_share(tmp_path) == pytest.approx(2 / 3)
    assert one_server_share(tmp_path / "none") is None


def test_each_call_of_the_harness_extends_the_last_and_the_workload_fits(tmp_path):
    args, extra = _parse(["--turns", "4", "--max-tokens", "6", "--", "a=1"])
    overrides = workload(args, tmp_path)
    assert extra == ["a=1"] and "env.max_turns=4" in overrides
    row = json.loads((tmp_path / "fleet_rows.jsonl").read_text().splitlines()[3])
    prompts = []

    class Completions:
        async def create(self, model, prompt, max_tokens):
            prompts.append(prompt)
            assert max_tokens == 6
            return SimpleNamespace(choices=[SimpleNamespace(text="x" * max_tokens)])

    scope: dict = {}
    exec(HARNESS, scope)
    client = SimpleNamespace(completions=Completions())
    assert asyncio.run(scope["run"](client, "policy", row)) == 0.0
    assert len(prompts) == 4 and "Row 3" in prompts[0]
    for a, b in zip(prompts, prompts[1:], strict=False):
        assert b.startswith(a + "x" * 6)
    total = int(next(o for o in overrides if o.startswith("env.max_total_tokens=")).split("=")[1])
    assert len(prompts[-1].encode()) + 6 <= total  # the byte tokenizer: a byte a token


@pytest.mark.parametrize(
    "argv",
    [["--servers", "1"], ["--turns", "1"], ["--steps", "1", "--warmup", "1"], ["--policies", "x"]],
)
def test_options_a_comparison_cannot_run_with_are_refused(argv):
    with pytest.raises(SystemExit):
        _parse(argv)
