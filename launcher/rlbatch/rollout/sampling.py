"""Sampling of the built-in rollout engine: parameters, top-k / top-p filtering and the keyed
inverse-CDF draw (a row's samples depend only on the seed, its row index and token index).

Behaviour logprobs: ``log_softmax(logits / temperature)[token]`` over the full vocabulary
(before top-k / top-p truncation), the convention of TRL and verl.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional

import torch

from rlbatch.config.schema import DebugConfig, RolloutConfig


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    eos_id: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    pad_id: int = 0
    length_median: int = 0
    """debug.response_length_median: > 0 gives every row its own length cap drawn from a
    lognormal (:func:`length_caps`); 0 = every row may use max_new_tokens."""
    length_sigma: float = 1.0
    """debug.response_length_sigma: the lognormal's sigma (log scale)."""
    extra_eos_ids: tuple[int, ...] = ()
    """Ids that also end a response besides eos_id (the tokenizer's ``eos_ids[1:]``)."""

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a response (eos_id first)."""
        return (self.eos_id, *self.extra_eos_ids)

    def ends(self, token: int) -> bool:
        """The token ends a response (an EOS of the run)."""
        return token == self.eos_id or token in self.extra_eos_ids

    @classmethod
    def from_config(
        cls,
        cfg: RolloutConfig,
        eos_id: int,
        pad_id: int,
        debug: Optional[DebugConfig] = None,
        *,
        extra_eos_ids: Sequence[int] = (),
    ) -> SamplingParams:
        """`debug`: the run's debug group, whose response-length workload caps each row
        (training rollouts; None = no caps, as evaluation samples). `extra_eos_ids`: the other
        ids that end a response (the tokenizer's ``eos_ids`` after ``eos_id``)."""
        params = cls(cfg.max_new_tokens, eos_id, cfg.temperature, cfg.top_p, cfg.top_k, pad_id)
        params = replace(params, extra_eos_ids=tuple(i for i in extra_eos_ids if i != eos_id))
        if debug is not None:
            params = replace(
                params,
                length_median=debug.response_length_median,
                length_sigma=debug.response_length_sigma,
            )
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
        if not 0 <= self.length_median <= self.max_new_tokens:
            out.append(
                f"debug.response_length_median={self.length_median} must be in"
                f" [0, rollout.max_new_tokens={self.max_new_tokens}] (0 disables it)"
            )
        if not self.length_sigma > 0:
            out.append(f"debug.response_length_sigma={self.length_sigma} must be > 0")
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


# ------------------------------------------------------------------------------ sampling
# Sampling noise is a hash of (seed, row, token index), not a generator's stream: a row's
# sample does not depend on which rows share its batch, the order rows enter a continuous
# batch, the rollout chunk size or the decoding path (lean, megatron, pipeline).
_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**31: products of 32-bit values stay inside int64
_HIGH_TAG, _LOW_TAG = 0x632BE5AB, 0x2545F491


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash, elementwise on int64 tensors holding values in [0, 2**32)."""
    for _ in range(3):
        x = x ^ (x >> 16)
        x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def row_keys(seed: int, num_rows: int) -> torch.Tensor:
    """One sampling key per row [R] (int64 in [0, 2**32)) from the seed and the row index."""
    s = _mix(torch.tensor([seed & _M32, (seed >> 32) & _M32], dtype=torch.long))
    base = _mix(s[0:1] ^ _mix(s[1:2] + 0x9E3779B9 & _M32))
    return _mix(base ^ torch.arange(num_rows, dtype=torch.long))


def keyed_uniform(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row [n] (float64, 53 random bits) for rows with these keys at
    these token indices: two 32-bit hashes of (key, token index)."""
    state = _mix(keys ^ _mix(steps.to(keys.device) & _M32))  # [n]
    high = _mix(state ^ _HIGH_TAG) >> 5  # 27 bits
    low = _mix(state ^ _LOW_TAG) >> 6  # 26 bits
    return ((high << 26) | low).double() / 2.0**53  # int64 -> float64: all 53 bits exact


def uniform_table(keys: torch.Tensor, num_steps: int) -> torch.Tensor:
    """[R, num_steps] float64: ``keyed_uniform`` of every row at token indices 0..num_steps-1,
    computed at once (the same values, elementwise), so a decoding loop draws its step's
    uniforms with one gather instead of a few dozen small hash ops per token."""
    steps = torch.arange(num_steps, dtype=torch.long, device=keys.device)
    out = torch.empty(len(keys), num_steps, dtype=torch.float64, device=keys.device)
    per_chunk = max(1, (1 << 20) // max(1, num_steps))  # bounds the hash's int64 temporaries
    for start in range(0, len(keys), per_chunk):
        rows = keys[start : start + per_chunk, None].expand(-1, num_steps)
        out[start : start + per_chunk] = keyed_uniform(rows, steps.expand_as(rows))
    return out


_LENGTH_TAG = 0x1E57A11


def length_caps(keys: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Per-row token caps [n] (int64) for rows with these sampling keys.

    Off (``params.length_median == 0``): ``max_new_tokens`` for every row. On: a long-tailed
    workload for benchmarks and tests on a model that seldom samples EOS (a random-init one):
    row i stops after ``clamp(round(median * exp(sigma * z_i)), 1, max_new_tokens)`` tokens,
    z_i ~ N(0, 1) drawn from the row's key, so a row's cap does not depend on its batch, slot or
    the decoding path. A row that reaches its cap ends like an EOS (not truncated); only
    ``max_new_tokens`` itself truncates.
    """
    full = torch.full(keys.shape, params.max_new_tokens, dtype=torch.long, device=keys.device)
    if params.length_median <= 0:
        return full
    bits = _mix(keys.long() ^ _LENGTH_TAG)
    uniform = (bits.double() + 0.5) / 2.0**32
    z = math.sqrt(2.0) * torch.erfinv(2.0 * uniform - 1.0)
    caps = torch.round(params.length_median * torch.exp(params.length_sigma * z)).long()
    return caps.clamp(1, params.max_new_tokens)


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    keys: torch.Tensor,
    steps: torch.Tensor,
    uniform: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits [n, V]: (tokens [n], behaviour logprobs [n]).

    Inverse CDF with one keyed uniform u per row (:func:`keyed_uniform`): the token is the
    first vocabulary index whose running sum of the tempered, top-k / top-p filtered
    probabilities exceeds u (an exact draw from them). The running sum is of the unnormalised
    exp(x - max) in float64, so u is scaled by its total rather than every entry divided;
    filtered-out entries add 0 and are never chosen. The logprob is the tempered
    full-vocabulary one of the chosen token: logit / T - logsumexp(logits / T).
    ``uniform``: the rows' keyed uniforms [n] when already drawn (:func:`uniform_table`).
    """
    scaled = logits.float()
    if params.temperature != 1.0:  # x / 1.0 == x: no pass over [n, V] for nothing
        scaled = scaled / params.temperature
    filtered = filter_logits(scaled, params.top_k, params.top_p)
    top = scaled.amax(dim=-1, keepdim=True)  # the filters always keep the row's maximum
    weights = torch.exp(filtered - top)  # [n, V]: 0 where filtered out, 1 at the maximum
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)  # [n, V], nondecreasing
    total = cdf[:, -1:]
    if uniform is None:
        uniform = keyed_uniform(keys, steps)
    target = uniform[:, None].to(cdf.device) * total
    # u * total < total unless it rounds up: keep the target inside the last kept token's step
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True)[:, 0]  # first index with cdf > target
    chosen = scaled.gather(-1, tokens[:, None])[:, 0]
    if filtered is scaled:  # no filter: the running sum's total is the normaliser
        log_norm = (top.double() + torch.log(total))[:, 0]
    else:
        log_norm = torch.logsumexp(scaled, dim=-1)
    return tokens, (chosen - log_norm).float()
