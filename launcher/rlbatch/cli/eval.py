"""rlbatch-eval: evaluate a training run's checkpoint, or a Hugging Face model, on held-out
prompts (pass@k, mean@N, maj@N; docs/evaluation.md).

    rlbatch-eval RUN_DIR [--step N | --best] [--json] [eval.KEY=VALUE ...]
    rlbatch-eval model.hf_path=DIR_OR_HUB_ID [--json] [KEY=VALUE ...]

A run directory is evaluated with its own resolved.yaml (model, tokenizer, parallel layout,
eval.* keys), the overrides on top; a checkpoint saved at any layout loads. A Hugging Face
model composes the default config like rlbatch-train. Every input is checked before a worker
starts (the keys, the checkpoint, every row of the evaluation set, the reward functions). The
result is a table (or one JSON document on stdout with --json) and the per-prompt samples
file. No torch at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from rlbatch.cli.common import fail_config
from rlbatch.config.errors import ConfigError, ConfigErrors
from rlbatch.config.schema import RunConfig

EVAL_ENTRY = "rlbatch.eval.job:run"
REQUEST = "eval_request.json"
"""What the workers read from their run directory: the checkpoint (or null) and its step."""
RESULT = "eval_result.json"
"""What rank 0 writes back: the metrics and the samples file."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlbatch-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("args", nargs="*", help="RUN_DIR and/or KEY=VALUE overrides")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--best", action="store_true", help="the best keep_best checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--out", default=None, help="output directory (default outputs/eval/...)")
    return p


def _checks(source: Optional[Path], args: argparse.Namespace, picked: dict[str, Any]):
    """rlbatch-eval's own checks (to_validated_run_config's ``extra``): the tokenizer, the
    checkpoint, the evaluation set and rewards; the chosen checkpoint goes into ``picked``."""

    def check(cfg: RunConfig) -> tuple[list[ConfigError], list[str]]:
        from rlbatch.cli.export import select_checkpoint
        from rlbatch.config.agent_rules import eval_needs_tasks
        from rlbatch.engine.tokenizer import tokenizer_errors
        from rlbatch.grpo.preflight import check_eval_inputs, check_rollout_servers

        errors: list[ConfigError] = tokenizer_errors(cfg.model)  # the model's own, or stop
        if source is not None:
            cfg.run_dir = str(source)
            picked["checkpoint"] = select_checkpoint(cfg, args.step, args.best, errors)
        elif cfg.model.hf_path is None:
            errors.append(
                ConfigError(
                    "model.hf_path",
                    None,
                    "nothing to evaluate: give a run directory, or model.hf_path=DIR (a Hugging"
                    " Face model directory or hub id)",
                )
            )
        elif args.step is not None or args.best:
            errors.append(ConfigError("--step/--best", True, "need a run directory"))
        if cfg.env.agent.verifiers and not cfg.eval.verifiers:  # its tasks are the training rows
            errors.append(eval_needs_tasks(cfg.env.agent.verifiers, "rlbatch-eval"))
        elif cfg.eval.verifiers and not cfg.env.agent.verifiers:
            errors.append(
                ConfigError(
                    "eval.verifiers",
                    cfg.eval.verifiers,
                    "evaluates with the built-in verifiers harness, which env.agent.verifiers"
                    " selects: set env.agent.verifiers (the run's training environment), or"
                    " eval.verifiers=null to evaluate on eval.data",
                )
            )
        check_eval_inputs(cfg, errors)
        check_rollout_servers(cfg, errors)
        return errors, []

    return check


def _config(args: argparse.Namespace, picked: dict[str, Any]) -> RunConfig:
    from rlbatch.config.validate import EVAL_SCOPE

    targets = [a for a in args.args if "=" not in a]
    overrides = [a for a in args.args if "=" in a]
    if len(targets) > 1:
        fail_config(ConfigErrors([ConfigError("RUN_DIR", targets, "give one")]), "rlbatch-eval")
    if not targets:
        from rlbatch.cli.common import compose

        return compose(overrides, "rlbatch-eval", EVAL_SCOPE, _checks(None, args, picked))
    source = Path(targets[0]).resolve()
    resolved = source / "resolved.yaml"
    if not resolved.is_file():
        error = ConfigError("RUN_DIR", targets[0], "no resolved.yaml: not a training run directory")
        fail_config(ConfigErrors([error]), "rlbatch-eval")
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rlbatch.cli.common import to_validated_run_config

    try:
        merged = OmegaConf.merge(OmegaConf.load(resolved), OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as err:
        fail_config(ConfigErrors([ConfigError("overrides", overrides, str(err))]), "rlbatch-eval")
    return to_validated_run_config(
        merged, "rlbatch-eval", EVAL_SCOPE, _checks(source, args, picked)
    )


def _step(checkpoint: Optional[Path]) -> int:
    """The checkpoint's step (0: a Hugging Face model)."""
    return 0 if checkpoint is None else int(checkpoint.name.rsplit("_", 1)[1])


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    picked: dict[str, Any] = {}
    cfg = _config(args, picked)
    checkpoint: Optional[Path] = picked.get("checkpoint")
    from rlbatch.runtime.driver import launch

    stamp = f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
    work = Path(args.out) if args.out else Path("outputs") / "eval" / stamp
    work.mkdir(parents=True, exist_ok=True)
    request = {
        "checkpoint": None if checkpoint is None else str(checkpoint.resolve()),
        "step": _step(checkpoint),
    }
    (work / REQUEST).write_text(json.dumps(request, indent=2) + "\n")
    source = cfg.run_dir if checkpoint is not None else cfg.model.hf_path
    # the checkpoint is read from its own path: evaluating never locks (or writes into) the
    # training run's checkpoint directory, which may belong to a run still training
    cfg.trainer.checkpoint.dir = None
    code = launch(cfg, work, entry=EVAL_ENTRY, stdout_to_stderr=args.json)
    if code:
        sys.exit(code)
    result = json.loads((work / RESULT).read_text())
    result["source"] = source
    _print(result, args.json)


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    from rich.console import Console

    from rlbatch.eval.report import eval_table

    name = Path(str(result["source"])).name
    where = f"{name} step {result['step']}" if result["checkpoint"] else name
    console = Console()
    console.print(eval_table([{"step": result["step"], **result["metrics"]}], f"{where}"))
    console.print(f"samples: {result['samples']}", highlight=False)


if __name__ == "__main__":
    main()
