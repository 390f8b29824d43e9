"""Sampling of the built-in rollout engine: parameters, top-k / top-p filtering and the keyed
exponential race (a row's samples depend only on the seed, its row index and token index).

Behaviour logprobs: ``log_softmax(logits / temperature)[token]`` over the full vocabulary
(before top-k / top-p truncation), the convention of TRL and verl.
"""

from __future__ import annotations

import math
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

    @classmethod
    def from_config(
        cls,
        cfg: RolloutConfig,
        eos_id: int,
        pad_id: int,
        debug: Optional[DebugConfig] = None,
    ) -> SamplingParams:
        """`debug`: the run's debug group, whose response-length workload caps each row
        (training rollouts; None = no caps, as evaluation samples)."""
        params = cls(cfg.max_new_tokens, eos_id, cfg.temperature, cfg.top_p, cfg.top_k, pad_id)
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
# Sampling noise is a hash of (seed, row, token index, vocabulary id), not a generator's
# stream: a row's sample does not depend on which rows share its batch, the order rows enter
# a continuous batch, the rollout chunk size or the decoding path (lean, megatron, pipeline).
_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**31: products of 32-bit values stay inside int64


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


def exponential_noise(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) variates [n, V] (float64) for rows with these keys at these token indices."""
    device = keys.device
    state = _mix(keys ^ _mix(steps.to(device) & _M32))  # [n]
    ids = _mix(torch.arange(vocab, device=device, dtype=torch.long) + 0x632BE5AB)  # [V]
    bits = _mix(state[:, None] ^ ids[None])  # [n, V]
    return -torch.log((bits.double() + 0.5) / 2.0**32)


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
    logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits [n, V]: (tokens [n], behaviour logprobs [n]).

    The exponential race argmax(log p - log E), E ~ Exp(1), draws exactly from p (the
    tempered, top-k / top-p filtered softmax) without normalising it; the logprob is the
    tempered full-vocabulary one of the chosen token: logit / T - logsumexp(logits / T).
    """
    scaled = logits.float() / params.temperature
    filtered = filter_logits(scaled, params.top_k, params.top_p)
    noise = exponential_noise(keys, steps, scaled.shape[-1])
    tokens = torch.argmax(filtered.double() - torch.log(noise), dim=-1)  # [n]
    chosen = scaled.gather(-1, tokens[:, None])[:, 0]
    return tokens, chosen - torch.logsumexp(scaled, dim=-1)
