"""The evaluation job: sample the held-out prompts on the rollout engine, score, gather.

One :class:`Evaluator` per rank, on the rank's own model chunks (the training policy, or the
model rlbatch-eval loaded). The prompts are cut into blocks of rollout.micro_batch_size, dealt
round-robin over the data-parallel ranks; every rank of a tensor / pipeline group samples the
same blocks (the engine's contract), and the scored results are gathered over the DP group, so
every rank computes the same metrics. Each block is sampled with a seed of its own (the
evaluation seed and the block's index), so a sample does not depend on the number of DP
ranks.

Evaluation never touches what training reads: it has its own prompts and its own sampling seed
(sampling noise is a hash of the seed, not a generator's stream); the training loop also saves
the global RNG states before it and restores them after, so a run trains the same with
evaluation on or off.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from rlbatch.config.enums import EnvOnError
from rlbatch.config.env import harness_spec, multi_turn
from rlbatch.config.schema import DataSource, RunConfig
from rlbatch.eval.answers import AnswerFn, answer_fn, voting_kind
from rlbatch.eval.metrics import PromptResult, ScoredSample, summarize
from rlbatch.eval.settings import (
    blocks_needed,
    eval_data,
    eval_data_seed,
    eval_pass_k,
    eval_rollout,
    in_step_ranks,
)
from rlbatch.grpo.types import Prompt, Sample

EVAL_STREAM = 0x45564C
"""Mixed into trainer.seed for the evaluation's sampling seed (another stream than training's)."""


def load_eval_prompts(cfg: RunConfig, tokenizer: Any) -> list[Prompt]:
    """The evaluation prompts: eval.data (a built-in task without the training prompts), the
    first eval.max_prompts of them."""
    from rlbatch.grpo.data import build_prompts

    examples = eval_examples(cfg)
    if not examples:
        raise ValueError(
            "the evaluation set is empty (every generated prompt is a training prompt): raise"
            " eval.data.num_prompts"
        )
    return build_prompts(eval_data(cfg), tokenizer, examples)


def eval_examples(cfg: RunConfig) -> list[Any]:
    """The evaluation's rows, before tokenization (what :func:`load_eval_prompts` builds): for
    a verifiers run, the tasks of eval.verifiers's taskset."""
    from rlbatch.grpo.data import load_examples
    from rlbatch.grpo.tasks import generate_examples

    data = eval_data(cfg)
    verifiers = cfg.eval.verifiers if cfg.env.agent.verifiers else None  # its tasks are the rows
    examples = load_examples(data, eval_data_seed(cfg.trainer.seed), verifiers=verifiers)
    if (
        not verifiers
        and data.source == DataSource.builtin
        and cfg.data.source == DataSource.builtin
    ):
        seen = {
            e.prompt
            for e in generate_examples(cfg.data.task, cfg.data.num_prompts, cfg.trainer.seed)
        }
        examples = [e for e in examples if e.prompt not in seen]
    if cfg.eval.max_prompts is not None:
        examples = examples[: cfg.eval.max_prompts]
    return examples


