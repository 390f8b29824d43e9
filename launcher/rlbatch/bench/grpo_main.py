"""rlbatch-bench grpo: which GRPO benchmark to run (rlbatch.bench.grpo by stage, --async
rlbatch.bench.grpo_async, --against trl rlbatch.bench.grpo_trl); one argument parser for all."""

from __future__ import annotations

import json

from rlbatch.bench.grpo import format_report, parse_args, run


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.run_async:
        from rlbatch.bench.grpo_async import format_async, run_async

        result = run_async(
            args.steps, args.repeats, args.threads, args.warmup, args.workload, args.variants
        )
        print(json.dumps(result, indent=2) if args.json else format_async(result))
        return 0
    if args.against == "trl":
        from rlbatch.bench import grpo_trl

        result = grpo_trl.run(args)
        print(json.dumps(result, indent=2) if args.json else grpo_trl.format_report(result))
        return 0
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0
