"""rlbatch-plan: preview how a batch will be split, with the same config as training.

    rlbatch-plan +recipe=grpo_qwen plan.lengths=lengths.json
    rlbatch-plan +recipe=grpo_qwen plan.synthetic=grpo_math plan.num_samples=8192 \
        parallel.dp=8 parallel.pp=2 parallel.vpp=2 batching.train.mode=packed plan.json=true

Runs in this process (no workers, no torch); with plan.json=true stdout carries exactly one
JSON document.
"""

from __future__ import annotations

import sys

from rlbatch.cli.common import compose, help_text

USAGE = (
    "preview micro-batch plans. rlbatch-plan [+recipe=NAME] plan.lengths=FILE | "
    "plan.synthetic=WORKLOAD [plan.pass=train|infer] [plan.json=true] [KEY=VALUE ...]"
)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in args):
        print(help_text("rlbatch-plan", USAGE))
        return
    from rlbatch.config.validate import PLAN_SCOPE

    cfg = compose(args, "rlbatch-plan", PLAN_SCOPE)
    from rlbatch.cli.plan_report import run_plan_command

    sys.exit(run_plan_command(cfg))


if __name__ == "__main__":
    main()