def prompt_blocks(prompts: Sequence[Prompt], size: int, dp: int, ep: int) -> list[Any]:
    """The held-out prompts in blocks of at most ``size`` (rollout.micro_batch_size), one
    generate call each, dealt round-robin over the DP ranks. With expert parallelism every rank
    of an expert group must make as many calls (each MoE forward is an all-to-all over the
    group): the prompts then go into a multiple of dp blocks of near-equal size."""
    count = -(-len(prompts) // size)
    if ep == 1 or count % dp == 0:
        return [prompts[i : i + size] for i in range(0, len(prompts), size)]
    count = blocks_needed(len(prompts), size, dp)
    if len(prompts) < count:
        raise ValueError(
            f"evaluation at parallel.ep={ep} deals its {len(prompts)} held-out prompt(s) to "
            f"{dp} data-parallel ranks, each of which must decode some: use at least {count} "
            "(eval.max_prompts, the evaluation data)"
        )
    base, extra = divmod(len(prompts), count)
    starts = [i * base + min(i, extra) for i in range(count + 1)]
    return [prompts[a:b] for a, b in itertools.pairwise(starts)]


class Evaluator:
    """evaluate(step) -> (metrics, results of every prompt), the same on every rank."""

    def __init__(
        self,
        cfg: RunConfig,
        model: list[Any],
        tokenizer: Any,
        *,
        dp_rank: int,
        dp_size: int,
        gather: Callable[[Any], list[Any]],
    ) -> None:
        from rlbatch.grpo.rewards import build_rewards
        from rlbatch.rollout.generation import rank_seed

        data = eval_data(cfg)
        self.cfg = cfg
        self.prompts = load_eval_prompts(cfg, tokenizer)
        blocks = prompt_blocks(
            self.prompts, cfg.rollout.micro_batch_size, dp_size, in_step_ranks(cfg)
        )
        self.blocks = list(enumerate(blocks))[dp_rank::dp_size]  # (block index, prompts)
        self.wait_s = _harness_bound(cfg, blocks, dp_size)
        """dp > 1 with a harness: how long a rank waits for the others' episodes (else 0)."""
        self.evaluations = 0
        self.tokenizer = tokenizer
        self.engine, self.driver = _engine(cfg, model, tokenizer)
        self.rewards = build_rewards(data, cfg.batching.infer)
        self.answer: Optional[AnswerFn] = answer_fn(
            voting_kind(data.reward, data.reward_fn), data.task
        )
        self.gather = gather
        self.seed = rank_seed(cfg.trainer.seed, EVAL_STREAM)

    def close(self) -> None:
        """Release the evaluation's environment driver (its threads), when it has one."""
        if self.driver is not None:
            self.driver.close()
            self.driver = None

    def evaluate(self, step: int) -> tuple[dict[str, float], list[PromptResult]]:
        """Sample and score this rank's prompts, gather every rank's, compute the metrics."""
        from rlbatch.rollout.generation import rank_seed

        started = time.perf_counter()
        n = self.cfg.eval.num_samples
        mine: list[PromptResult] = []
        for b, prompts in self.blocks:
            samples = self.engine.generate(prompts, n, step, rank_seed(self.seed, b))
            mine += self._score(prompts, samples, n)
        self._meet_peers()
        results = sorted((r for part in self.gather(mine) for r in part), key=lambda r: r.index)
        episodes = multi_turn(self.cfg.env)  # an environment's or a harness's: they can fail
        skip = episodes and EnvOnError(self.cfg.env.on_error) == EnvOnError.skip
        metrics = summarize(
            results, eval_pass_k(self.cfg), self.answer is not None, episodes, skip_errors=skip
        )
        metrics["eval/seconds"] = time.perf_counter() - started
        return metrics, results

    def _meet_peers(self) -> None:
        """dp > 1 with a harness: wait for every rank's evaluation episodes (their deadlines may
        run past trainer.timeout_s, which the gather below would give up at)."""
        if self.wait_s <= 0:
            return
        from rlbatch import distributed
        from rlbatch.runtime import progress

        self.evaluations += 1
        what = "the other ranks' evaluation harness episodes"
        with progress.user_call(what, self.wait_s):
            distributed.meet(f"agent-eval-{self.evaluations}", self.wait_s)

    def _score(
        self, prompts: Sequence[Prompt], samples: list[Sample], n: int
    ) -> list[PromptResult]:
        from rlbatch.grpo.rewards import reward_input
        from rlbatch.grpo.stages import add_episode_rewards

        inputs = [reward_input(s, self.tokenizer) for s in samples]
        totals, _ = self.rewards.score(inputs) if inputs else ([], {})
        # multi-turn: the environment's rewards, bounded as in training
        totals = add_episode_rewards(samples, totals, self.cfg.data.reward_abs_max)
        threshold = self.cfg.eval.correct_threshold
        errors = [_episode_error(s) if multi_turn(self.cfg.env) else None for s in samples]
        scored = [
            ScoredSample(
                text=x.response,
                reward=r,
                correct=r > threshold and error is None,
                num_tokens=len(s.response_ids),
                truncated=s.truncated,
                answer=self.answer(x) if self.answer is not None else None,
                error=error,
            )
            for s, x, r, error in zip(samples, inputs, totals, errors, strict=True)
        ]
        return [
            PromptResult(p.index, p.text, p.answer, tuple(scored[g * n : (g + 1) * n]))
            for g, p in enumerate(prompts)
        ]


def _harness_bound(cfg: RunConfig, blocks: Sequence[Sequence[Prompt]], dp_size: int) -> float:
    """The longest a rank's evaluation harness episodes may take, the same on every rank: its
    most blocks, each of the largest block's waves of env.max_concurrency episodes at
    env.agent.episode_timeout_s + 5 s, plus trainer.timeout_s (0 without a harness or at dp 1:
    the ranks need not meet)."""
    if not harness_spec(cfg.env) or dp_size <= 1 or not blocks:
        return 0.0
    rows = max(len(b) for b in blocks) * cfg.eval.num_samples
    waves = -(-rows // max(1, cfg.env.max_concurrency))
    per_rank = -(-len(blocks) // dp_size)
    return per_rank * waves * (cfg.env.agent.episode_timeout_s + 5.0) + cfg.trainer.timeout_s


def _episode_error(sample: Sample) -> Optional[str]:
    """The error an episode ended with under env.on_error zero_reward / skip (an environment's,
    env.path, or an agent harness's)."""
    episode = sample.episode or {}
    return str(episode.get("error")) if episode.get("end") == "error" else None


def _engine(cfg: RunConfig, model: list[Any], tokenizer: Any) -> tuple[Any, Any]:
    """(the rollout engine with the evaluation's sampling settings and data, its environment
    driver or None), in rollout.micro_batch_size prompt chunks (sequence parallelism off while
    decoding, as for training's rollouts); multi-turn through the run's environment (env.path)
    on every backend, the driver built for the evaluation's data (or through the agent harness
    env.harness names, on the evaluation's rows and sampling; for env.agent.verifiers, the
    environment eval.verifiers names). Evaluation measures the
    policy: the long-tailed length workload of training's rollouts
    (debug.response_length_median) stays off here.

    A backend with its own copy of the weights (rollout.backend=vllm) is one engine per process:
    evaluation uses the run's engine, with its own sampling per request and its own turns."""
    from rlbatch.rollout.engines.builtin import build_rollout_engine
    from rlbatch.rollout.generation import SequenceParallelOffEngine
    from rlbatch.rollout.protocol import SYNCED_BACKENDS, SyncedRolloutEngine, token_sampling

    debug = dataclasses.replace(cfg.debug, response_length_median=0)
    env = cfg.env
    if env.agent.verifiers:  # the held-out environment's episodes (eval.verifiers)
        agent = dataclasses.replace(env.agent, verifiers=cfg.eval.verifiers)
        env = dataclasses.replace(env, agent=agent)
    sampling = dataclasses.replace(
        cfg, rollout=eval_rollout(cfg), data=eval_data(cfg), debug=debug, env=env
    )
    if harness_spec(cfg.env):  # the harness's episodes, sampled with the evaluation's settings
        from rlbatch.rollout.agent.engine import build_agent_engine

        return build_agent_engine(sampling, model, tokenizer, meet=False), None
    driver = None
    if cfg.env.path:
        from rlbatch.rollout.turns import build_turn_driver

        driver = build_turn_driver(sampling, tokenizer)
    synced = getattr(cfg.rollout.backend, "value", cfg.rollout.backend) in SYNCED_BACKENDS
    engine = build_rollout_engine(
        cfg if synced else sampling,  # a synced engine starts with the run's settings
        model,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        chunked=True,
        driver=driver,
        extra_eos_ids=tokenizer.eos_ids,
    )
    if synced:
        assert isinstance(engine, SyncedRolloutEngine)
        engine = engine.with_sampling(token_sampling(eval_rollout(cfg), tokenizer.eos_ids))
    elif cfg.parallel.sequence_parallel and cfg.parallel.tp > 1:
        engine = SequenceParallelOffEngine(engine, model)
    return engine, driver


def make_evaluate_fn(
    cfg: RunConfig, model: list[Any], tokenizer: Any, dp_rank: int, dp_size: int, rank: int
) -> Callable[[int], dict[str, float]]:
    """The training loop's evaluate(step) -> metrics; rank 0 writes
    <run_dir>/eval/step_NNNNN.jsonl."""
    from rlbatch import distributed
    from rlbatch.eval.report import write_samples

    evaluator = Evaluator(
        cfg, model, tokenizer, dp_rank=dp_rank, dp_size=dp_size, gather=distributed.dp_gather_object
    )
    assert cfg.run_dir is not None

    def evaluate(step: int) -> dict[str, float]:
        metrics, results = evaluator.evaluate(step)
        if rank == 0:
            write_samples(samples_path(Path(str(cfg.run_dir)), step), results)
        return metrics

    evaluate.close = evaluator.close  # type: ignore[attr-defined]
    return evaluate


def samples_path(run_dir: Path, step: int) -> Path:
    """<run_dir>/eval/step_NNNNN.jsonl."""
    return run_dir / "eval" / f"step_{step:05d}.jsonl"
