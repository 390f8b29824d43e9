"""What rlbatch-bench memory measures with (rlbatch.bench.memory and its LoRA variant
rlbatch.bench.memory_lora): the bench model, its micro-batches, one train or log-prob pass,
and the process's resident-set figures."""

from __future__ import annotations

import os
from typing import Any

SEQ_LEN = 4096
MODEL = dict(
    name="qwen2_5_0_5b_2l",
    num_layers=2,
    hidden_size=896,
    ffn_hidden_size=4864,
    num_attention_heads=14,
    num_query_groups=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
BODY = -1
"""--chunk value of the body-only measurement (chunked projection, nothing scored)."""
BODY_CHUNK = 1024


# ------------------------------------------------------------------------------- the child
def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def hwm_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_hwm() -> None:
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build(chunk: int) -> tuple[Any, Any]:
    from dataclasses import replace

    from rlbatch.config.schema import Dtype, RunConfig
    from rlbatch.engine import lm_head, parallel
    from rlbatch.engine.model import build_model

    cfg = RunConfig()
    cfg.model = replace(cfg.model, **MODEL)  # type: ignore[arg-type]
    if cuda():
        cfg.model = replace(cfg.model, params_dtype=Dtype.bf16)
    if not parallel.is_initialized():
        parallel.initialize(cfg)
    parallel.seed(0)
    model = build_model(cfg, wrap_ddp=False)
    lm_head.set_logits_chunk_tokens(model, BODY_CHUNK if chunk == BODY else chunk)
    return cfg, model


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def micro_batch(tokens: int, prompt: int, vocab: int) -> tuple[Any, list[list[int]]]:
    import torch

    from rlbatch.batching import MicroBatch

    rows = max(1, tokens // SEQ_LEN)
    length = min(tokens, SEQ_LEN)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(rows)]
    mb = MicroBatch(tuple(range(rows)), (length,) * rows, length, rows * length, rows * length)
    return mb, seqs


def train_pass(model: Any, mb: Any, seqs: list[list[int]], prompt: int, score: bool) -> None:
    import torch

    from rlbatch.batching import PassPlan, PlanStats, RankPlan
    from rlbatch.engine import schedule
    from rlbatch.grpo.loss import GRPOBatch, LossSettings, grpo_loss

    rows, width = mb.num_rows, mb.padded_len
    tokens = torch.tensor(seqs)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    if score:
        mask[:, prompt - 1 : width - 1] = True
    labels = torch.zeros(rows, width, dtype=torch.long)
    labels[:, :-1] = tokens[:, 1:]
    batch = GRPOBatch(
        labels=labels,
        loss_mask=mask,
        seq_index=(torch.arange(rows)[:, None] * mask).contiguous(),
        old_logps=torch.full((rows, width), -12.0),
        advantages=torch.linspace(-1, 1, rows),
        tokens=tokens,
        micro_batch=mb,
    ).to(schedule.default_device())
    stats = PlanStats(1, 1.0, 1.0, 1.0, 1.0, 0, 0.0, 0, 0)
    plan = PassPlan("train", 1, 1, 1, (RankPlan(0, (mb,)),), stats)

    def loss_fn(output: Any, b: GRPOBatch) -> tuple:
        return grpo_loss(output, b, LossSettings()).numerator, {}

    schedule.run_grpo_pass(model, plan.ranks[0], plan, [batch], loss_fn)


def logprob_pass(model: Any, mb: Any, seqs: list[list[int]], prompt: int, score: bool) -> None:
    from rlbatch.batching import PassPlan, PlanStats, RankPlan
    from rlbatch.engine.logprobs import compute_logprobs

    stats = PlanStats(1, 1.0, 1.0, 1.0, 1.0, 0, 0.0, 0, 0)
    plan = PassPlan("infer", 1, 1, 1, (RankPlan(0, (mb,)),), stats)
    first = [prompt - 1 if score else len(s) for s in seqs]
    compute_logprobs(model, seqs, plan, score_from=first)
