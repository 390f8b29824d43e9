"""Worker side of rlbatch-logprobs: ``run(cfg)`` inside every torchrun worker.

Reads ``logprobs.input`` (JSONL: {"input_ids": [...]} or {"prompt": str, "completion": str};
an MoE model's row may add "routing": one [k expert ids] list per MoE layer per token, which
the routers replay, -1 = the router's own choice: how a rollout's recorded routing is scored),
builds the model (``model.hf_path`` weights when set), plans the pass with the planner over
``batching.infer`` (token budget, dp / pp / vpp), computes per-token logprobs chunk by chunk and
rank 0 writes ``logprobs.output`` in input order:

    {"index": i, "token_logprobs": [...]}                       # input_ids: n - 1 values
    {"index": i, "token_logprobs": [...], "completion_start": s}  # prompt/completion

token_logprobs[j] = log p(token j+1 | tokens 0..j); for prompt/completion only the completion
tokens are scored (token_logprobs[k] scores token s + k). With ``logprobs.entropy`` an
"entropy" list aligned with token_logprobs is added.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rlbatch.config.schema import RunConfig

log = logging.getLogger("rlbatch.logprobs")

PROGRESS_MIN_MICRO_BATCHES = 4
"""Show a progress bar (rank 0) when the pass has at least this many micro-batches."""


@dataclass(frozen=True)
class Row:
    ids: list[int]
    completion_start: Optional[int]
    """None for input_ids rows."""
    routing: Optional[list] = None
    """MoE: ``[len(ids)][num MoE layers][k]`` expert ids to replay (-1 = route freely)."""


def read_rows(path: str, tokenizer_factory: Any) -> list[Row]:
    """Parse the input JSONL; errors name the line. ``tokenizer_factory()`` is called only
    when a prompt/completion row needs it."""
    rows: list[Row] = []
    tokenizer = None
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not JSON ({exc})") from exc
            if "input_ids" in obj:
                ids = obj["input_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise ValueError(f"{path}:{line_no}: input_ids must be a list of ints")
                rows.append(Row(list(ids), None, obj.get("routing")))
            elif "prompt" in obj and "completion" in obj:
                if tokenizer is None:
                    tokenizer = tokenizer_factory()
                prompt = tokenizer.encode(str(obj["prompt"]))
                completion = tokenizer.encode(str(obj["completion"]))
                rows.append(Row(prompt + completion, len(prompt), obj.get("routing")))
            else:
                raise ValueError(
                    f'{path}:{line_no}: expected {{"input_ids": [...]}} or '
                    f'{{"prompt": str, "completion": str}}, got keys {sorted(obj)}'
                )
    return rows


def check_rows(rows: list[Row], vocab_size: int, max_len: int, path: str) -> None:
    """Every row scorable by the model: non-empty, token ids in [0, vocab_size), at most
    max_len tokens. Raises one ValueError naming every bad row (the first 10, and a count)."""
    errors = []
    for i, row in enumerate(rows):
        if len(row.ids) < 1:
            errors.append(f"row {i}: empty sequence")
        elif max(row.ids) >= vocab_size or min(row.ids) < 0:
            bad = next(t for t in row.ids if not 0 <= t < vocab_size)
            errors.append(
                f"row {i}: token id {bad} outside [0, model.vocab_size={vocab_size}) "
                "(ids must come from the model's tokenizer)"
            )
        elif len(row.ids) > max_len:
            errors.append(
                f"row {i}: {len(row.ids)} tokens > model.max_position_embeddings={max_len} "
                "(shorten it, or raise model.max_position_embeddings)"
            )
    if errors:
        more = f"; and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise ValueError(f"{path}: " + "; ".join(errors[:10]) + more)


def routing_arrays(rows: list[Row], model: Any, path: str) -> Optional[list[Any]]:
    """The rows' "routing" as ``[len, layers, k]`` arrays to replay (None when no row has one);
    a ValueError naming every bad row: routing on a dense model, a shape that is not
    (tokens, MoE layers, k), ids outside [-1, num_moe_experts)."""
    import numpy as np

    from rlbatch.config.moe import num_moe_layers

    if all(r.routing is None for r in rows):
        return None
    if model.num_moe_experts is None:
        raise ValueError(f'{path}: "routing" needs an MoE model (model.num_moe_experts)')
    layers, k, experts = num_moe_layers(model), model.moe_router_topk, model.num_moe_experts
    out: list[Any] = []
    errors = []
    for i, row in enumerate(rows):
        if row.routing is None:
            out.append(None)
            continue
        try:
            arr = np.asarray(row.routing, dtype=np.int64)
        except (TypeError, ValueError):
            arr = np.zeros(0, dtype=np.int64)
        if arr.shape != (len(row.ids), layers, k):
            errors.append(f"row {i}: routing of shape {arr.shape}, expected "
                          f"({len(row.ids)} tokens, {layers} MoE layers, k={k})")  # fmt: skip
        elif arr.size:
            errors.extend(f"row {i}: {e}" for e in _routing_problems(arr, experts))
        out.append(arr)
    if errors:
        more = f"; and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise ValueError(f"{path}: " + "; ".join(errors[:10]) + more)
    return out


def _routing_problems(arr: Any, experts: int) -> list[str]:
    """What a router could never have chosen in ``arr`` ``[tokens, layers, k]``: ids outside
    [-1, experts), a (token, layer) with some but not all of its k ids unknown (-1 = the
    router's own choice, for all k or none), the same expert twice among one token's k."""
    import numpy as np

    problems = []
    if arr.min() < -1 or arr.max() >= experts:
        problems.append(f"expert ids must be in [-1, {experts})")
    known = arr >= 0
    partial = np.argwhere(known.any(-1) != known.all(-1))
    if len(partial):
        t, layer = partial[0]
        problems.append(
            f"token {t}, MoE layer {layer}: {arr[t, layer].tolist()} mixes -1 with expert ids "
            "(give all k experts of a token's layer, or -1 for all k: the router's own choice)"
        )
    ordered = np.sort(arr, axis=-1)
    twice = np.argwhere(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(-1))
    if len(twice):
        t, layer = twice[0]
        problems.append(
            f"token {t}, MoE layer {layer}: {arr[t, layer].tolist()} names an expert twice "
            "(a token's k experts are distinct)"
        )
    return problems


def first_scored(row: Row) -> int:
    """The first scored position: 0, or the one predicting the completion's first token."""
    return 0 if row.completion_start is None else max(row.completion_start - 1, 0)


def output_record(i: int, row: Row, logps: list[float], entropy: Optional[list[float]]) -> dict:
    """The output line of row i (``logps`` / ``entropy``: from :func:`first_scored` on)."""
    rec: dict[str, Any] = {"index": i, "token_logprobs": logps}
    if row.completion_start is not None:
        rec["completion_start"] = row.completion_start
    if entropy is not None:
        rec["entropy"] = entropy
    return rec


def write_jsonl(path: str, records: list[dict]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    tmp.replace(out)


class _Progress:
    """A rich progress bar on rank 0 (no-op elsewhere or for short passes)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and total >= PROGRESS_MIN_MICRO_BATCHES:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

            self.bar = Progress(
                "[bold]logprobs",
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.task = self.bar.add_task("logprobs", total=total)
            self.bar.start()

    def advance(self, _: Any = None) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run(cfg: RunConfig) -> None:
    """The rlbatch-logprobs worker entry (every rank calls it)."""
    import torch.distributed as dist

    from rlbatch.batching import cost_model_for, plan_pass
    from rlbatch.engine import logprobs, parallel
    from rlbatch.engine.setup import set_up_model
    from rlbatch.engine.tokenizer import build_tokenizer

    source, target = cfg.logprobs.input, cfg.logprobs.output
    if not source or not target:
        raise ValueError("set logprobs.input and logprobs.output")
    owns_world = not dist.is_initialized()
    setup = set_up_model(cfg, wrap_ddp=False)
    cfg, model, state = setup.cfg, setup.model, setup.state
    rows = read_rows(source, lambda: build_tokenizer(cfg.model))
    check_rows(rows, cfg.model.vocab_size, cfg.model.max_position_embeddings, source)
    replay = routing_arrays(rows, cfg.model, source)
    infer = cfg.batching.infer
    lengths = [len(r.ids) for r in rows]
    plan = plan_pass(
        lengths,
        infer,
        dp=state.dp,
        pp=state.pp,
        vpp=state.vpp,
        microbatch_group_size=cfg.parallel.microbatch_group_size_per_vp_stage,
        cost=cost_model_for(cfg.model, infer),
        seed=cfg.trainer.seed,
        pass_name="infer",
    )
    if state.rank == 0:
        log.info(
            "%d sequences, %d micro-batches per rank (%s, max_tokens=%d), padding efficiency %.3f",
            len(rows), plan.num_micro_batches, plan.mode, infer.max_tokens,
            plan.stats.padding_efficiency,
        )  # fmt: skip
    progress = _Progress(plan.num_micro_batches, enabled=state.rank == 0 and cfg.logging.progress)
    try:
        result = logprobs.compute_logprobs(
            model,
            [r.ids for r in rows],
            plan,
            round_to=infer.sequence_length_round,
            entropy=cfg.logprobs.entropy,
            on_micro_batch=progress.advance,
            score_from=[first_scored(r) for r in rows],
            replay=replay,
        )
    finally:
        progress.stop()
    logps, ents = result if cfg.logprobs.entropy else (result, None)
    if state.rank == 0:
        records = [
            output_record(i, row, logps[i].tolist(), None if ents is None else ents[i].tolist())
            for i, row in enumerate(rows)
        ]
        write_jsonl(target, records)
        log.info("wrote %s (%d lines)", target, len(records))
    if owns_world:  # a caller's world (tests, notebooks) is left as it is
        parallel.destroy()
