"""Worker of tests/dist/test_normalization_invariance.py (run under torchrun, gloo, CPU).

Real megatron-core pieces: GPTModel (local spec), Megatron DDP, get_forward_backward_func(),
finalize_model_grads. For every (dtype, calculate_per_token_loss, normalization mode,
loss_agg_mode, split) it runs one step's forward/backward through rlbatch's GRPO loss and
normalizer, applies the end-of-step correction, and saves the flat DP-reduced gradient (rank 0)
with the step metrics and how many micro-batches were prepared at the first forward.

The same global samples are cut into ``k`` micro-batches per rank of DIFFERENT sizes; with
dp=2 the 2k groups alternate over the ranks. Usage: normalization_invariance.py OUT.pt
"""

from __future__ import annotations

import math
import os
import random
import sys
from functools import partial

import torch

from rlbatch.engine.cpu_compat import install

install()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from rlbatch import distributed  # noqa: E402
from rlbatch.batching.plan import MicroBatch  # noqa: E402
from rlbatch.config.schema import LossAggMode, NormalizationMode  # noqa: E402
from rlbatch.grpo.loss import (  # noqa: E402
    STAT_INDEX,
    LossSettings,
    build_grpo_batch,
    grpo_loss,
    loss_from_logps,
)
from rlbatch.grpo.normalization import (  # noqa: E402
    MegatronScaling,
    Normalizer,
    scale_gradients,
)
from rlbatch.grpo.types import Prompt, Sample  # noqa: E402

VOCAB, ROUND, NUM_SAMPLES = 64, 4, 28
SPLITS = {  # micro-batch sizes over the global sample list: 1, 3, 7 per rank on dp 1 and 2
    (1, 1): [28],
    (1, 3): [13, 3, 12],
    (1, 7): [2, 7, 3, 6, 1, 5, 4],
    (2, 1): [15, 13],
    (2, 3): [9, 3, 6, 2, 1, 7],
    (2, 7): [1, 4, 2, 3, 3, 1, 2, 1, 4, 1, 2, 1, 2, 1],
}
UNIFORM_SPLITS = {(1, 1): [28], (1, 7): [4] * 7, (2, 1): [14, 14], (2, 7): [2] * 14}


def make_samples(uniform: bool) -> list[Sample]:
    rng = random.Random(11 if uniform else 5)
    out = []
    for i in range(NUM_SAMPLES):
        p_len, r_len = (4, 5) if uniform else (rng.randint(2, 6), rng.randint(1, 12))
        beh = [-rng.uniform(2.0, 5.0) for _ in range(r_len)]
        out.append(
            Sample(
                prompt=Prompt(i, tuple(rng.randrange(VOCAB) for _ in range(p_len)), ""),
                group_id=i // 4,
                response_ids=[rng.randrange(VOCAB) for _ in range(r_len)],
                behaviour_logps=beh,
                truncated=(i % 6 == 5) and not uniform,
                policy_version=0,
                advantage=rng.uniform(-1.5, 1.5),
                old_logps=[b + rng.uniform(-0.2, 0.2) for b in beh],
                ref_logps=[b + rng.uniform(-0.2, 0.2) for b in beh],
            )
        )
    return out


def build_model(
    dtype: torch.dtype, per_token: bool, pre: bool = True, post: bool = True, tied: bool = True
) -> DistributedDataParallel:
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_qkv_bias=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=per_token,
        init_method_std=0.2,
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
        pre_process=pre,
        post_process=post,
    ).to(dtype)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False)
    return DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)


def rank_groups(sizes: list[int], dp: int, rank: int) -> list[list[int]]:
    groups, start = [], 0
    for s in sizes:
        groups.append(list(range(start, start + s)))
        start += s
    k = len(groups) // dp
    return [groups[i * dp + rank] for i in range(k)]


