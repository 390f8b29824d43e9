"""Worker side of rlbatch-eval: ``run(cfg)`` in every worker. Builds the model at the command's
parallel layout, loads the checkpoint the request names (any saved layout: sharded model
state reshards) or the Hugging Face weights of model.hf_path, evaluates it
(:class:`rlbatch.eval.runner.Evaluator`: prompts over the DP ranks, results gathered), and
rank 0 writes ``eval/step_NNNNN.jsonl`` and the result file the CLI prints."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rlbatch.config.schema import RunConfig

log = logging.getLogger("rlbatch.eval")


def run(cfg: RunConfig) -> None:
    """The rlbatch-eval worker entry (every rank calls it)."""
    from rlbatch import distributed
    from rlbatch.cli.eval import REQUEST, RESULT
    from rlbatch.engine import parallel
    from rlbatch.engine.setup import set_up_model
    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.eval.report import write_samples
    from rlbatch.eval.runner import Evaluator, samples_path
    from rlbatch.jobs.export import load_model_state
    from rlbatch.rollout.protocol import shutdown_synced_engines

    assert cfg.run_dir is not None, "the driver sets run_dir"
    work = Path(cfg.run_dir)
    request = json.loads((work / REQUEST).read_text())
    checkpoint, step = request["checkpoint"], request["step"]
    setup = set_up_model(cfg, wrap_ddp=False, load_weights=checkpoint is None)
    state = setup.state
    if checkpoint is not None:
        load_model_state(setup.model, checkpoint, state.rank, state.world_size)
    tokenizer = build_tokenizer(setup.cfg.model)
    evaluator = Evaluator(
        setup.cfg,
        setup.model,
        tokenizer,
        dp_rank=state.dp_rank,
        dp_size=state.dp,
        gather=distributed.dp_gather_object,
    )
    try:
        metrics, results = evaluator.evaluate(step)
    finally:
        evaluator.close()
        # before the process groups, also when evaluation failed: vLLM destroys its own
        shutdown_synced_engines()
    if state.rank == 0:
        path = samples_path(work, step)
        write_samples(path, results)
        body = {"checkpoint": checkpoint, "step": step, "metrics": metrics, "samples": str(path)}
        (work / RESULT).write_text(json.dumps(body, indent=2) + "\n")
        log.info("evaluated %d prompts: %s", len(results), path)
    parallel.destroy()
