"""rlbatch-bench: benchmarks that print figures (speed and memory targets live here, not in tests).

rlbatch-bench batching   planner quality and speed on synthetic long-tailed workloads
rlbatch-bench engine     forward+backward tokens/s: fixed vs dynamic vs packed batching
rlbatch-bench grpo       one GRPO step timed by stage, batching and aggregation compared
rlbatch-bench memory     peak memory and time of a micro-batch: chunked vs full logits
rlbatch-bench rollout    generation tokens/s: rlbatch against transformers' generate, or the
                         rollout backends side by side (--backend vllm,megatron)
rlbatch-bench rewards    sandboxed code executions/s and judge requests/s
rlbatch-bench servers    GRPO steps with colocated vLLM against vLLM rollout servers
rlbatch-bench fleet      an agent harness on rollout servers: affine vs least-loaded routing
rlbatch-bench distill    held-out reward vs steps and seconds: distillation, GRPO and both
rlbatch-bench moe        an MoE step vs the dense model of equal active parameters, ep 1 vs 2;
                         the planner's balance with MoE costs vs token counts
"""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "batching": ("rlbatch.bench.batching", "planner quality and speed on synthetic workloads"),
    "engine": ("rlbatch.bench.engine", "forward+backward tokens/s: fixed vs dynamic vs packed"),
    "grpo": ("rlbatch.bench.grpo_main", "one GRPO step timed by stage; batching and LCM compared"),
    "memory": ("rlbatch.bench.memory", "peak memory and time of a micro-batch: chunked logits"),
    "rollout": ("rlbatch.bench.rollout", "generation tokens/s against transformers' generate"),
    "rewards": ("rlbatch.bench.rewards", "sandboxed code executions/s and judge requests/s"),
    "servers": ("rlbatch.bench.rollout_servers", "GRPO steps: colocated vLLM against servers"),
    "fleet": ("rlbatch.bench.fleet", "agent harness on servers: affine vs least-loaded routing"),
    "distill": ("rlbatch.bench.distill", "held-out reward: distillation vs GRPO vs both"),
    "moe": ("rlbatch.bench.moe", "MoE step vs dense of equal active parameters; planner costs"),
}


def usage() -> str:
    lines = ["usage: rlbatch-bench {" + ",".join(BENCHES) + "} [options]  (NAME --help for more)"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in BENCHES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if args else 2)
    name, rest = args[0], args[1:]
    if name not in BENCHES:
        print(f"rlbatch-bench: unknown benchmark {name!r}\n{usage()}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(BENCHES[name][0])
    sys.exit(module.main(rest))


if __name__ == "__main__":
    main()
