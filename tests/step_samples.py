"""Random GRPO samples for the tests that run real optimizer steps: groups of four responses to
one prompt each, random token ids below 250 (inside the tiny models' vocabularies), behaviour
log-probs and advantages; ``off_policy`` adds old and reference log-probs near the behaviour's
(what an old and a reference pass would have stored)."""

from __future__ import annotations

import random

from rlbatch.grpo.types import Prompt, Sample


def random_samples(
    n: int, *, seed: int, max_response: int, off_policy: bool = False
) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p_len, r_len = rng.randint(3, 8), rng.randint(2, max_response)
        beh = [-rng.uniform(3.0, 7.0) for _ in range(r_len)]
        prompt = Prompt(i // 4, tuple(rng.randrange(1, 250) for _ in range(p_len)), "")
        sample = Sample(
            prompt=prompt,
            group_id=i // 4,
            response_ids=[rng.randrange(1, 250) for _ in range(r_len)],
            behaviour_logps=beh,
            truncated=False,
            policy_version=0,
            advantage=rng.uniform(-1.5, 1.5),
        )
        if off_policy:
            sample.old_logps = [b + rng.uniform(-0.3, 0.9) for b in beh]
            sample.ref_logps = [b + rng.uniform(-0.1, 0.1) for b in beh]
        out.append(sample)
    return out
