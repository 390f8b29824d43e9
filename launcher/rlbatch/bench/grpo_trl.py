"""rlbatch-bench grpo --against trl: one GRPO step of TRL's GRPOTrainer and of rlbatch on the
same Hugging Face checkpoint, interleaved in one process (needs the ``bench`` extra: trl).

    rlbatch-bench grpo --against trl [--models tiny,qwen0.5b] [--completion-tokens 64,256]
                                     [--wide-completion-tokens 64] [--workload issue,longtail]
                                     [--trl-ckpt on|off|both] [--repeats 3] [--clock cpu|wall]
                                     [--json]

Models (random weights written by transformers, fp32, tied embeddings): ``tiny`` = the tiny
Qwen2 of ``rlbatch-bench rollout`` (vocab 512, hidden 128, 4 layers, 4 heads / 2 KV heads);
``qwen0.5b`` = Qwen2.5-0.5B's widths (vocab 151,936, hidden 896, MLP 4,864, 14 heads / 2 KV
heads) with 2 of its 24 layers. beta 0.04 (the reference pass runs); temperature 1.
Workloads: ``issue`` = 2 prompts of 4 tokens x 8 generations; ``longtail`` = 8 prompts x 4
generations with prompt lengths 8-400 (most short). The tiny model runs every workload x
``--completion-tokens``; qwen0.5b the issue prompts x 2 generations at
``--wide-completion-tokens`` (its train pass is ~100x the tiny one's). EOS is a real token, so
a few completions end before the cap.

A step is timed from TRL's ``on_step_begin`` to ``on_step_end`` (generation, reference
logprobs, loss, backward, optimizer step); between two TRL steps one rlbatch step runs with
dynamic and one with packed batching of the reference and train passes (batching.infer.mode
and batching.train.mode; rollout, reference logprobs, train step: what rlbatch-train runs for
this on-policy config, so no old-logprob pass). Phases: ``gen`` = generation + reference
logprobs (+ rewards; TRL's ``_generate_and_score_completions``, rlbatch's rollout round),
``train`` = the rest of the step (forward, backward, optimizer step). Tokens/s = (prompt +
completion tokens) / seconds; medians over ``--repeats`` steps after a warm-up step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PAD, EOS = 256, 258  # rlbatch's byte tokenizer ids, shared with TRL's word-level tokenizer


def workload(name: str) -> tuple[list[list[int]], int]:
    """(prompts, generations per prompt)."""
    rng = random.Random(0)
    if name == "issue":
        return [[rng.randrange(0, 256) for _ in range(4)] for _ in range(2)], 8
    lengths = [min(400, int(8 / rng.random() ** 0.9)) for _ in range(8)]
    return [[rng.randrange(0, 256) for _ in range(n)] for n in lengths], 4


def trl_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over tokens "t0".."t{vocab-1}" (ids = their numbers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=f"t{PAD}", eos_token=f"t{EOS}", unk_token="t0"
    )


def build_trl(path: Path, prompts: list[list[int]], gens: int, max_new: int, ckpt: bool,
              out: Path, steps: int, callback: Any) -> Any:  # fmt: skip
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = len(prompts) * gens
    config = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        per_device_train_batch_size=rows,
        num_generations=gens,
        max_completion_length=max_new,
        beta=0.04,
        temperature=1.0,
        learning_rate=1e-5,
        max_steps=steps,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        gradient_checkpointing=ckpt,
        bf16=False,
        disable_dropout=True,
    )
    text = [" ".join(f"t{i}" for i in p) for p in prompts]
    data = Dataset.from_dict({"prompt": text * (steps + 2)})

    def reward(completions: list[str], **_: Any) -> list[float | None]:
        return [float(len(c)) for c in completions]

    return GRPOTrainer(
        model=str(path),
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=trl_tokenizer(
            json.loads((path / "config.json").read_text())["vocab_size"]
        ),
        callbacks=[callback],
    )


def _clock(kind: str) -> float:
    return time.process_time() if kind == "cpu" else time.perf_counter()


def rlbatch_world(path: Path, gens: int, max_new: int, prompts: list[list[int]]) -> Any:
    from rlbatch.bench.grpo import build_world
    from rlbatch.config.schema import RunConfig, TokenizerSource
    from rlbatch.engine import hf
    from rlbatch.grpo.types import Prompt

    cfg = RunConfig()
    cfg.model.hf_path = str(path)
    cfg.model.tokenizer = TokenizerSource.bytes  # ids in, ids out: PAD / EOS of the byte tokenizer
    cfg.model, _ = hf.resolve_model_config(cfg.model)
    cfg.grpo.num_generations = gens
    cfg.grpo.beta = 0.04
    cfg.rollout.max_new_tokens = max_new
    cfg.data.max_prompt_len = max(400, *(len(p) for p in prompts))
    # the token budgets a user gets (batching.train / batching.infer defaults), raised only
    # where the workload's longest sequence would not fit them
    longest = max(len(p) for p in prompts) + max_new
    cfg.batching.train.max_tokens = max(cfg.batching.train.max_tokens, longest)
    cfg.batching.infer.max_tokens = max(cfg.batching.infer.max_tokens, longest)
    cfg.logging.progress = False
    world = build_world(cfg)
    hf.load_hf_into(world.model, str(path))
    if world.ref is not None:
        hf.load_hf_into(world.ref, str(path))
    world.prompts = [Prompt(index=i, prompt_ids=tuple(p), answer="") for i, p in enumerate(prompts)]
    return world


def rlbatch_step(world: Any, mode: Any, clock: str) -> tuple[dict[str, float], int]:
    """One step as rlbatch-train runs it for this config: rollout, reference pass, the train
    step (on-policy, one iteration: no old-logprob pass, like TRL). ({phase: seconds},
    tokens)."""
    from rlbatch.bench.grpo import Clock, produce_samples, time_train
    from rlbatch.grpo.lcm import old_pass_runs

    n = len(world.prompts)
    args = argparse.Namespace(prompts=n, train_micro=n, rollout_micro=n)
    world.cfg.batching.infer.mode = mode  # the reference pass batched like the train pass
    t0 = _clock(clock)
    samples = produce_samples(world, args, True, Clock(), old_pass_runs(world.cfg))
    t1 = _clock(clock)
    time_train(world, samples, mode, Clock())
    t2 = _clock(clock)
    return {"gen": t1 - t0, "train": t2 - t1}, sum(s.length for s in samples)


SYSTEMS = ("trl", "dynamic", "packed")


def measure(path: Path, name: str, max_new: int, ckpt: bool, repeats: int, clock: str,
            gens: int | None = None) -> dict:  # fmt: skip
    from transformers import TrainerCallback

    from rlbatch.config.schema import BatchingMode

    prompts, default_gens = workload(name)
    gens = gens or default_gens
    world = rlbatch_world(path, gens, max_new, prompts)
    steps: dict[str, list[tuple[dict[str, float], int]]] = {k: [] for k in SYSTEMS}
    prompt_tokens = sum(len(p) for p in prompts) * gens
    trl_gen = [0.0]

    class Interleave(TrainerCallback):  # type: ignore[misc]
        t0 = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            trl_gen[0] = 0.0
            self.t0 = _clock(clock)

        def on_step_end(self, args: Any, state: Any, control: Any, **k: Any) -> None:
            seconds = _clock(clock) - self.t0
            if state.global_step == 1:
                rlbatch_step(world, BatchingMode.dynamic, clock)  # warm-up
                return
            completions = trainer._metrics["train"]["completions/mean_length"][-1]
            tokens = round(prompt_tokens + completions * len(prompts) * gens)
            phases = {"gen": trl_gen[0], "train": seconds - trl_gen[0]}
            steps["trl"].append((phases, tokens))
            for mode in (BatchingMode.dynamic, BatchingMode.packed):
                steps[mode.value].append(rlbatch_step(world, mode, clock))

    with tempfile.TemporaryDirectory() as out:
        trainer = build_trl(
            path, prompts, gens, max_new, ckpt, Path(out), repeats + 1, Interleave()
        )
        generate = trainer._generate_and_score_completions

        def timed_generate(*a: Any, **k: Any) -> Any:
            t0 = _clock(clock)
            result = generate(*a, **k)
            trl_gen[0] += _clock(clock) - t0
            return result

        trainer._generate_and_score_completions = timed_generate
        with contextlib.redirect_stdout(sys.stderr):  # TRL prints its logs on stdout
            trainer.train()
    return summarize(steps)


def summarize(steps: dict[str, list[tuple[dict[str, float], int]]]) -> dict[str, Any]:
    """Median tokens/s of whole steps and median seconds per phase of each system; ratios to
    TRL (tokens/s ratio: > 1 is faster than TRL; phase ratio: seconds over TRL's, < 1 is
    faster)."""
    med = statistics.median
    rates = {k: med(t / sum(p.values()) for p, t in v) for k, v in steps.items()}
    phases = {
        k: {ph: med(p[ph] for p, _ in v) for ph in ("gen", "train")} for k, v in steps.items()
    }
    return {
        "tokens_per_s": rates,
        "phase_seconds": phases,
        "tokens": {k: med(t for _, t in v) for k, v in steps.items()},
        "dynamic_over_trl": rates["dynamic"] / rates["trl"],
        "packed_over_trl": rates["packed"] / rates["trl"],
        "phase_over_trl": {
            k: {ph: phases[k][ph] / phases["trl"][ph] for ph in ("gen", "train")}
            for k in ("dynamic", "packed")
        },
    }


def cells(args: argparse.Namespace) -> list[tuple[str, str, int, int | None]]:
    """(model, workload, completion cap, generations or None = the workload's) to run."""
    out: list[tuple[str, str, int, int | None]] = []
    for model in args.models.split(","):
        if model == "tiny":
            for name in args.workload.split(","):
                caps = [int(x) for x in args.completion_tokens.split(",")]
                out += [("tiny", name, cap, None) for cap in caps]
        else:
            caps = [int(x) for x in args.wide_completion_tokens.split(",")]
            out += [(model, "issue", cap, 2) for cap in caps]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rlbatch.bench.rollout import write_checkpoint

    torch.set_num_threads(args.threads)
    ckpts = {"on": (True,), "off": (False,), "both": (True, False)}[args.trl_ckpt]
    result = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, name, max_new, gens in cells(args):
            path = Path(tmp) / model
            if not path.exists():
                write_checkpoint(model, path, eos_id=EOS, pad_id=PAD)
            for ckpt in ckpts:
                cell = measure(path, name, max_new, ckpt, args.repeats, args.clock, gens)
                result.append({"model": model, "workload": name, "completions": max_new,
                               "trl_gradient_checkpointing": ckpt} | cell)  # fmt: skip
    return {"cells": result, "setup": vars(args)}


def format_report(result: dict[str, Any]) -> str:
    """Tokens/s per system and the phase split (seconds: gen = generation + reference pass,
    train = forward/backward/optimizer) with each phase's ratio to TRL's."""
    lines = [
        "model     workload  max_new ckpt | tok/s trl   dyn  pack  dyn/trl pack/trl |"
        " gen s trl   dyn  pack | train s trl   dyn  pack | gen dyn/trl train dyn/trl"
    ]
    for c in result["cells"]:
        t, ph, r = c["tokens_per_s"], c["phase_seconds"], c["phase_over_trl"]["dynamic"]
        lines.append(
            f"{c['model']:<9} {c['workload']:<9} {c['completions']:>7}"
            f" {'on' if c['trl_gradient_checkpointing'] else 'off':>4} |"
            f" {t['trl']:>9.0f} {t['dynamic']:>5.0f} {t['packed']:>5.0f}"
            f" {c['dynamic_over_trl']:>8.2f} {c['packed_over_trl']:>8.2f} |"
            + "".join(f" {ph[k]['gen']:>{w}.2f}" for k, w in zip(SYSTEMS, (9, 5, 5), strict=True))
            + " |"
            + "".join(
                f" {ph[k]['train']:>{w}.2f}" for k, w in zip(SYSTEMS, (11, 5, 5), strict=True)
            )
            + f" | {r['gen']:>11.2f} {r['train']:>13.2f}"
        )
    return "\n".join(lines)
