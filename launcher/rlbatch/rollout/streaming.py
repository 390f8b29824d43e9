"""The generation side of ``grpo.partial_rollouts``: the rank's partial-rollout stream
(rlbatch.rollout.partial) behind the producer's generate_fn, and the round figures of both
generation modes.

Built where generation runs: in the trainer's process (inline) or in the generation worker
(overlap), from the same config, so both produce the same samples. A round's delivered groups go
through this rank's LCM aggregator exactly like the round engine's (rewards, reference pass,
advantages): the aggregator's rollout stage hands back the rows the stream already decoded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlbatch.config.schema import ConsumptionGranularity, RunConfig
from rlbatch.grpo.types import Prompt, Sample
from rlbatch.rollout.engines.builtin import DecodeStats
from rlbatch.rollout.protocol import GenerateFn, GenerationRequest, PolicySnapshot
from rlbatch.rollout.schedule import PromptSampler, schedule_from_config


@dataclass
class RoundOutput:
    """A generate_fn's answer when the round's groups or figures are its own: the request it
    actually served (a partial-rollout round delivers the groups that finished), the samples in
    that request's order and the round's figures (``rollout/*`` counters, summed over ranks
    by the loop)."""

    request: GenerationRequest
    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)


def stream_shape(cfg: RunConfig) -> tuple[int, int]:
    """(lead, slack) of the stream (rlbatch.rollout.partial): rounds a row may start ahead of its
    own, and rounds a finished group may wait, within grpo.max_staleness."""
    g = cfg.grpo
    per_round = schedule_from_config(g, cfg.parallel.dp).steps_per_round
    lag = min(g.num_steps_async, g.max_staleness)
    budget = (g.max_staleness - lag) // per_round
    slack = 1 if ConsumptionGranularity(g.consumption_granularity) == "group" else 0
    return budget - slack, slack


def stream_slots(cfg: RunConfig) -> int:
    """Rows decoding at once: a rollout chunk's rows (what the round engine decodes at once)."""
    g = cfg.grpo
    prompts = g.aggregation.rollout_micro_batch_size or cfg.rollout.micro_batch_size
    return prompts * g.num_generations


class DecodedRows:
    """A RolloutEngine that hands back rows already decoded (the aggregator's rollout stage)."""

    def __init__(self) -> None:
        self.queue: deque[Sample] = deque()

    def generate(
        self, prompts: Sequence[Prompt], num_generations: int, policy_version: int, seed: int
    ) -> list[Sample]:
        out = []
        for p in prompts:
            for _ in range(num_generations):
                sample = self.queue.popleft()
                if sample.prompt.index != p.index:
                    raise RuntimeError("partial rollouts: rows handed back out of order")
                out.append(sample)
        return out


class StreamingGeneration:
    """generate_fn(request, snapshot) -> RoundOutput of a partial-rollout run, and the
    checkpointed state of this rank's generation side (aggregator, stream, its prompt draws)."""

    def __init__(
        self,
        cfg: RunConfig,
        model: list[Any],
        tokenizer: Any,
        prompts: Sequence[Prompt],
        aggregator: Any,
        dp_rank: int,
    ) -> None:
        from rlbatch.rollout.generation import make_generate_fn
        from rlbatch.rollout.partial import PartialRolloutStream
        from rlbatch.rollout.sampling import SamplingParams
        from rlbatch.rollout.segments import segment_engine

        schedule = schedule_from_config(cfg.grpo, cfg.parallel.dp)
        self.model, self.prompts, self.aggregator = model, prompts, aggregator
        self.sampler = PromptSampler(
            len(prompts), schedule, dp_rank=dp_rank, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle
        )
        params = SamplingParams.from_config(
            cfg.rollout,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            debug=cfg.debug,
            extra_eos_ids=tokenizer.eos_ids,
        )
        lead, slack = stream_shape(cfg)
        self.stream = PartialRolloutStream(
            self._next_draw,
            lambda index: prompts[index].prompt_ids,
            params,
            num_generations=schedule.num_generations,
            groups_per_round=schedule.prompts_per_rank_round,
            num_slots=stream_slots(cfg),
            lead=lead,
            slack=slack,
            seed=cfg.trainer.seed,
            max_len=max(len(p.prompt_ids) for p in prompts) + params.max_new_tokens,
        )
        self.synced = segment_engine(cfg, model, tokenizer.eos_ids)
        self.rows = DecodedRows()
        self.inner = make_generate_fn(
            prompts,
            aggregator,
            self.rows,
            train_micro_batch_size=cfg.grpo.aggregation.train_micro_batch_size,
            perturb_logps=cfg.debug.perturb_behaviour_logps,
            seed=cfg.trainer.seed,
        )

    def _next_draw(self) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        request = self.sampler.next_round()
        return request.prompt_indices, request.group_ids, request.stream_start

    def __call__(self, request: GenerationRequest, snapshot: PolicySnapshot) -> RoundOutput:
        from rlbatch.engine import generation

        if request.round_index != self.stream.round_index:
            raise RuntimeError(
                f"partial rollouts: round {request.round_index} asked, the stream is at round "
                f"{self.stream.round_index}"
            )
        chunk = self.model[0]
        figures: dict[str, float] = {}
        if self.synced is not None:  # an engine with its own weights (vLLM), in segments
            self.synced.ensure_version(snapshot.version)
            result = self.stream.run_round(snapshot.version, self.synced.segments)
            figures = self.synced.engine.take_figures()
        else:
            with generation.inference_mode(self.model):
                result = self._run_round(snapshot.version, chunk)
        if result.stream_start != request.stream_start:
            raise RuntimeError("partial rollouts: the stream's draws left the prompt sampler's")
        served = GenerationRequest(
            round_index=request.round_index,
            prompt_indices=tuple(g.prompt_index for g in result.groups),
            group_ids=tuple(g.group_id for g in result.groups),
            num_generations=request.num_generations,
            stream_start=request.stream_start,
        )
        self.rows.queue.extend(
            Sample(
                prompt=self.prompts[g.prompt_index],
                group_id=g.group_id,
                response_ids=list(row.ids),
                behaviour_logps=list(row.logps),
                truncated=row.truncated,
                policy_version=snapshot.version,
                token_versions=list(row.versions),
                routing=row.routing,
            )
            for g in result.groups
            for row in g.rows
        )
        samples = self.inner(served, snapshot)
        metrics = decode_metrics(result.stats)
        metrics.update(
            {
                "rollout/carried_rows": float(result.carried_rows),
                "rollout/waiting_groups": float(result.waiting_groups),
                "rollout/started_rows": float(result.started_rows),
                "rollout/untrained_rows": float(
                    result.started_rows - result.delivered_rows - self.stream.started_in_stream()
                ),
            }
        )
        return RoundOutput(served, samples, metrics | figures)

    def _run_round(self, version: int, chunk: Any) -> Any:
        """The stream's round on the built-in engine's per-row decoder. An MoE policy at
        parallel.ep > 1: each rank's round decodes its own rows for as many steps as its data
        asks, and every forward is an all-to-all over the expert group, so the decoder announces
        each forward to the group and a rank whose round ended first (or that had nothing to
        decode) runs idle forwards until its peers' rounds end (rlbatch.rollout.expert_step)."""
        from rlbatch.engine import generation
        from rlbatch.rollout.expert_step import Ticking, drain

        made: list[Any] = []

        def new_decoder(slots: int, length: int) -> Any:
            # an MoE policy records every fed position's experts (StreamRow.routing: r3)
            made.append(
                generation.LeanDecoder(
                    chunk, slots, length, record_routing=generation.is_moe(chunk)
                )
            )
            return Ticking(made[-1]) if made[-1].expert_parallel else made[-1]

        result = self.stream.run_round(version, new_decoder)
        if generation.is_moe(chunk):
            decoder = made[0] if made else generation.LeanDecoder(chunk, 1, 1)
            if decoder.expert_parallel:
                drain(decoder)
        return result

    def state_dict(self) -> dict[str, Any]:
        return {
            "aggregator": self.aggregator.state_dict(),
            "stream": self.stream.state_dict(),
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.aggregator.load_state_dict(state["aggregator"])
        self.stream.load_state_dict(state["stream"])
        self.sampler.load_state_dict(state["sampler"])


def decode_metrics(stats: DecodeStats) -> dict[str, float]:
    """A round's decode-slot counters (the loop sums them over ranks: rollout/slot_occupancy)."""
    return {
        "rollout/busy_slot_steps": float(stats.busy_slot_steps),
        "rollout/slot_steps": float(stats.slot_steps),
    }


class RoundFigures:
    """generate_fn of the round engine that also reports the round's decode-slot occupancy
    (the engine's ``decode_stats``, reset for every round)."""

    def __init__(self, generate: GenerateFn, engine: Any) -> None:
        self.generate = generate
        self.engine = engine

    def __call__(self, request: GenerationRequest, snapshot: PolicySnapshot) -> RoundOutput:
        stats = getattr(self.engine, "decode_stats", None)
        if stats is not None:
            self.engine.decode_stats = DecodeStats()
        samples = self.generate(request, snapshot)
        stats = getattr(self.engine, "decode_stats", None)
        metrics = decode_metrics(stats) if stats is not None and stats.slot_steps else {}
        take = getattr(self.engine, "take_figures", None)  # engines with their own weights
        return RoundOutput(request, samples, metrics | (take() if take else {}))


def local_generation(
    cfg: RunConfig, model: list[Any], tokenizer: Any, prompts: Any, aggregator: Any, dp_rank: int
) -> tuple[Any, Any]:
    """(generate_fn, checkpointed state) of generation in this process (the trainer's, or a
    generation worker's): the partial-rollout stream (grpo.partial_rollouts; its state holds the
    aggregator's) or the round engine driven by the LCM aggregator."""
    from rlbatch.rollout.generation import (
        SequenceParallelOffEngine,
        build_engine,
        make_generate_fn,
    )

    if cfg.grpo.partial_rollouts:
        stream = StreamingGeneration(cfg, model, tokenizer, prompts, aggregator, dp_rank)
        return stream, stream
    engine: Any = build_engine(cfg, model, tokenizer)
    counted = engine  # the engine that keeps the round's figures (decode_stats, take_figures)
    if (
        cfg.parallel.sequence_parallel
        and cfg.parallel.tp > 1
        and cfg.rollout.backend not in ("vllm", "vllm_server")
    ):
        engine = SequenceParallelOffEngine(engine, model)  # vLLM decodes on its own copy
    generate = make_generate_fn(
        prompts,
        aggregator,
        engine,
        train_micro_batch_size=cfg.grpo.aggregation.train_micro_batch_size,
        perturb_logps=cfg.debug.perturb_behaviour_logps,
        seed=cfg.trainer.seed,
    )
    return RoundFigures(generate, counted), aggregator
