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

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from rlbatch import distributed
from rlbatch.config.schema import RolloutBackend, RunConfig
from rlbatch.grpo.types import Prompt, Sample, group_rows
from rlbatch.rollout.protocol import DecodedRow, row_samples
from rlbatch.rollout.sampling import (  # noqa: F401  (re-exported: the rollout's vocabulary)
    SamplingParams,
    filter_logits,
    keyed_uniform,
    length_caps,
    row_keys,
    sample_tokens,
    uniform_table,
)


class RolloutEngine(Protocol):
    """What the GRPO step needs from a generator."""

    def generate(
        self, prompts: Sequence[Prompt], num_generations: int, policy_version: int, seed: int
    ) -> list[Sample]:
        """num_generations completions per prompt, contiguous (rows g*G .. g*G+G-1 are prompt
        g's group, group_id = g); every Sample carries response tokens (EOS included when
        produced), behaviour logprobs and `policy_version`. Same seed, same samples."""
        ...


# ------------------------------------------------------------------------------ decoding
@dataclass
class Decoded:
    """Per row: response tokens (EOS included when produced), their logprobs, truncation."""

    response_ids: list[list[int]]
    logps: list[list[float]]
    truncated: list[bool]
    routing: Optional[list[Any]] = None
    """MoE with routing recorded: per row, prompt and response, rlbatch.engine.routing's
    ``[length, num_moe_layers, k]`` array."""

    def rows(self) -> list[DecodedRow]:
        """Each row's completion in the rollout protocol's form."""
        routing = self.routing or [None] * len(self.response_ids)
        return [
            DecodedRow(t, lp, tr, r)
            for t, lp, tr, r in zip(
                self.response_ids, self.logps, self.truncated, routing, strict=True
            )
        ]


@dataclass
class DecodeStats:
    """Decode-slot occupancy: every decode step (one sampled token per active row) adds its
    active rows to ``busy_slot_steps`` and the decoding batch's slots to ``slot_steps``. On a
    GPU a decode step costs about the same whatever number of its slots are busy, so
    ``occupancy`` is the share of decode work that produced tokens."""

    steps: int = 0
    busy_slot_steps: int = 0
    slot_steps: int = 0

    def add(self, busy: int, slots: int) -> None:
        self.steps += 1
        self.busy_slot_steps += busy
        self.slot_steps += slots

    @property
    def occupancy(self) -> float:
        return self.busy_slot_steps / self.slot_steps if self.slot_steps else 0.0


class _Outputs:
    """Tokens and logprobs of every row, written as they are sampled. A row ends at EOS or at
    its own cap (``length_caps``: max_new_tokens, or the row's lognormal draw when
    debug.response_length_median is set); it is truncated only when it reached max_new_tokens
    without EOS."""

    def __init__(self, params: SamplingParams, keys: torch.Tensor, device: torch.device) -> None:
        num_rows, max_new = len(keys), params.max_new_tokens
        self.tokens = torch.zeros(num_rows, max_new, dtype=torch.long, device=device)
        self.logps = torch.zeros(num_rows, max_new, dtype=torch.float64, device=device)
        self.count = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.hit_eos = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.caps = length_caps(keys, params).to(device)  # [num_rows]
        self.max_new = max_new
        self.eos_ids = torch.tensor(params.eos_ids, dtype=torch.long, device=device)
        """Every id that ends a row (the run's EOS set)."""

    def add(self, rows: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor, params: Any) -> Any:
        """Record one token for each of rows; returns the mask of rows that just finished."""
        n = self.count[rows]
        self.tokens[rows, n] = tok
        self.logps[rows, n] = lp.double()
        self.count[rows] = n + 1
        eos = torch.isin(tok, self.eos_ids.to(tok.device))
        self.hit_eos[rows] |= eos
        return eos | (n + 1 >= self.caps[rows])

    def decoded(self) -> Decoded:
        count, tokens, logps = self.count.tolist(), self.tokens.cpu(), self.logps.cpu()
        eos = self.hit_eos.tolist()
        return Decoded(
            response_ids=[tokens[i, :n].tolist() for i, n in enumerate(count)],
            logps=[logps[i, :n].tolist() for i, n in enumerate(count)],
            truncated=[not eos[i] and n >= self.max_new for i, n in enumerate(count)],
        )


