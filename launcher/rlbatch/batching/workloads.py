"""Synthetic sequence-length workloads for rlbatch-plan and rlbatch-bench.

Each sample is prompt + response tokens. GRPO workloads repeat each prompt ``group_size`` times
contiguously (siblings share the prompt length, responses differ). All draws come from a
``random.Random`` seeded by (workload, seed): the same call gives the same list everywhere.
"""

from __future__ import annotations

import random

from rlbatch.config.schema import Workload

GROUP_SIZE: dict[Workload, int] = {
    Workload.grpo_math: 16,
    Workload.long_cot: 16,
    Workload.bimodal: 8,
    Workload.agentic: 4,
    Workload.uniform: 1,
}
"""Siblings per prompt of each workload (contiguous in the list)."""

MAX_LENGTH: dict[Workload, int] = {
    Workload.grpo_math: 1024 + 8192,
    Workload.long_cot: 1024 + 15000,
    Workload.bimodal: 12288,
    Workload.agentic: 16000,
    Workload.uniform: 4096,
}
"""Longest sample each workload can produce (all fit a 16384-token budget)."""


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(max(rng.lognormvariate(0.0, sigma) * median, lo), hi))


def make_workload(workload: Workload | str, num_samples: int, seed: int = 0) -> list[int]:
    """num_samples sequence lengths (prompt + response) of a synthetic workload.

    grpo_math: prompt ~ lognormal(median 200, sigma 0.6) in [16, 1024], response ~
        lognormal(median 600, sigma 0.9) truncated at 8192; 16 siblings share a prompt.
    long_cot: prompt median 300, response median 4000 (sigma 0.7) truncated at 15000; 16 siblings.
    bimodal: 8 siblings; 70% short answers (median 400), 30% long ones ~ N(7000, 1500) in
        [4096, 11264].
    agentic: 4 siblings; a 300-token system prompt plus 1-12 turns (geometric) of 150-2000
        tokens, capped at 16000.
    uniform: uniform in [64, 4096], no siblings.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples={num_samples} must be >= 0")
    w = Workload(workload)
    rng = random.Random(f"rlbatch-workload:{w.value}:{seed}")
    g = GROUP_SIZE[w]
    out: list[int] = []
    while len(out) < num_samples:
        take = min(g, num_samples - len(out))
        if w == Workload.grpo_math:
            p = _lognormal(rng, 200, 0.6, 16, 1024)
            out.extend(p + _lognormal(rng, 600, 0.9, 1, 8192) for _ in range(take))
        elif w == Workload.long_cot:
            p = _lognormal(rng, 300, 0.5, 32, 1024)
            out.extend(p + _lognormal(rng, 4000, 0.7, 16, 15000) for _ in range(take))
        elif w == Workload.bimodal:
            p = _lognormal(rng, 150, 0.5, 16, 1024)
            for _ in range(take):
                if rng.random() < 0.7:
                    out.append(p + _lognormal(rng, 400, 0.6, 1, 4096))
                else:
                    out.append(p + int(min(max(rng.gauss(7000, 1500), 4096), 11264)))
        elif w == Workload.agentic:
            for _ in range(take):
                total = 300
                turns = 1
                while turns < 12 and rng.random() < 0.75:
                    turns += 1
                for _ in range(turns):
                    total += rng.randint(150, 2000)
                out.append(min(total, 16000))
        else:
            out.extend(rng.randint(64, 4096) for _ in range(take))
    return out
