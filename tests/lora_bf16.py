"""bf16 LoRA: do the rollout engines see an adapter update smaller than a bf16 step?

A bf16 policy (hidden 512, 2 layers, heads of 32) with rank-8 adapters on every projection,
its adapted base weights kept at |W| >= 2^-6 (their bf16 step, 2^-13 = 1.2e-4, is then over
twice every entry of the update, as for most entries of a pretrained model), takes one
adapter-only update: B = c * sign(d/dB of the log-probs of some sequences), c such that
scale * B @ A has rms 1e-5 in every adapted linear (a policy-gradient step that raises those
tokens, the size of an Adam step at lr 1e-5). Then on those tokens:

- ``effect``: mean(trainer - trainer with adapters off): what the update does to the trainer's
  log-probs (megatron's forward, the adapters applied unmerged, as in training);
- ``gap``: mean and largest |engine - trainer|: an engine that lost the update is off by about
  ``effect`` on average;
- ``noise``: the same with adapters off (both sides the base model): bf16 rounding of two
  different kernels, the floor an exact engine sits on.

Run as a script for the figures (docs/lora.md), engine ``builtin`` or ``vllm``:

    python tests/lora_bf16.py builtin
    python tests/lora_bf16.py vllm        # needs the vllm extra; one engine per process
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

HIDDEN = 512
RANK = 8
UPDATE_RMS = 1e-5
WEIGHT_FLOOR = 2.0**-6
TEMPERATURE = 1.0
PROMPT_LEN = 16
NUM_ROWS = 8
RESPONSE_LEN = 32


@dataclass(frozen=True)
class Gap:
    effect: float
    """mean(trainer - trainer with adapters off) over the tokens."""
    mean_gap: float
    """mean(engine - trainer): the engine's bias (about -effect for an engine that lost it)."""
    max_gap: float
    """max |engine - trainer|."""
    mean_noise: float
    """mean(engine - trainer) with adapters off: the base model on both sides."""
    max_noise: float
    """max |engine - trainer| with adapters off."""
    tokens: int

    def __str__(self) -> str:
        return (
            f"tokens {self.tokens}: update effect {self.effect:+.2e}; engine - trainer mean "
            f"{self.mean_gap:+.2e}, max |.| {self.max_gap:.2e}; adapters off (bf16 noise): "
            f"mean {self.mean_noise:+.2e}, max |.| {self.max_noise:.2e}"
        )


def bf16_config(backend: str = "megatron") -> Any:
    from rlbatch.config.schema import Dtype, RolloutBackend, RunConfig

    cfg = RunConfig()
    m = cfg.model
    m.hidden_size, m.ffn_hidden_size = HIDDEN, HIDDEN * 11 // 4
    m.num_attention_heads = m.num_query_groups = HIDDEN // 32
    m.params_dtype = Dtype.bf16
    m.lora = replace(m.lora, rank=RANK)
    cfg.rollout.backend = RolloutBackend(backend)
    cfg.rollout.temperature = TEMPERATURE
    cfg.rollout.max_new_tokens = RESPONSE_LEN
    cfg.data.max_prompt_len = PROMPT_LEN
    cfg.grpo.num_generations = 1
    return cfg


def build_policy(cfg: Any) -> Any:
    """The bf16 adapted policy (forward only: bf16 does not train on CPU), base weights of the
    adapted linears at |W| >= WEIGHT_FLOOR."""
    from rlbatch.engine import lora, parallel
    from rlbatch.engine.model import build_model

    if not parallel.is_initialized():
        parallel.initialize(cfg)
    parallel.seed(0)
    (chunk,) = build_model(cfg, wrap_ddp=False)
    with torch.no_grad():
        for _, _, linear in lora.branches([chunk]):
            w = linear.weight
            w.copy_(w.sign() * w.abs().clamp(min=WEIGHT_FLOOR))
    return chunk


def prompts(seed: int = 1) -> list[Any]:
    from rlbatch.grpo.types import Prompt

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 256, (NUM_ROWS, PROMPT_LEN), generator=g).tolist()
    return [Prompt(index=i, prompt_ids=tuple(row), answer="") for i, row in enumerate(ids)]


