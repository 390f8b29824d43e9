"""rlbatch-bench grpo: one GRPO step on the tiny model, timed by stage.

    rlbatch-bench grpo [--prompts 16] [--generations 4] [--repeats 3] [--threads 1] [--json]
    rlbatch-bench grpo --async [--workload default|longtail] [--variants sync,...] [--steps 12]
                       [--repeats 3] [--threads 1]   (rlbatch.bench.grpo_async)
    rlbatch-bench grpo --against trl    (TRL's GRPOTrainer vs rlbatch: see rlbatch.bench.grpo_trl)

Stages: rollout (generation on the policy, KV cache), ref (reference logprobs), old (policy
logprobs before the update), train (forward/backward + optimizer step through
rlbatch.grpo.step.run_train_step). Two comparisons, each as a time ratio:

- rollout / ref / old passes LCM-aggregated (rollout chunks of ``--rollout-micro`` prompts,
  ref/old passes cut by the infer token budget over the merged batch) vs direct (every
  training micro-batch of ``--train-micro`` prompts rolled out and scored on its own);
- the train pass with fixed vs dynamic vs packed batching (batching.train.mode), same samples.

Single process (CPU or one GPU); figures go to docs/benchmarks.md "## GRPO step".
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from rlbatch.bench.grpo_async import WORKLOADS, variant_names
from rlbatch.config.schema import BatchingMode, RunConfig

ASYNC_WORKLOADS = tuple(WORKLOADS)
TRL_WORKLOADS = ("issue", "longtail")
TRL_MODELS = ("tiny", "qwen0.5b")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlbatch-bench grpo", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt")
    p.add_argument("--train-micro", type=int, default=2, help="prompts per training micro-batch")
    p.add_argument("--rollout-micro", type=int, default=8, help="prompts per LCM rollout chunk")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=512, help="train token budget")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument(
        "--async",
        dest="run_async",
        action="store_true",
        help="instead: step time of the default recipe, sync vs async (see --workload)",
    )
    p.add_argument("--steps", type=int, default=12, help="--async: optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="--async: first steps not timed")
    p.add_argument(
        "--against", choices=("trl",), help="compare whole steps with TRL's GRPOTrainer instead"
    )
    p.add_argument("--completion-tokens", default="64,256", help="--against trl: caps to run")
    p.add_argument(
        "--workload",
        help="--async: default (the recipe) | longtail (lognormal response lengths); --against"
        " trl: a comma list of issue,longtail (default both)",
    )
    p.add_argument(
        "--variants", help="--async: comma list of the workload's variants to run (default all)"
    )
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="--against trl")
    p.add_argument(
        "--models",
        default="tiny,qwen0.5b",
        help="--against trl: widths to run (tiny: every --workload and --completion-tokens;"
        " qwen0.5b: Qwen2.5-0.5B's widths with 2 layers, the issue workload at"
        " --wide-completion-tokens)",
    )
    p.add_argument(
        "--wide-completion-tokens", default="64", help="--against trl: caps of the qwen0.5b cells"
    )
    p.add_argument(
        "--trl-ckpt",
        choices=("on", "off", "both"),
        default="on",
        help="--against trl: TRL's gradient checkpointing (its default is on)",
    )
    args = p.parse_args(argv)
    error = workload_error(args)
    if error:
        p.error(error)
    if args.workload is None and (args.run_async or args.against == "trl"):
        args.workload = "default" if args.run_async else ",".join(TRL_WORKLOADS)
    if args.run_async:
        try:
            variant_names(args.workload, args.variants)
        except ValueError as err:
            p.error(str(err))
    return args


def workload_error(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with --workload / --variants for the benchmark chosen (None: fine)."""
    if args.run_async and args.against:
        return "--async and --against trl are two benchmarks: choose one"
    if args.variants is not None and not args.run_async:
        return "--variants selects --async variants: add --async"
    if args.against == "trl":
        bad_models = [m for m in args.models.split(",") if m not in TRL_MODELS]
        if bad_models:
            return f"--against trl --models {args.models}: a comma list of {', '.join(TRL_MODELS)}"
    if args.workload is None:
        return None
    if args.run_async:
        if args.workload not in ASYNC_WORKLOADS:
            return f"--async --workload {args.workload}: choose one of {', '.join(ASYNC_WORKLOADS)}"
        return None
    if args.against == "trl":
        bad = [w for w in args.workload.split(",") if w not in TRL_WORKLOADS]
        if bad:
            return (
                f"--against trl --workload {args.workload}: a comma list of"
                f" {', '.join(TRL_WORKLOADS)}"
            )
        return None
    return "--workload applies to --async or --against trl: add one of them"