def run_step(model, samples, groups, mode, settings, dtype) -> dict:
    """One step: schedule -> finalize_model_grads -> bundled reduce -> c/D correction."""
    model.zero_grad_buffer()
    m = len(groups)
    per_token = model.config.calculate_per_token_loss
    scaling = MegatronScaling(per_token, m, dp_cp_size=distributed.dp_size())
    norm = Normalizer(  # the real reductions: DP sums, last-stage broadcast of the bundle
        mode=mode,
        settings=settings,
        scaling=scaling,
        constant=53.0,
        reduce_dp=distributed.reduce_dp,
        reduce_step=distributed.reduce_step,
    )
    first = []

    def prepare(i: int):
        idx = groups[i]
        lengths = tuple(samples[j].length for j in idx)
        width = max(-(-n // ROUND) * ROUND for n in lengths)
        mb = MicroBatch(tuple(idx), lengths, width, width * len(idx), sum(lengths))
        batch, tokens = build_grpo_batch(
            [samples[j] for j in idx],
            mb,
            round_to=ROUND,
            mask_truncated=True,
            dtype=dtype,
        )
        batch.tokens = tokens
        return batch

    def loss_func(batch, output):
        terms = grpo_loss(output, batch, settings)
        return norm.loss_for_backward(terms, batch), scaling.count_for_megatron(), {}

    def forward_step(data_iterator, model_chunk):
        batch = next(data_iterator)
        if not first:
            first.append(norm.num_prepared)
        rows, width = batch.tokens.shape
        pos = torch.arange(width).unsqueeze(0).expand(rows, width)
        causal = torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)
        mask = causal.view(1, 1, width, width).expand(rows, 1, width, width)
        return model_chunk(batch.tokens, pos, mask), partial(loss_func, batch)

    model.config.finalize_model_grads_func = None  # called below, without a token count
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=norm.iterate(prepare, m),
        model=[model],
        num_microbatches=m,
        seq_length=64,
        micro_batch_size=1,
        forward_only=False,
    )
    finalize_model_grads([model], None)
    result = norm.finish()
    scale_gradients([model], result.grad_multiplier)
    grad = torch.cat([p.main_grad.detach().flatten().double() for p in model.parameters()])
    return {"grad": grad, "metrics": result.metrics, "prepared_at_first_forward": first[0]}


def reference_grad(model, samples, settings) -> torch.Tensor:
    """The global objective written directly (no rlbatch loss / normalization code): one
    sample per forward, log_softmax, per-token clipped surrogate + beta * k3, aggregated by
    loss_agg_mode; torch.autograd.grad, so Megatron DDP's hooks and buffers are not involved."""
    st, per_seq, n_tok = settings, [], 0
    for s in samples:
        if s.truncated:  # mask_truncated_completions
            continue
        ids = torch.tensor([s.input_ids])
        width = ids.shape[1]
        causal = torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)
        logits = model(ids, torch.arange(width).unsqueeze(0), causal.view(1, 1, width, width))
        logp_all = torch.log_softmax(logits[0].double(), dim=-1)
        p, terms = len(s.prompt.prompt_ids), []
        for k, tok in enumerate(s.response_ids):
            lp = logp_all[p - 1 + k, tok]
            r, a = torch.exp(lp - s.old_logps[k]), s.advantage
            pg = torch.maximum(-a * r, -a * r.clamp(1 - st.epsilon_low, 1 + st.epsilon_high))
            # the old pass ran: the truncated weight pi_old / pi_behaviour multiplies the surrogate
            w = min(math.exp(s.old_logps[k] - s.behaviour_logps[k]), st.rollout_correction_cap)
            pg = w * pg
            d = s.ref_logps[k] - lp
            terms.append(pg + st.beta * (torch.exp(d) - d - 1))
        per_seq.append(torch.stack(terms))
        n_tok += len(terms)
    agg = st.loss_agg_mode
    if agg == LossAggMode.token_mean:
        loss = sum(t.sum() for t in per_seq) / n_tok
    elif agg == LossAggMode.seq_mean_token_mean:
        loss = sum(t.mean() for t in per_seq) / len(per_seq)
    elif agg == LossAggMode.seq_mean_token_sum:
        loss = sum(t.sum() for t in per_seq) / len(per_seq)
    else:
        loss = sum(t.sum() / st.max_response_len for t in per_seq) / len(per_seq)
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params)
    return torch.cat([g.flatten().double() for g in grads]), loss.item()


def run_pp2(samples: list[Sample]) -> dict:
    """pp=2 (1F1B, one layer per stage): every mode and split gives both stages' gradients;
    rank 0 keeps [stage 0 grads, stage 1 grads] per case."""
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    model = build_model(torch.float32, True, pre=first, post=last, tied=False)
    out = {}
    for mode in EXACT_MODES:
        for agg in (LossAggMode.token_mean, LossAggMode.seq_mean_token_mean):
            st = LossSettings(beta=0.05, loss_agg_mode=agg, max_response_len=12)
            for k in (1, 3, 7):
                groups = rank_groups(SPLITS[(1, k)], 1, 0)
                res = run_step(model, samples, groups, mode, st, torch.float32)
                stages = distributed.all_gather_object(res["grad"])
                out[("pp2", mode.value, agg.value, k)] = {
                    "grad": torch.cat(stages),
                    "loss": res["metrics"]["loss"],
                }
    return out