def decode_continuous(
    decoder: Any,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    keys: torch.Tensor,
    num_slots: int,
    calls: list[int],
    stats: Optional[DecodeStats] = None,
) -> Decoded:
    """Continuous batching on a per-slot decoder (engine.generation.LeanDecoder): up to
    num_slots rows at once; a row leaves when it ends and the next prompt takes its slot.
    `calls` gets the number of rows of every prefill; `stats` every sampling step (its rows
    busy out of num_slots slots)."""
    # longest prompts first: long rows sit together in the first slots, so decode can attend
    # over them apart from the short ones (engine.generation.attention_parts); samples are
    # keyed by row, so the order changes no sample (beyond float rounding)
    queue = deque(sorted(range(len(prompt_ids)), key=lambda r: -len(prompt_ids[r])))
    keys = keys.to(decoder.device)
    out = _Outputs(params, keys, decoder.device)
    uniform = uniform_table(keys, params.max_new_tokens)  # [rows, max_new]: the keyed draws
    first = [queue.popleft() for _ in range(num_slots)]
    rows = torch.tensor(first, device=decoder.device)  # [S] row held by each slot
    logits = decoder.prefill(range(num_slots), [prompt_ids[r] for r in first])
    calls.append(num_slots)
    while len(rows):
        steps = out.count[rows]
        tok, lp = sample_tokens(logits, params, keys[rows], steps, uniform[rows, steps])
        finished = out.add(rows, tok, lp, params)
        if stats is not None:
            stats.add(len(rows), num_slots)
        if not bool(finished.any()):
            logits = decoder.decode(tok)
            continue
        ended = torch.nonzero(finished)[:, 0].tolist()
        refill, dropped = ended[: len(queue)], set(ended[len(queue) :])
        if dropped:
            kept = [i for i in range(len(rows)) if i not in dropped]
            index = torch.tensor(kept, dtype=torch.long, device=decoder.device)
            decoder.keep(index)
            rows, tok, logits = rows[index], tok[index], logits[index]
            refill = [kept.index(i) for i in refill]
        if not len(rows):
            break
        if len(refill) < len(rows):  # rows that go on (refilled slots compute a spare step)
            logits = decoder.decode(tok)
        if refill:
            new = [queue.popleft() for _ in refill]
            slot_index = torch.tensor(refill, device=decoder.device)
            logits[slot_index] = decoder.prefill(refill, [prompt_ids[r] for r in new])
            rows[slot_index] = torch.tensor(new, device=decoder.device)
            calls.append(len(refill))
    return out.decoded()