def bench_config(args: argparse.Namespace) -> RunConfig:
    cfg = RunConfig()
    cfg.grpo.num_generations = args.generations
    cfg.grpo.beta = 0.04  # the ref pass runs
    cfg.rollout.max_new_tokens = args.max_new_tokens
    cfg.batching.train.max_tokens = args.max_tokens
    cfg.batching.train.micro_batch_size = args.train_micro * args.generations
    cfg.batching.infer.max_tokens = 2 * args.max_tokens
    cfg.logging.progress = False
    return cfg


def use_lcm(cfg: RunConfig, args: argparse.Namespace, aggregated: bool) -> None:
    """LCM: big rollout chunks, ref/old by the infer budget; direct: everything per train
    micro-batch (service_target_bs = the train micro size)."""
    agg = cfg.grpo.aggregation
    agg.train_micro_batch_size = args.train_micro
    micro = args.rollout_micro if aggregated else args.train_micro
    agg.rollout_micro_batch_size = micro
    agg.ref_logps_micro_batch_size = agg.old_logps_micro_batch_size = micro
    agg.logps_use_infer_budget = aggregated


@dataclass
class Clock:
    """Seconds and tokens per stage."""

    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def wrap(self, stage: str, fn: Callable, count: Callable[[Any, Any], int]) -> Callable:
        def timed(*a: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a)
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0
            self.tokens[stage] = self.tokens.get(stage, 0) + count(a, out)
            self.calls[stage] = self.calls.get(stage, 0) + 1
            return out

        return timed


@dataclass
class World:
    cfg: RunConfig
    model: list[Any]
    optimizer: Any
    scheduler: Any
    ref: Optional[list[Any]]
    """None when grpo.beta == 0 (no reference pass)."""
    tokenizer: Any
    prompts: list[Any]


def build_world(cfg: RunConfig) -> World:
    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model, build_optimizer
    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.grpo.data import load_prompts
    from rlbatch.grpo.stages import build_reference

    if not parallel.is_initialized():
        parallel.initialize(cfg)
    parallel.seed(cfg.trainer.seed)
    model = build_model(cfg, calculate_per_token_loss=True)
    optimizer, scheduler = build_optimizer(cfg, model)
    tokenizer = build_tokenizer(cfg.model)
    prompts = load_prompts(cfg.data, tokenizer, cfg.trainer.seed)
    ref = build_reference(cfg, model)
    return World(cfg, model, optimizer, scheduler, ref, tokenizer, prompts)


def produce_samples(
    world: World, args: argparse.Namespace, aggregated: bool, clock: Clock, old_pass: bool = True
):
    """One round of this step's prompts through the LCM aggregator (timed stages); the
    old-logprob stage runs with ``old_pass`` (a training run runs it only for off-policy
    rounds of several steps: rlbatch.grpo.lcm.old_pass_runs)."""
    from rlbatch.grpo.lcm import LCMAggregator, Stages, plan_aggregation
    from rlbatch.grpo.rewards import build_reward_fn
    from rlbatch.grpo.stages import make_logps_fn, make_reward_batch_fn, reference_logps_fn
    from rlbatch.rollout.engines.builtin import MegatronRolloutEngine, as_rollout_fn

    cfg = world.cfg
    ref_fn = reference_logps_fn(cfg, world.ref, world.model)
    use_lcm(cfg, args, aggregated)
    tok = world.tokenizer
    engine = MegatronRolloutEngine(world.model, bench_sampling(cfg, tok))
    gen_tokens = lambda a, out: sum(len(s.response_ids) for s in out)  # noqa: E731
    all_tokens = lambda a, out: sum(s.length for s in a[0])  # noqa: E731
    stages = Stages(
        rollout_fn=clock.wrap("rollout", as_rollout_fn(engine, 0), gen_tokens),
        reward_fn=make_reward_batch_fn(build_reward_fn(cfg.data), tok),
        old_logps_fn=(
            clock.wrap("old", make_logps_fn(world.model, cfg), all_tokens) if old_pass else None
        ),
        ref_logps_fn=(
            None
            if ref_fn is None  # grpo.beta == 0: no reference pass
            else clock.wrap("ref", ref_fn, all_tokens)
        ),
    )
    g = cfg.grpo
    aggregator = LCMAggregator(
        plan_aggregation(cfg),
        stages,
        beta=g.beta,
        scale_rewards=g.scale_rewards,
        advantage_eps=g.advantage_eps,
        seed=cfg.trainer.seed,
    )
    prompts = world.prompts[: args.prompts]
    micro = [prompts[i : i + args.train_micro] for i in range(0, len(prompts), args.train_micro)]
    examples = aggregator.run(micro)
    return [s for ex in examples for s in ex.samples]


