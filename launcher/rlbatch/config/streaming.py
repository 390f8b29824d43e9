"""Checks of ``grpo.partial_rollouts`` and ``grpo.consumption_granularity`` (the partial-rollout
stream, docs/training_loop.md "Partial rollouts"): every problem at once, each with its fix."""

from __future__ import annotations

from rlbatch.config.enums import ConsumptionGranularity, FilterGroups, RolloutBackend, RopeScaling
from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import RunConfig


def overlaps_generation(cfg: RunConfig) -> bool:
    """Generation of the next round runs in a worker process while training runs
    (grpo.num_steps_async > 0; rlbatch.rollout.generation_worker), when generation issues no
    collective: tp = pp = cp = 1, and without dynamic sampling (grpo.filter_groups: its draws
    gather keep flags over the DP ranks in the training thread). Other layouts generate the
    due rounds inline (the same samples and versions, no overlap). docs/training_loop.md,
    "Async run-ahead"."""
    p, g = cfg.parallel, cfg.grpo
    ahead = min(g.num_steps_async, g.max_staleness) > 0
    filtering = FilterGroups(g.filter_groups) != FilterGroups.none  # draws agree over DP ranks
    return g.overlap_generation and ahead and not filtering and p.tp == p.pp == p.cp == 1


def per_row_decoder_errors(
    cfg: RunConfig, feature: str, records_routing: bool = False
) -> list[ConfigError]:
    """What the built-in engine's per-row KV-cache decoder (rlbatch.engine.generation.
    LeanDecoder: multi-turn environments, agent harnesses and partial rollouts decode on it)
    cannot compute or record, named for ``feature``, refused before launch rather than at the
    first rollout: yarn RoPE; the routing grpo.routing_replay=r3 replays where ``feature``
    keeps none (the decoder computes an MoE layer with megatron's own MoE layer and records
    each fed token's routing; multi-turn episodes carry it, ``records_routing``, and so do the
    partial-rollout stream's rows; an agent harness's spliced calls do not)."""
    from rlbatch.config.enums import RoutingReplay

    m, errors = cfg.model, []
    partial = feature.startswith("partial")  # its rows carry their routing (StreamRow.routing)
    r3 = RoutingReplay(cfg.grpo.routing_replay) == RoutingReplay.r3
    if m.num_moe_experts is not None and not partial and not records_routing:
        if r3:
            errors.append(
                ConfigError(
                    "grpo.routing_replay",
                    "r3",
                    f"with {feature} on the built-in engine is not supported yet: each call "
                    "decodes its whole conversation again and its sample splices the calls' "
                    "sampled tokens, so no one rollout routing belongs to each trained token: "
                    "set grpo.routing_replay=r2 (the old-logprob pass's routing) or none",
                )
            )
    if RopeScaling(m.rope_scaling) == RopeScaling.yarn:
        errors.append(
            ConfigError(
                "model.rope_scaling",
                RopeScaling(m.rope_scaling).value,
                f"{feature} decode on the built-in engine's per-row KV-cache decoder, which "
                "does not compute yarn's scaled attention: use rollout.backend=vllm, or a "
                "single-turn run without partial rollouts",
            )
        )
    return errors


def _steps_per_round(cfg: RunConfig) -> int:
    g = cfg.grpo
    if g.steps_per_generation:
        per_generation = g.steps_per_generation
    elif g.generation_batch_size and g.global_batch_size > 0:
        per_generation = max(1, g.generation_batch_size // g.global_batch_size)
    else:
        per_generation = 1
    return per_generation * max(1, g.num_iterations)


def check_partial_rollouts(cfg: RunConfig, errors: list[ConfigError]) -> None:
    g = cfg.grpo
    group = g.consumption_granularity == ConsumptionGranularity.group
    if not g.partial_rollouts:
        if group:
            errors.append(
                ConfigError(
                    "grpo.consumption_granularity",
                    "group",
                    "trains the groups that finished first while longer ones keep decoding, "
                    "which needs grpo.partial_rollouts=true",
                )
            )
        return
    if g.num_steps_async < 1:
        errors.append(
            ConfigError(
                "grpo.partial_rollouts",
                True,
                "rows continue across weight updates only when generation runs ahead: set "
                "grpo.num_steps_async >= 1",
            )
        )
    per_round = _steps_per_round(cfg)
    rounds = 2 if group else 1
    need = max(g.num_steps_async, 1) + rounds * per_round
    if g.max_staleness < need:
        errors.append(
            ConfigError(
                "grpo.max_staleness",
                g.max_staleness,
                f"leaves partial rollouts no room: a row may start up to {rounds} round(s) of "
                f"{per_round} step(s) before the round that trains it"
                + (" and a finished group may wait one more" if group else "")
                + f", on top of num_steps_async={g.num_steps_async}: set grpo.max_staleness >= "
                f"{need}",
            )
        )
    _check_engine(cfg, errors)


def _check_engine(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """The stream decodes on the built-in engine's per-row KV cache, or on vLLM in segments
    (rlbatch.rollout.segments); single-turn, unfiltered, tp = pp = cp = 1."""
    p, r = cfg.parallel, cfg.rollout
    vllm = r.backend in (RolloutBackend.vllm, RolloutBackend.vllm_server)
    layout = {"parallel.tp": p.tp, "parallel.pp": p.pp, "parallel.cp": p.cp}
    for key, value in layout.items():
        if value != 1:
            why = (
                "on vLLM runs one stream per data-parallel rank in this release, which needs"
                if vllm
                else "decodes on the built-in per-row KV-cache engine, which needs"
            )
            errors.append(
                ConfigError(
                    key,
                    value,
                    f"grpo.partial_rollouts {why} tp = pp = cp = 1: set {key}=1 or "
                    "grpo.partial_rollouts=false",
                )
            )
    if not vllm and (r.backend != RolloutBackend.megatron or not r.kv_cache):
        key, value = (
            ("rollout.backend", r.backend.value)
            if r.backend != RolloutBackend.megatron
            else ("rollout.kv_cache", False)
        )
        errors.append(
            ConfigError(
                key,
                value,
                "grpo.partial_rollouts needs the built-in engine with its KV cache "
                "(rollout.backend=megatron rollout.kv_cache=true), rollout.backend=vllm or "
                "rollout.backend=vllm_server",
            )
        )
    if not vllm:
        errors += per_row_decoder_errors(cfg, "partial rollouts (grpo.partial_rollouts)")
    if cfg.env.path:
        errors.append(
            ConfigError(
                "env.path",
                cfg.env.path,
                "multi-turn rollouts do not run in the partial-rollout stream yet: set "
                "grpo.partial_rollouts=false",
            )
        )
    if cfg.grpo.filter_groups != FilterGroups.none:
        errors.append(
            ConfigError(
                "grpo.filter_groups",
                cfg.grpo.filter_groups.value,
                "dynamic sampling refills whole rounds, which the partial-rollout stream does "
                "not have: set grpo.filter_groups=none or grpo.partial_rollouts=false",
            )
        )
