"""rlbatch-logprobs: score sequences with a model (per-token logprobs), on the infer plan.

    rlbatch-logprobs model.hf_path=DIR logprobs.input=IN.jsonl logprobs.output=OUT.jsonl

Input lines: {"input_ids": [...]} or {"prompt": str, "completion": str}. Output lines, in input
order: {"index": i, "token_logprobs": [...]} (+ "completion_start" for prompt/completion).
Model presets and all batching/parallel overrides apply; workers are launched with torchrun.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from rlbatch.cli.common import compose, fail_config, help_text
from rlbatch.config.errors import ConfigError, ConfigErrors
from rlbatch.config.schema import RunConfig

USAGE = (
    "score sequences. rlbatch-logprobs logprobs.input=IN.jsonl logprobs.output=OUT.jsonl "
    "[model.hf_path=DIR] [KEY=VALUE ...]"
)
LOGPROBS_ENTRY = "rlbatch.jobs.logprobs:run"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in args):
        print(help_text("rlbatch-logprobs", USAGE))
        return
    from rlbatch.config.validate import LOGPROBS_SCOPE

    cfg = compose(args, "rlbatch-logprobs", LOGPROBS_SCOPE)
    errors = []
    if not cfg.logprobs.input or not Path(cfg.logprobs.input).is_file():
        errors.append(ConfigError("logprobs.input", cfg.logprobs.input, "set an existing JSONL"))
    if not cfg.logprobs.output:
        errors.append(ConfigError("logprobs.output", None, "set the output JSONL path"))
    if not errors:
        errors += check_input(cfg)
    if errors:
        fail_config(ConfigErrors(errors), "rlbatch-logprobs")
    from rlbatch.runtime.driver import launch

    run_dir = Path("outputs") / "logprobs" / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
    sys.exit(launch(cfg, run_dir, entry=LOGPROBS_ENTRY))


def check_input(cfg: RunConfig) -> list[ConfigError]:
    """The input file, read and checked here before any worker starts: JSON lines of the two
    shapes, token ids inside the vocabulary, lengths within model.max_position_embeddings, an
    MoE row's "routing" of the model's shape."""
    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.jobs.logprobs import check_rows, read_rows, routing_arrays

    path = str(cfg.logprobs.input)
    try:
        rows = read_rows(path, lambda: build_tokenizer(cfg.model))
        check_rows(rows, cfg.model.vocab_size, cfg.model.max_position_embeddings, path)
        routing_arrays(rows, cfg.model, path)
    except ValueError as err:
        return [ConfigError("logprobs.input", path, str(err))]
    return []


if __name__ == "__main__":
    main()