def time_train(world: World, samples: list[Any], mode: BatchingMode, clock: Clock) -> dict:
    from rlbatch.grpo.step import run_train_step

    world.cfg.batching.train.mode = mode
    t0 = time.perf_counter()
    metrics = run_train_step(
        world.cfg, world.model, world.optimizer, world.scheduler, samples, step=1
    )
    clock.seconds["train"] = time.perf_counter() - t0
    clock.tokens["train"] = sum(s.length for s in samples)
    return metrics


def _median_clock(clocks: list[Clock]) -> dict[str, dict[str, float]]:
    out = {}
    for stage in clocks[0].seconds:
        secs = statistics.median(c.seconds[stage] for c in clocks)
        toks = statistics.median(c.tokens[stage] for c in clocks)
        out[stage] = {
            "seconds": secs,
            "tokens": toks,
            "tokens_per_s": toks / secs,
            "calls": clocks[0].calls.get(stage, 1),
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    world = build_world(bench_config(args))
    produce_samples(world, args, True, Clock())  # warm-up (allocations, first-call costs)
    result: dict[str, Any] = {"aggregation": {}, "train": {}}
    samples = None
    for name, aggregated in (("lcm", True), ("direct", False)):
        clocks = []
        for _ in range(args.repeats):
            clock = Clock()
            samples = produce_samples(world, args, aggregated, clock)
            clocks.append(clock)
        result["aggregation"][name] = _median_clock(clocks)
    assert samples is not None
    time_train(world, samples, BatchingMode.dynamic, Clock())  # warm-up
    for mode in (BatchingMode.fixed, BatchingMode.dynamic, BatchingMode.packed):
        clocks, metrics = [], {}
        for _ in range(args.repeats):
            clock = Clock()
            metrics = time_train(world, samples, mode, clock)
            clocks.append(clock)
        result["train"][mode.value] = _median_clock(clocks)["train"] | {
            "micro_batches": metrics["num_micro_batches"],
            "padding_efficiency": metrics["padding_efficiency"],
        }
    result["ratios"] = ratios(result)
    result["setup"] = vars(args)
    return result


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """direct / lcm time per stage (> 1: aggregation is faster), fixed / x train time."""
    agg, train = result["aggregation"], result["train"]
    out = {
        f"{stage}_direct_over_lcm": agg["direct"][stage]["seconds"] / agg["lcm"][stage]["seconds"]
        for stage in ("rollout", "ref", "old")
    }
    for mode in ("dynamic", "packed"):
        out[f"train_fixed_over_{mode}"] = train["fixed"]["seconds"] / train[mode]["seconds"]
    return out


def format_report(result: dict[str, Any]) -> str:
    lines = ["stage     batching   calls  seconds  tokens  tokens/s"]
    for name, stages in result["aggregation"].items():
        for stage, v in stages.items():
            lines.append(
                f"{stage:<9} {name:<10} {v['calls']:>5} {v['seconds']:>8.3f} {v['tokens']:>7.0f}"
                f" {v['tokens_per_s']:>9.0f}"
            )
    for mode, v in result["train"].items():
        lines.append(
            f"{'train':<9} {mode:<10} {v['micro_batches']:>5} {v['seconds']:>8.3f}"
            f" {v['tokens']:>7.0f} {v['tokens_per_s']:>9.0f}  padding eff"
            f" {v['padding_efficiency']:.2f}"
        )
    lines.append("ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in result["ratios"].items()))
    return "\n".join(lines)


def bench_sampling(cfg: Any, tokenizer: Any) -> Any:
    """The rollout sampling of a benchmarked run: the run's settings and its whole set of end
    ids (the tokenizer's, model.extra_eos_token_ids included), as training decodes."""
    from rlbatch.rollout.sampling import SamplingParams

    return SamplingParams.from_config(
        cfg.rollout,
        tokenizer.eos_id,
        tokenizer.pad_id,
        cfg.debug,
        extra_eos_ids=tokenizer.eos_ids,
    )
