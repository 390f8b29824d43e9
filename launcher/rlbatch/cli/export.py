"""rlbatch-export: a checkpoint step of a training run -> a Hugging Face model directory.

    rlbatch-export RUN_DIR --out DIR [--step N | --best] [--dtype fp32|bf16|fp16]
                   [--max-shard-size 2GB]

Reads RUN_DIR/resolved.yaml, launches workers with the run's own parallel layout (tp, pp, vpp,
dp), loads the checkpoint step (default: the newest complete one; ``--best``: the one of the
best trainer.checkpoint.keep_best value in metrics.jsonl) and writes sharded
safetensors + index, config.json, generation_config.json and the source model's tokenizer
files. The result loads with ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``.
No torch at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

from rlbatch.config.errors import ConfigError, ConfigErrors

EXPORT_ENTRY = "rlbatch.jobs.export:run"
REQUEST = "export.json"
"""What the export workers read from their run directory (checkpoint, output, dtype, shards)."""
DTYPES = ("fp32", "bf16", "fp16")
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> Optional[int]:
    """'2GB' / '500MB' / '40KiB' / '1000' -> bytes (None when unreadable)."""
    match = _SIZE_RE.match(text.strip())
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlbatch-export", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a training run directory (holds resolved.yaml)")
    p.add_argument("--out", required=True, help="output Hugging Face directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument(
        "--best", action="store_true", help="the checkpoint of the best keep_best metric value"
    )
    p.add_argument("--dtype", default=None, choices=DTYPES, help="default: the model's")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (2GB)")
    return p


def select_checkpoint(
    run_cfg, step: Optional[int], best: bool, errors: list[ConfigError]
) -> Optional[Path]:
    """The checkpoint ``--step N`` / ``--best`` / neither (the newest) names; else an error."""
    from rlbatch.train.checkpoint import list_checkpoints

    root = run_cfg.trainer.checkpoint.dir or Path(run_cfg.run_dir) / "checkpoints"
    found = dict(list_checkpoints(root))
    if not found:
        errors.append(ConfigError("run_dir", run_cfg.run_dir, f"no complete checkpoint in {root}"))
        return None
    if best:
        if step is not None:
            errors.append(ConfigError("--best", True, "excludes --step: pass one of them"))
            return None
        step = _best_step(run_cfg, sorted(found), errors)
        if step is None:
            return None
    if step is None:
        return found[max(found)]
    if step not in found:
        errors.append(
            ConfigError("--step", step, f"no complete checkpoint; available: {sorted(found)}")
        )
    return found.get(step)


def _best_step(run_cfg, steps: list[int], errors: list[ConfigError]) -> Optional[int]:
    """The checkpointed step of the best trainer.checkpoint.keep_best value (metrics.jsonl)."""
    from rlbatch.eval.metrics import best_step
    from rlbatch.train.metrics import read_jsonl

    ckpt = run_cfg.trainer.checkpoint
    if ckpt.keep_best is None:
        errors.append(
            ConfigError(
                "--best", True, "the run has no trainer.checkpoint.keep_best metric: pass --step N"
            )
        )
        return None
    records = read_jsonl(Path(run_cfg.run_dir) / "metrics.jsonl")
    step = best_step(records, ckpt.keep_best, ckpt.keep_best_mode.value, steps)
    if step is None:
        errors.append(
            ConfigError(
                "--best",
                True,
                f"no checkpoint (steps {steps}) has a {ckpt.keep_best} value in metrics.jsonl:"
                " pass --step N",
            )
        )
    return step


def main(argv: list[str] | None = None) -> None:
    from rlbatch.cli.common import fail_config

    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    resolved = Path(args.run_dir) / "resolved.yaml"
    if not resolved.is_file():
        fail_config(
            ConfigErrors([ConfigError("run_dir", args.run_dir, "no resolved.yaml: not a run")]),
            "rlbatch-export",
        )
    from rlbatch.config.load import load_run_config

    run_cfg = load_run_config(resolved)
    run_cfg.run_dir = run_cfg.run_dir or str(resolved.parent)
    errors: list[ConfigError] = []
    shard_bytes = parse_size(args.max_shard_size)
    if not shard_bytes:
        errors.append(ConfigError("--max-shard-size", args.max_shard_size, "e.g. 2GB or 500MB"))
    ckpt = select_checkpoint(run_cfg, args.step, args.best, errors)
    if errors:
        fail_config(ConfigErrors(errors), "rlbatch-export")
    from rlbatch.runtime.driver import launch

    work = Path("outputs") / "export" / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    request = {
        "checkpoint": str(Path(str(ckpt)).resolve()),
        "output": str(Path(args.out).resolve()),
        "dtype": args.dtype,
        "max_shard_bytes": shard_bytes,
    }
    (work / REQUEST).write_text(json.dumps(request, indent=2) + "\n")
    code = launch(run_cfg, work, entry=EXPORT_ENTRY)
    if code == 0:
        print(f"rlbatch-export: wrote {args.out} from {ckpt}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
