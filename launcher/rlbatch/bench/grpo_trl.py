"""rlbatch-bench grpo --against trl: one GRPO step of TRL's GRPOTrainer and of rlbatch on the
same Hugging Face checkpoint, interleaved in one process (needs the ``bench`` extra: trl).

    rlbatch-bench grpo --against trl [--completion-tokens 64,256] [--workload issue,longtail]
                                     [--repeats 3] [--clock cpu|wall] [--json]

Setup: the tiny Qwen2 of ``rlbatch-bench rollout`` (vocab 512, hidden 128, 4 layers, 4 heads /
2 KV heads, tied; random weights written by transformers); fp32; beta 0.04 (the reference pass
runs); temperature 1. Workloads: ``issue`` = 2 prompts of 4 tokens x 8 generations;
``longtail`` = 8 prompts x 4 generations with prompt lengths 8-400 (most short). EOS is a real
token, so a few completions end before the cap. A step is timed from TRL's ``on_step_begin`` to
``on_step_end`` (generation, reference logprobs, loss, backward, optimizer step); between two
TRL steps one rlbatch step runs with dynamic and one with packed batching of the reference and
train passes (batching.infer.mode and batching.train.mode; rollout,
reference logprobs, train step: what rlbatch-train runs for this on-policy config, so no
old-logprob pass). Tokens/s = (prompt + completion tokens) / seconds.
TRL runs with and without gradient checkpointing (its default is on).
"""

from __future__ import annotations

import argparse
import contextlib
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
        processing_class=trl_tokenizer(512),
        callbacks=[callback],
    )


def _clock(kind: str) -> float:
    return time.process_time() if kind == "cpu" else time.perf_counter()


def rlbatch_world(path: Path, gens: int, max_new: int, prompts: list[list[int]]) -> Any:
    from rlbatch.bench.grpo import build_world
    from rlbatch.config.schema import RunConfig
    from rlbatch.engine import hf
    from rlbatch.grpo.types import Prompt

    cfg = RunConfig()
    cfg.model.hf_path = str(path)
    cfg.model, _ = hf.resolve_model_config(cfg.model)
    cfg.grpo.num_generations = gens
    cfg.grpo.beta = 0.04
    cfg.rollout.max_new_tokens = max_new
    cfg.data.max_prompt_len = max(400, *(len(p) for p in prompts))
    longest = cfg.data.max_prompt_len + max_new
    cfg.batching.train.max_tokens = max(2048, longest)
    cfg.batching.infer.max_tokens = max(4096, longest)
    cfg.logging.progress = False
    world = build_world(cfg)
    hf.load_hf_into(world.model, str(path))
    if world.ref is not None:
        hf.load_hf_into(world.ref, str(path))
    world.prompts = [Prompt(index=i, prompt_ids=tuple(p), answer="") for i, p in enumerate(prompts)]
    return world


def rlbatch_step(world: Any, mode: Any, clock: str) -> tuple[float, int]:
    """One step as rlbatch-train runs it for this config: rollout, reference pass, the train
    step (on-policy, one iteration: no old-logprob pass, like TRL)."""
    from rlbatch.bench.grpo import Clock, produce_samples, time_train
    from rlbatch.grpo.lcm import old_pass_runs

    n = len(world.prompts)
    args = argparse.Namespace(prompts=n, train_micro=n, rollout_micro=n)
    world.cfg.batching.infer.mode = mode  # the reference pass batched like the train pass
    t0 = _clock(clock)
    samples = produce_samples(world, args, True, Clock(), old_pass_runs(world.cfg))
    time_train(world, samples, mode, Clock())
    return _clock(clock) - t0, sum(s.length for s in samples)


def measure(path: Path, name: str, max_new: int, ckpt: bool, repeats: int, clock: str) -> dict:
    from transformers import TrainerCallback

    from rlbatch.config.schema import BatchingMode

    prompts, gens = workload(name)
    world = rlbatch_world(path, gens, max_new, prompts)
    rates: dict[str, list[float]] = {"trl": [], "dynamic": [], "packed": []}
    prompt_tokens = sum(len(p) for p in prompts) * gens

    class Interleave(TrainerCallback):  # type: ignore[misc]
        t0 = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = _clock(clock)

        def on_step_end(self, args: Any, state: Any, control: Any, **k: Any) -> None:
            seconds = _clock(clock) - self.t0
            if state.global_step == 1:
                rlbatch_step(world, BatchingMode.dynamic, clock)  # warm-up
                return
            completions = trainer._metrics["train"]["completions/mean_length"][-1]
            rates["trl"].append((prompt_tokens + completions * len(prompts) * gens) / seconds)
            for mode in (BatchingMode.dynamic, BatchingMode.packed):
                secs, tokens = rlbatch_step(world, mode, clock)
                rates[mode.value].append(tokens / secs)

    with tempfile.TemporaryDirectory() as out:
        trainer = build_trl(
            path, prompts, gens, max_new, ckpt, Path(out), repeats + 1, Interleave()
        )
        with contextlib.redirect_stdout(sys.stderr):  # TRL prints its logs on stdout
            trainer.train()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"tokens_per_s": med, "dynamic_over_trl": med["dynamic"] / med["trl"],
            "packed_over_trl": med["packed"] / med["trl"]}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rlbatch.bench.rollout import write_checkpoint

    torch.set_num_threads(args.threads)
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny"
        write_checkpoint("tiny", path, eos_id=EOS, pad_id=PAD)
        for name in args.workload.split(","):
            for max_new in [int(x) for x in args.completion_tokens.split(",")]:
                for ckpt in (True, False):
                    cell = measure(path, name, max_new, ckpt, args.repeats, args.clock)
                    cells.append({"workload": name, "completions": max_new,
                                  "trl_gradient_checkpointing": ckpt} | cell)  # fmt: skip
    return {"cells": cells, "setup": vars(args)}


def format_report(result: dict[str, Any]) -> str:
    lines = [
        "workload  max_new  trl ckpt  trl tok/s  dynamic tok/s  packed tok/s  dyn/trl  pack/trl"
    ]
    for c in result["cells"]:
        t = c["tokens_per_s"]
        lines.append(
            f"{c['workload']:<9} {c['completions']:>7} {str(c['trl_gradient_checkpointing']):>9}"
            f" {t['trl']:>10.0f} {t['dynamic']:>14.0f} {t['packed']:>13.0f}"
            f" {c['dynamic_over_trl']:>8.2f} {c['packed_over_trl']:>9.2f}"
        )
    return "\n".join(lines)