def run_tp2(samples: list[Sample]) -> dict:
    """tp=2: the GRPO loss on vocab-parallel logits (each rank holds half the vocabulary) vs
    the same loss on the full logits computed locally (tp code paths bypassed); with the
    entropy bonus, whose gradient crosses the shards (megatron's autograd-aware all-reduce)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    mb = MicroBatch(tuple(range(6)), tuple(s.length for s in samples[:6]), 20, 120, 0)
    batch, _ = build_grpo_batch(samples[:6], mb, round_to=ROUND)
    batch.ref_logps = batch.old_logps + 0.05
    st = LossSettings(beta=0.05, loss_agg_mode=LossAggMode.seq_mean_token_mean, entropy_coef=0.05)
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(6, 20, VOCAB, generator=g) * 3).requires_grad_(True)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    half = VOCAB // 2
    shard = full.detach()[..., tp_rank * half : (tp_rank + 1) * half].clone().requires_grad_(True)
    terms = grpo_loss(shard, batch, st)  # vocab-parallel: megatron CE + tp entropy
    terms.numerator.backward()
    shard_grads = gather_from_tensor_model_parallel_region(shard.grad)
    # reference: the full logits on one rank, plain log_softmax (tp paths not taken)
    logp = torch.log_softmax(full, -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    mask = batch.loss_mask
    per_token = -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)[mask]
    entropy = per_token.detach().sum()
    ref = loss_from_logps(logp[mask], batch, st, entropy=per_token)
    ref.numerator.backward()
    return {
        ("tp2", tp_rank): {
            "numerator": (terms.numerator.item(), ref.numerator.item()),
            "entropy": (float(terms.stats[STAT_INDEX["entropy"]]), entropy.item()),
            "grad": (shard_grads, full.grad),
        }
    }


EXACT_MODES = (NormalizationMode.eager_global, NormalizationMode.deferred_global)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    dp, rank = dist.get_world_size(), dist.get_rank()
    ragged, uniform = make_samples(False), make_samples(True)
    out: dict = {}
    cases = [
        (torch.float32, True, list(NormalizationMode), list(LossAggMode)),
        (
            torch.float32,
            False,
            [NormalizationMode.deferred_global, NormalizationMode.eager_global],
            [LossAggMode.token_mean, LossAggMode.seq_mean_token_mean],
        ),
        (
            torch.float64,
            True,
            [NormalizationMode.eager_global, NormalizationMode.deferred_global],
            list(LossAggMode),
        ),
    ]
    for dtype, per_token, modes, aggs in cases:
        model = build_model(dtype, per_token)
        for mode in modes:
            for agg in aggs:
                st = LossSettings(beta=0.05, loss_agg_mode=agg, max_response_len=12)
                if dp == 1 and (str(dtype), agg.value) not in out.get("reference", {}):
                    grad, loss = reference_grad(model, ragged, st)
                    out.setdefault("reference", {})[(str(dtype), agg.value)] = (grad, loss)
                for k in (1, 3, 7):
                    groups = rank_groups(SPLITS[(dp, k)], dp, rank)
                    key = (str(dtype), per_token, mode.value, agg.value, k)
                    out[key] = run_step(model, ragged, groups, mode, st, dtype)
        if dtype == torch.float32 and per_token:  # per_micro_batch on uniform micro-batches
            for mode in (NormalizationMode.eager_global, NormalizationMode.per_micro_batch):
                st = LossSettings(beta=0.05, loss_agg_mode=LossAggMode.token_mean)
                for k in (1, 7):
                    groups = rank_groups(UNIFORM_SPLITS[(dp, k)], dp, rank)
                    key = ("uniform", mode.value, k)
                    out[key] = run_step(model, uniform, groups, mode, st, dtype)
    if dp == 2:  # the same 2 processes as pp=2 (dp=1): non-last stages must learn D
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 2)
        out.update(run_pp2(ragged))
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(2, 1)
        out.update(run_tp2(ragged))
    if rank == 0:
        torch.save(out, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