def update_adapters(chunk: Any, samples: list[Any]) -> None:
    """One adapter-only update that raises the log-probs of ``samples``' responses: B = c *
    sign(gradient) with rms(scale * B @ A) = UPDATE_RMS in every adapted linear."""
    from rlbatch.engine import lora

    chunk.eval()
    for s in samples:
        ids = list(s.prompt.prompt_ids) + list(s.response_ids)
        n = len(ids)
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
        logits = chunk(torch.tensor([ids]), torch.arange(n)[None], mask)[0].float()
        start = len(s.prompt.prompt_ids) - 1
        resp = torch.tensor(s.response_ids)
        logp = torch.log_softmax(logits / TEMPERATURE, -1)[start : start + len(resp)]
        logp.gather(1, resp[:, None]).sum().backward()
    with torch.no_grad():
        for _, _, linear in lora.branches([chunk]):
            branch = linear.lora
            for b in branch.lora_B.values():
                b.copy_(b.grad.float().sign())
                b.grad = None
            rms = branch.delta_weight().pow(2).mean().sqrt()
            for b in branch.lora_B.values():
                b.mul_(UPDATE_RMS / rms)


def trainer_logps(chunk: Any, cfg: Any, samples: list[Any]) -> list[list[float]]:
    from rlbatch.grpo.stages import make_logps_fn

    return make_logps_fn([chunk], cfg)(samples)


def _diffs(a: list[list[float]], b: list[list[float]]) -> torch.Tensor:
    return torch.tensor(
        [x - y for r, q in zip(a, b, strict=True) for x, y in zip(r, q, strict=True)]
    )


def measure(cfg: Any, chunk: Any, engine: Any) -> Gap:
    """Sample from the base (adapters at B = 0), update the adapters on those samples, sample
    again (a new policy version, same seed) and compare the engine's behaviour log-probs with
    the trainer's forward, with the adapters on and off."""
    from rlbatch.engine import lora

    rows = prompts()
    update_adapters(chunk, engine.generate(rows, 1, policy_version=0, seed=5))
    samples = engine.generate(rows, 1, policy_version=1, seed=5)
    engine_lp = [s.behaviour_logps for s in samples]
    trainer = trainer_logps(chunk, cfg, samples)
    with lora.adapters_disabled([chunk]):
        base = trainer_logps(chunk, cfg, samples)
        base_samples = engine.generate(rows, 1, policy_version=2, seed=5)
        noise = _diffs(
            [s.behaviour_logps for s in base_samples], trainer_logps(chunk, cfg, base_samples)
        )
    gap = _diffs(engine_lp, trainer)
    return Gap(
        effect=_diffs(trainer, base).mean().item(),
        mean_gap=gap.mean().item(),
        max_gap=gap.abs().max().item(),
        mean_noise=noise.mean().item(),
        max_noise=noise.abs().max().item(),
        tokens=gap.numel(),
    )


def builtin_gap() -> Gap:
    from rlbatch.rollout.engines.builtin import MegatronRolloutEngine
    from rlbatch.rollout.sampling import SamplingParams

    cfg = bf16_config()
    chunk = build_policy(cfg)
    params = SamplingParams(max_new_tokens=RESPONSE_LEN, eos_id=-1, temperature=TEMPERATURE)
    return measure(cfg, chunk, MegatronRolloutEngine([chunk], params))


def vllm_gap() -> Gap:
    """Needs the vllm extra, and a process without another vLLM engine."""
    from rlbatch.rollout.engines.builtin import build_rollout_engine

    cfg = bf16_config("vllm")
    chunk = build_policy(cfg)
    engine = build_rollout_engine(cfg, [chunk], eos_id=1, pad_id=0)  # vLLM wants a vocabulary id
    return measure(cfg, chunk, engine)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "builtin"
    print(f"{which}: {builtin_gap() if which == 'builtin' else vllm_gap()}")
