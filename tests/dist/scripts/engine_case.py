"""The engine's multi-process test case, shared by the torchrun worker (engine_worker.py) and
the single-process reference computed in tests/dist/test_engine_parallel.py.

A 4-layer tiny Qwen2 (tied embeddings) loaded from one HF directory, 18 samples of varied
lengths, 6 hand-made micro-batches (padded, packed and a filler), a train pass with the plain
next-token loss, optionally an optimizer step, and a logprob pass over an infer plan; the train
and logprob passes again with the output projection unchunked and in small chunks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch

from rlbatch.batching.plan import MicroBatch, PassPlan, PlanStats, RankPlan
from rlbatch.config.schema import BatchingMode, BatchingPassConfig, ModelConfig, RunConfig

ROUND = 4
LENGTHS = [5, 13, 9, 2, 17, 7, 11, 3, 8, 15, 6, 10, 4, 12, 1, 9, 14, 5]
MODEL = ModelConfig(num_layers=4, tie_word_embeddings=True)
CHUNK_VARIANTS = (0, 3)
"""model.logits_chunk_tokens of the extra passes: unchunked, and 3 positions per chunk (the
main passes use the default)."""


def round_up(n: int, r: int = ROUND) -> int:
    return -(-n // r) * r


def sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def _padded(samples: list[int]) -> MicroBatch:
    lens = [LENGTHS[i] for i in samples]
    w = round_up(max(lens))
    return MicroBatch(tuple(samples), tuple(lens), w, w * len(lens), sum(lens))


def _packed(samples: list[int]) -> MicroBatch:
    lens = [LENGTHS[i] for i in samples]
    w = sum(round_up(n) for n in lens)
    return MicroBatch(tuple(samples), tuple(lens), w, w, sum(lens), packed=True)


MICRO_BATCHES = [
    _padded([0, 1, 2]),
    _packed([3, 4, 5]),
    _padded([6, 7]),
    _packed([8, 9, 10, 11]),
    _padded([12, 13, 14, 15]),
    MicroBatch((), (), 8, 8, 0, filler=True),
]


def plan_of(ranks: list[list[MicroBatch]], group_size: int) -> PassPlan:
    stats = PlanStats(1, 1.0, 1.0, 1.0, 1.0, 0, 0.0, 0, 0)
    rps = tuple(RankPlan(i, tuple(m)) for i, m in enumerate(ranks))
    return PassPlan("test", len(ranks), len(ranks[0]), group_size, rps, stats)


def make_cfg(
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    dp: int = 1,
    hf_path: Optional[str] = None,
    sequence_parallel: bool = False,
    distributed_optimizer: bool = False,
) -> RunConfig:
    cfg = RunConfig()
    cfg.model = replace(MODEL, hf_path=hf_path)
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.dp = tp, pp, vpp, dp
    cfg.parallel.sequence_parallel = sequence_parallel
    cfg.parallel.use_distributed_optimizer = distributed_optimizer
    cfg.trainer.optim.lr = 1e-2
    cfg.trainer.optim.clip_grad = 0.5
    cfg.trainer.max_steps = 10
    return cfg


def infer_plan(cfg: RunConfig) -> PassPlan:
    """The logprob pass's plan (the planner; megatron's interleaving rule included)."""
    from rlbatch.batching import plan_pass

    infer = BatchingPassConfig(mode=BatchingMode.packed, max_tokens=32, sequence_length_round=ROUND)
    p = cfg.parallel
    return plan_pass(
        LENGTHS, infer, dp=p.dp, pp=p.pp, vpp=p.vpp,
        microbatch_group_size=p.microbatch_group_size_per_vp_stage,
    )  # fmt: skip


def run_case(
    cfg: RunConfig,
    micro_batches: list[MicroBatch],
    *,
    dp: int = 1,
    step: bool = False,
    export_dir: Optional[str] = None,
) -> dict[str, Any]:
    """Train pass (+ optional optimizer step) and a logprob pass; gathered results on rank 0.
    ``micro_batches``: this rank's micro-batches (dp ranks pass their own share)."""
    from rlbatch.engine import hf, lm_head, logprobs, schedule
    from rlbatch.engine import model as engine_model

    seqs = sequences()
    chunks = engine_model.build_model(cfg)
    hf.load_hf_into(chunks, cfg.model.hf_path)
    if export_dir is not None:  # the split model written back in HF format (rank 0)
        hf.export_hf(chunks, cfg.model, export_dir)
    group = cfg.parallel.microbatch_group_size_per_vp_stage or cfg.parallel.pp
    plan = plan_of([micro_batches] * dp, group)

    def batch_fn(mb: MicroBatch) -> schedule.MicroBatchInputs:
        return schedule.make_inputs([seqs[i] for i in mb.samples], mb, round_to=ROUND)

    out = schedule.run_pass(chunks, plan.ranks[0], plan, batch_fn, schedule.next_token_loss)
    result: dict[str, Any] = {"losses": [float(m["loss_sum"]) for m in out]}
    config = chunks[0].config
    result["p2p"] = {
        "overlap_p2p_comm": config.overlap_p2p_comm,
        "batch_p2p_comm": config.batch_p2p_comm,
    }
    result["grads"] = _grads(chunks, cfg)
    if step:
        optimizer, scheduler = engine_model.build_optimizer(cfg, chunks)
        ok, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        result["grad_norm"] = float(grad_norm)
        result["params_after_step"] = {
            k: v.clone() for k, v in hf.gather_full(chunks, cfg.model).items()
        }
        hf.load_hf_into(chunks, cfg.model.hf_path)
        optimizer.zero_grad()  # as the trainer does before the next pass (param.grad aliases)
    lp, ent = logprobs.compute_logprobs(chunks, seqs, infer_plan(cfg), round_to=ROUND, entropy=True)
    result["logprobs"], result["entropy"] = lp, ent
    result["by_chunk"] = {}
    for tokens in CHUNK_VARIANTS:  # the same passes, unchunked and in many small chunks
        lm_head.set_logits_chunk_tokens(chunks, tokens)
        out = schedule.run_pass(chunks, plan.ranks[0], plan, batch_fn, schedule.next_token_loss)
        lp, ent = logprobs.compute_logprobs(
            chunks, seqs, infer_plan(cfg), round_to=ROUND, entropy=True
        )
        result["by_chunk"][tokens] = {
            "losses": [float(m["loss_sum"]) for m in out],
            "grads": _grads(chunks, cfg),
            "logprobs": lp,
            "entropy": ent,
        }
    lm_head.set_logits_chunk_tokens(chunks, cfg.model.logits_chunk_tokens)
    result["rollout"] = generate(chunks)
    result["sequence_parallel"] = [
        bool(config.sequence_parallel),
        all(getattr(p, "sequence_parallel", False) for n, p in chunks[0].named_parameters()
            if "layernorm" in n),
    ]  # fmt: skip
    return result


def _grads(chunks: list[Any], cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Copies of the full gradients (gather_full may hand out the live grad buffers, which the
    optimizer's clipping and the next pass overwrite)."""
    from rlbatch.engine import hf

    return {k: v.clone() for k, v in hf.gather_full(chunks, cfg.model, grads=True).items()}


def generate(chunks: list[Any]) -> list[tuple[list[int], list[float]]]:
    """Sampled completions (seeded) of three prompts, with sequence parallelism switched off
    for generation as the trainer does."""
    from rlbatch.engine.model import sequence_parallel_off
    from rlbatch.grpo.types import Prompt
    from rlbatch.rollout.engines.builtin import MegatronRolloutEngine, SamplingParams

    prompts = [Prompt(index=i, prompt_ids=tuple(seq[:5]), answer="") for i, seq in
               enumerate(sequences()[:3])]  # fmt: skip
    engine = MegatronRolloutEngine(chunks, SamplingParams(max_new_tokens=6, eos_id=-1, top_k=20))
    with sequence_parallel_off(chunks):
        samples = engine.generate(prompts, 2, 0, seed=3)
    return [(s.response_ids, s.behaviour_logps) for s in samples]