def decode_lockstep(
    forward: Any,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    keys: torch.Tensor,
    stats: Optional[DecodeStats] = None,
) -> Decoded:
    """All rows advance together until the last one ends (the megatron and pipeline path).

    `forward(tokens [B, T], start, end) -> logits [B, V]` at position end - 1 (None on
    pipeline stages other than the last). Prefill covers the shortest prompt; a longer prompt
    feeds its own tokens at the positions it still has (the sample drawn there is discarded).
    `stats` gets every step: the rows that sample a token out of the chunk's rows.
    """
    lens = torch.tensor([len(p) for p in prompt_ids])
    batch, p_min = len(prompt_ids), int(lens.min())
    pipelined = getattr(forward, "pp", 1) > 1
    total = int(lens.max()) + params.max_new_tokens
    tokens = torch.full((batch, total), params.pad_id, dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        tokens[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
    out = _Outputs(params, keys.cpu(), torch.device("cpu"))
    done = torch.zeros(batch, dtype=torch.bool)
    logits = forward(tokens, 0, p_min)
    t, going = p_min, True
    while True:
        going = going and t < total
        if going:
            new_tok, new_lp = _sample_step(logits, params, keys, out.count, pipelined)
            active = (t >= lens) & ~done  # rows generating at position t
            tokens[:, t] = torch.where(active, new_tok, tokens[:, t])
            idx = torch.nonzero(active)[:, 0]
            done[idx] |= out.add(idx, new_tok[idx], new_lp[idx], params)
            if stats is not None:
                stats.add(len(idx), batch)
            going = not bool(done.all())
        # MoE with expert parallelism: each forward exchanges tokens with the group's other
        # ranks, so a rank whose rows have ended runs idle forwards while any peer decodes
        if not distributed.any_in_expert_group(going):
            break
        logits = forward(tokens, t, t + 1) if going else forward.idle()
        t += 1
    decoded = out.decoded()
    if getattr(forward, "routing", None) is not None:
        lengths = [len(p) + len(r) for p, r in zip(prompt_ids, decoded.response_ids, strict=True)]
        decoded.routing = forward.row_routing(lengths)
    return decoded


def _sample_step(
    logits: Optional[torch.Tensor],
    params: SamplingParams,
    keys: torch.Tensor,
    steps: torch.Tensor,
    pipelined: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample on the stage that has logits; with pp > 1 every stage gets its tokens."""
    both = None
    if logits is not None:
        tok, lp = sample_tokens(logits, params, keys.to(logits.device), steps)
        both = torch.stack([tok.double(), lp.double()])  # token ids < 2**53 are exact
    if pipelined:
        both = distributed.broadcast_from_last_stage(both, (2, len(keys)), torch.float64)
    assert both is not None
    both = both.cpu()
    return both[0].long(), both[1]


# ------------------------------------------------------------------------------ engine
class MegatronRolloutEngine:
    """Generation on this rank's megatron-core GPTModel chunks (one per virtual pipeline
    stage; pp=1: a single model). Every pipeline rank calls generate with the same prompts and
    seed and gets the same samples.

    `chunk_size`: prompts whose rows decode at once (rollout.micro_batch_size); None = all rows
    at once (when the LCM aggregator already chunks). With the KV cache on a tp = pp = 1 model
    the rows form a continuous batch of that many slots (a finished row's slot takes the next
    row); otherwise the rows decode in lockstep chunks through megatron's forward. Both give
    the same samples. Generation is per DP rank on its own prompts.
    """

    def __init__(
        self,
        model: Any,
        params: SamplingParams,
        *,
        kv_cache: bool = True,
        chunk_size: Optional[int] = None,
        continuous: bool = True,
        driver: Any = None,
        max_total_tokens: int = 0,
        record_routing: bool = False,
    ) -> None:
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.params = params
        self.kv_cache = kv_cache
        self.chunk_size = chunk_size
        self.continuous = continuous
        """False: lockstep chunks through megatron's forward even where the continuous batch
        could run (benchmarks and parity tests compare both)."""
        self.calls: list[int] = []
        """Rows per prefill, in call order (tests and benchmarks read it)."""
        self.driver = driver
        """Multi-turn rollouts: the turn driver (rlbatch.env.driver.EnvDriver; None = single
        turn) and the longest trajectory, prompt included (env.max_total_tokens)."""
        self.max_total_tokens = max_total_tokens
        self.slot_stats: Any = None
        """Multi-turn: decode-slot occupancy of the last generate (rlbatch.rollout.multiturn)."""
        self.record_routing = record_routing
        """MoE: record every token's routing (prompt and response) into its Sample
        (rlbatch.engine.routing): the lockstep path through megatron's forward (single-turn)
        and the per-row decoder (multi-turn)."""
        self.decode_stats = DecodeStats()
        """Single-turn decode-slot occupancy, accumulated over generate() calls (a caller
        that wants it per round assigns a fresh DecodeStats())."""

    def generate(
        self, prompts: Sequence[Prompt], num_generations: int, policy_version: int, seed: int
    ) -> list[Sample]:
        from rlbatch.engine import generation
        from rlbatch.engine.pipeline_forward import PipelineForward

        rows = group_rows(prompts, num_generations)
        if not rows:
            return []
        prompt_ids = [p.prompt_ids for _, p in rows]
        size = len(rows) if self.chunk_size is None else self.chunk_size * num_generations
        size = max(1, min(size, len(rows)))
        keys = row_keys(seed, len(rows))
        if self.driver is not None:
            return self._generate_turns(rows, size, keys, policy_version)
        max_len = max(len(p) for p in prompt_ids) + self.params.max_new_tokens
        with generation.inference_mode(self.chunks):
            if (
                self.continuous
                and self.kv_cache
                and generation.lean_decoding_supported(self.chunks)
            ):
                # the lean decoder reads the weights and keeps its own tensors (nothing of it
                # reaches autograd or megatron's modules): inference mode skips autograd's
                # per-op bookkeeping on its ~100 small ops per token
                with torch.inference_mode():
                    decoder = generation.LeanDecoder(self.chunks[0], size, max_len)
                    out = decode_continuous(
                        decoder, prompt_ids, self.params, keys, size, self.calls, self.decode_stats
                    )
            else:
                out = Decoded([], [], [])
                for start in range(0, len(rows), size):
                    part = prompt_ids[start : start + size]
                    forward = PipelineForward(
                        self.chunks,
                        len(part),
                        max_len,
                        self.kv_cache,
                        record_routing=self.record_routing,
                    )
                    done = decode_lockstep(
                        forward, part, self.params, keys[start : start + size], self.decode_stats
                    )
                    self.calls.append(len(part))
                    out.response_ids += done.response_ids
                    out.logps += done.logps
                    out.truncated += done.truncated
                    if done.routing is not None:
                        out.routing = (out.routing or []) + done.routing
        return row_samples(rows, out.rows(), policy_version)

    def _generate_turns(
        self, rows: list[tuple[int, Prompt]], size: int, keys: torch.Tensor, version: int
    ) -> list[Sample]:
        """Multi-turn rollouts (rlbatch.rollout.multiturn) on the continuous-batching decoder."""
        from rlbatch.engine import generation
        from rlbatch.rollout.multiturn import SlotStats, decode_turns, episode_samples

        refusal = generation.lean_decoding_refusal(self.chunks)
        if not self.kv_cache or refusal:
            raise ValueError(
                "multi-turn rollouts (env.path) run on the built-in engine's per-row KV-cache"
                f" decoder: {refusal or 'it needs rollout.kv_cache=true'}"
            )
        prompt_ids = [p.prompt_ids for _, p in rows]
        budget = [self.max_total_tokens - len(p) for p in prompt_ids]
        self.driver.begin([p for _, p in rows])
        self.slot_stats = SlotStats()
        with generation.inference_mode(self.chunks):
            decoder = generation.LeanDecoder(
                self.chunks[0], size, self.max_total_tokens, record_routing=self.record_routing
            )
            trajs = decode_turns(
                decoder, prompt_ids, self.params, keys, size, self.driver, budget, self.slot_stats
            )
        if decoder.routing is not None:
            from rlbatch.engine import routing

            routing.clear(self.chunks)
        return episode_samples(rows, trajs, self.driver.records(), version)


def as_rollout_fn(engine: RolloutEngine, policy_version: int) -> Any:
    """The LCM aggregator's rollout_fn(rows, seed) on top of a RolloutEngine: rows are already
    repeated, so each row is generated once (num_generations=1)."""

    def rollout_fn(rows: list[Prompt], seed: int) -> list[Sample]:
        return engine.generate(rows, 1, policy_version, seed)

    return rollout_fn


def _megatron_engine(
    cfg: RunConfig, model: Any, eos_ids: tuple[int, ...], pad_id: int, chunked: bool, driver: Any
) -> Any:
    params = SamplingParams.from_config(
        cfg.rollout, eos_id=eos_ids[0], pad_id=pad_id, debug=cfg.debug, extra_eos_ids=eos_ids
    )
    chunk_size = cfg.rollout.micro_batch_size if chunked else None
    return MegatronRolloutEngine(
        model,
        params,
        kv_cache=cfg.rollout.kv_cache,
        chunk_size=chunk_size,
        driver=driver,
        max_total_tokens=cfg.env.max_total_tokens,
        record_routing=cfg.model.num_moe_experts is not None,
    )


def _dynamic_engine(
    cfg: RunConfig, model: Any, eos_ids: tuple[int, ...], pad_id: int, chunked: bool, driver: Any
) -> Any:
    from rlbatch.rollout.engines.megatron_dynamic import build_megatron_dynamic

    return build_megatron_dynamic(
        cfg, model, eos_id=eos_ids[0], pad_id=pad_id, extra_eos_ids=eos_ids
    )


def _vllm_engine(
    cfg: RunConfig, model: Any, eos_ids: tuple[int, ...], pad_id: int, chunked: bool, driver: Any
) -> Any:
    from rlbatch.rollout.protocol import build_synced_engine
    from rlbatch.rollout.turns import TurnSamples

    turns = None if driver is None else TurnSamples(driver, cfg.env.max_total_tokens)
    return build_synced_engine(cfg, model, eos_ids=eos_ids, turns=turns)


_ENGINES = {
    RolloutBackend.megatron: _megatron_engine,
    RolloutBackend.megatron_dynamic: _dynamic_engine,
    RolloutBackend.vllm: _vllm_engine,
    RolloutBackend.vllm_server: _vllm_engine,
}


def build_rollout_engine(
    cfg: RunConfig,
    model: Any,
    *,
    eos_id: int,
    pad_id: int,
    chunked: bool = True,
    driver: Any = None,
    extra_eos_ids: Sequence[int] = (),
) -> RolloutEngine:
    """The engine ``rollout.backend`` names, on this rank's policy chunks. `chunked`: split
    generate() calls by rollout.micro_batch_size (False when the LCM aggregator chunks).
    `driver`: multi-turn rollouts through this turn driver (rlbatch.env.driver.EnvDriver).
    `extra_eos_ids`: other ids that end a response besides `eos_id` (the tokenizer's
    ``eos_ids``): every backend stops at the whole set."""
    backend = RolloutBackend(cfg.rollout.backend)
    eos_ids = tuple(dict.fromkeys((eos_id, *extra_eos_ids)))
    return _ENGINES[backend](cfg, model, eos_ids, pad_id, chunked, driver)
