"""Rollout: generation on the Megatron policy behind a small engine interface.

``RolloutEngine`` is the contract (an external inference server can implement it later);
``MegatronRolloutEngine`` generates on the policy's own megatron-core GPTModel chunks.

Decoding (both paths produce the same samples for the same seed up to float rounding):
- ``kv_cache=True``: megatron-core's ``StaticInferenceContext`` (KV cache): one prefill
  forward over the shortest prompt's length, then one token per forward.
- ``kv_cache=False``: every step recomputes a full causal forward over the prefix.
Prompts of different lengths share a batch without padding: position t of row i holds its
prompt token while t < len(prompt_i) (the sampled token is discarded), a generated token after.

Behaviour logprobs: ``log_softmax(logits / temperature)[token]`` over the **full vocabulary**
(before top-k / top-p truncation), the convention of TRL and verl. At the default temperature
1.0 it equals the training forward's logprob exactly; with temperature != 1 the training
logprob pass must divide its logits by the same temperature to compare like with like.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from rlbatch import distributed
from rlbatch.config.schema import RolloutBackend, RolloutConfig, RunConfig
from rlbatch.grpo.types import Prompt, Sample


class RolloutEngine(Protocol):
    """What the GRPO step needs from a generator."""

    def generate(
        self, prompts: Sequence[Prompt], num_generations: int, policy_version: int, seed: int
    ) -> list[Sample]:
        """num_generations completions per prompt, contiguous (rows g*G .. g*G+G-1 are prompt
        g's group, group_id = g); every Sample carries response tokens (EOS included when
        produced), behaviour logprobs and `policy_version`. Same seed, same samples."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    eos_id: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    pad_id: int = 0

    @classmethod
    def from_config(cls, cfg: RolloutConfig, eos_id: int, pad_id: int) -> SamplingParams:
        params = cls(cfg.max_new_tokens, eos_id, cfg.temperature, cfg.top_p, cfg.top_k, pad_id)
        errors = params.errors()
        if errors:
            raise ValueError("invalid rollout config:\n  " + "\n  ".join(errors))
        return params

    def errors(self) -> list[str]:
        out = []
        if self.max_new_tokens < 1:
            out.append(f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.temperature > 0:
            out.append(
                f"rollout.temperature={self.temperature} must be > 0 (use rollout.top_k=1 for"
                " greedy decoding)"
            )
        if not 0 < self.top_p <= 1:
            out.append(f"rollout.top_p={self.top_p} must be in (0, 1] (1 disables it)")
        if self.top_k < 0:
            out.append(f"rollout.top_k={self.top_k} must be >= 0 (0 disables it)")
        return out


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits [B, V] with everything outside the top-k / nucleus set at -inf: top-k first,
    then the smallest set of the most likely remaining tokens whose (renormalized) mass reaches
    top_p (Hugging Face's order)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top one always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits [B, V]: (tokens [B], behaviour logprobs [B])."""
    scaled = logits.float() / params.temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator)  # [B, 1]
    return tokens[:, 0], logp_all.gather(-1, tokens)[:, 0]


# ------------------------------------------------------------------------------ forwards
def _causal_mask(batch: int, q_len: int, k_len: int) -> torch.Tensor:
    """Megatron's boolean mask [B, 1, q, k], True = masked; queries are the last q positions."""
    q = torch.arange(k_len - q_len, k_len)[:, None]
    k = torch.arange(k_len)[None, :]
    return (k > q)[None, None].expand(batch, 1, q_len, k_len)


class _Forward:
    """Logits at position end - 1 of tokens[:, :end], through this rank's model chunks.

    pp = 1: one chunk, logits returned. pp > 1: virtual stage v * pp + r runs chunk v on
    pipeline rank r; hidden states [S, B, H] go to the next stage by point-to-point send
    (one forward-only pass through the pipeline per decoding step); only the last stage
    returns logits, the others None. One StaticInferenceContext per chunk with kv_cache.
    """

    def __init__(self, chunks: list[Any], batch: int, max_len: int, kv_cache: bool) -> None:
        self.chunks = chunks
        self.pp = distributed.pp_size()
        self.device = _device_of(chunks[0])
        self.contexts: list[Any] = [None] * len(chunks)
        if kv_cache:
            from megatron.core.inference.contexts import StaticInferenceContext

            self.contexts = [StaticInferenceContext(batch, max_len) for _ in chunks]

    def __call__(self, tokens: torch.Tensor, start: int, end: int) -> Optional[torch.Tensor]:
        batch = tokens.shape[0]
        if self.contexts[0] is None:
            start = 0  # recompute the whole prefix
        positions = torch.arange(start, end, device=self.device)[None].expand(batch, end - start)
        mask = _causal_mask(batch, end - start, end).to(self.device)
        inputs = tokens[:, start:end].to(self.device)
        logits = None
        for v, (chunk, ctx) in enumerate(zip(self.chunks, self.contexts, strict=True)):
            stage, last_stage = _stage_of(v, self.pp), len(self.chunks) * self.pp - 1
            if stage > 0:
                _set_input_tensor(chunk, _recv_hidden(chunk, end - start, batch, self.device))
            if ctx is not None:
                assert start == ctx.sequence_len_offset, "KV cache steps must be consecutive"
                if start > 0:
                    ctx.enable_decode_mode()
            out = chunk(
                inputs,
                positions,
                mask,
                inference_context=ctx,
                runtime_gather_output=True,
            )  # last stage: logits [B, S or 1, V]; other stages: hidden [S, B, H]
            if ctx is not None:
                ctx.sequence_len_offset = end
            if stage == last_stage:
                logits = out[:, -1, :].float().cpu()  # sampling runs on the CPU generator
            else:
                _send_hidden(out)
        return logits


# Point-to-point hidden states between pipeline stages for generation (the sampled tokens go
# back to every stage by rlbatch.distributed.broadcast_from_last_stage).
def _stage_of(chunk_index: int, pp: int) -> int:
    if pp == 1:
        return chunk_index
    from megatron.core import parallel_state as ps

    return chunk_index * pp + ps.get_pipeline_model_parallel_rank()


def _set_input_tensor(chunk: Any, hidden: torch.Tensor) -> None:
    from megatron.core.utils import get_attr_wrapped_model

    get_attr_wrapped_model(chunk, "set_input_tensor")(hidden)


def _config_of(chunk: Any) -> Any:
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(chunk, "config")


def _device_of(chunk: Any) -> torch.device:
    return next(chunk.parameters()).device


def _recv_hidden(chunk: Any, seq: int, batch: int, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    config = _config_of(chunk)
    dtype = config.pipeline_dtype or config.params_dtype
    hidden = torch.empty(seq, batch, config.hidden_size, dtype=dtype, device=device)
    dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
    return hidden


def _send_hidden(hidden: torch.Tensor) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.send(hidden.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())


# ------------------------------------------------------------------------------ decoding
@dataclass
class Decoded:
    """Per row: response tokens (EOS included when produced), their logprobs, truncation."""

    response_ids: list[list[int]]
    logps: list[list[float]]
    truncated: list[bool]


def decode(
    forward: Any,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    generator: torch.Generator,
) -> Decoded:
    """The decoding loop shared by the KV-cache and recompute paths.

    `forward(tokens [B, T], start, end) -> logits [B, V]` at position end - 1.
    """
    lens = torch.tensor([len(p) for p in prompt_ids])
    if int(lens.min()) < 1:
        raise ValueError("a prompt has no tokens: every prompt needs >= 1 token (e.g. a BOS)")
    batch, p_min = len(prompt_ids), int(lens.min())
    pipelined = getattr(forward, "pp", 1) > 1
    total = int(lens.max()) + params.max_new_tokens
    tokens = torch.full((batch, total), params.pad_id, dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        tokens[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
    num_new = torch.zeros(batch, dtype=torch.long)
    done = torch.zeros(batch, dtype=torch.bool)
    hit_eos = torch.zeros(batch, dtype=torch.bool)
    logps = torch.zeros(batch, params.max_new_tokens, dtype=torch.float64)
    logits = forward(tokens, 0, p_min)
    for t in range(p_min, total):
        new_tok, new_lp = _sample_step(logits, params, generator, batch, pipelined)
        active = (t >= lens) & ~done  # rows generating at position t
        tokens[:, t] = torch.where(
            active, new_tok, torch.where(t < lens, tokens[:, t], params.pad_id)
        )
        idx = torch.nonzero(active)[:, 0]
        logps[idx, num_new[idx]] = new_lp[idx].double()
        num_new += active.long()
        eos = active & (new_tok == params.eos_id)
        hit_eos |= eos
        done |= eos | (num_new >= params.max_new_tokens)
        if bool(done.all()):
            break
        logits = forward(tokens, t, t + 1)
    return Decoded(
        response_ids=[tokens[i, lens[i] : lens[i] + num_new[i]].tolist() for i in range(batch)],
        logps=[logps[i, : num_new[i]].tolist() for i in range(batch)],
        truncated=[not bool(h) for h in hit_eos],
    )


def _sample_step(
    logits: Optional[torch.Tensor],
    params: SamplingParams,
    generator: torch.Generator,
    batch: int,
    pipelined: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample on the stage that has logits; with pp > 1 every stage gets its tokens."""
    both = None
    if logits is not None:
        tok, lp = sample_tokens(logits, params, generator)
        both = torch.stack([tok.double(), lp.double()])  # token ids < 2**53 are exact
    if pipelined:
        both = distributed.broadcast_from_last_stage(both, (2, batch), torch.float64).cpu()
    assert both is not None
    return both[0].long(), both[1]


# ------------------------------------------------------------------------------ engine
class MegatronRolloutEngine:
    """Generation on this rank's megatron-core GPTModel chunks (one per virtual pipeline
    stage; pp=1: a single model). Every pipeline rank calls generate with the same prompts and
    seed and gets the same samples.

    `chunk_size`: prompts per generation chunk (rollout.micro_batch_size); None = one chunk
    (when the LCM aggregator already chunks). Generation is per DP rank on its own prompts.
    """

    def __init__(
        self,
        model: Any,
        params: SamplingParams,
        *,
        kv_cache: bool = True,
        chunk_size: Optional[int] = None,
    ) -> None:
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.params = params
        self.kv_cache = kv_cache
        self.chunk_size = chunk_size
        self.calls: list[int] = []
        """Rows per decoding chunk, in call order (tests and benchmarks read it)."""

    def generate(
        self, prompts: Sequence[Prompt], num_generations: int, policy_version: int, seed: int
    ) -> list[Sample]:
        rows = [(g, p) for g, p in enumerate(prompts) for _ in range(num_generations)]
        size = len(rows) if self.chunk_size is None else self.chunk_size * num_generations
        samples: list[Sample] = []
        was_training = [c.training for c in self.chunks]
        for c in self.chunks:
            c.eval()  # megatron uses the inference context only outside training mode
        try:
            with torch.no_grad():
                for k, start in enumerate(range(0, len(rows), max(size, 1))):
                    chunk = rows[start : start + size]
                    samples += self._generate_chunk(chunk, policy_version, seed, k)
        finally:
            for c, mode in zip(self.chunks, was_training, strict=True):
                c.train(mode)
        return samples

    def _generate_chunk(
        self, rows: list[tuple[int, Prompt]], policy_version: int, seed: int, chunk_index: int
    ) -> list[Sample]:
        generator = torch.Generator().manual_seed((seed * 1_000_003 + chunk_index) % 2**63)
        prompt_ids = [p.prompt_ids for _, p in rows]
        max_len = max(len(p) for p in prompt_ids) + self.params.max_new_tokens
        forward = _Forward(self.chunks, len(rows), max_len, self.kv_cache)
        out = decode(forward, prompt_ids, self.params, generator)
        self.calls.append(len(rows))
        return [
            Sample(
                prompt=p,
                group_id=g,
                response_ids=out.response_ids[i],
                behaviour_logps=out.logps[i],
                truncated=out.truncated[i],
                policy_version=policy_version,
            )
            for i, (g, p) in enumerate(rows)
        ]


def as_rollout_fn(engine: RolloutEngine, policy_version: int) -> Any:
    """The LCM aggregator's rollout_fn(rows, seed) on top of a RolloutEngine: rows are already
    repeated, so each row is generated once (num_generations=1)."""

    def rollout_fn(rows: list[Prompt], seed: int) -> list[Sample]:
        return engine.generate(rows, 1, policy_version, seed)

    return rollout_fn


def _megatron_engine(cfg: RunConfig, model: Any, eos_id: int, pad_id: int, chunked: bool) -> Any:
    params = SamplingParams.from_config(cfg.rollout, eos_id=eos_id, pad_id=pad_id)
    chunk_size = cfg.rollout.micro_batch_size if chunked else None
    return MegatronRolloutEngine(
        model, params, kv_cache=cfg.rollout.kv_cache, chunk_size=chunk_size
    )


_ENGINES = {RolloutBackend.megatron: _megatron_engine}


def build_rollout_engine(
    cfg: RunConfig, model: Any, *, eos_id: int, pad_id: int, chunked: bool = True
) -> RolloutEngine:
    """The engine ``rollout.backend`` names, on this rank's policy chunks. `chunked`: split
    generate() calls by rollout.micro_batch_size (False when the LCM aggregator chunks)."""
    return _ENGINES[RolloutBackend(cfg.rollout.backend)](cfg, model, eos_id, pad_id, chunked)
