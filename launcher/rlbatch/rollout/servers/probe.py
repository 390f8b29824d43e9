"""The check after every weight sync to the rollout servers: do they hold the trainer's weights
of this sync, not another model's and not an earlier sync's?

Every server scores one fixed sequence (a fixed prompt and fixed continuation tokens, its
prompt log-probabilities) and samples one token after it; the trainer scores the same tokens
with its own forward. Two checks:

- tolerance: every log-probability within ``rollout.servers.probe_tolerance`` of the trainer's
  (another model, dtype or a garbled update is off by far more);
- version: one optimizer step may move these log-probabilities by less than that tolerance
  (about 5e-4 at a learning rate of 1e-5, 5e-5 at 1e-6, on the tiny model), so a server one
  sync behind would pass it. The fixed tokens are the same at every sync, so the trainer keeps
  its log-probabilities of the previous sync: the server's must be closer to the current ones
  than to the previous ones by at least half of what the step moved them. When the step moved
  them less than the engine's numeric noise (:data:`NOISE`, by the engine's dtype, four times
  over), the two versions cannot be told apart by their outputs, and the probe checks the
  tolerance alone and says so in the log (with how far they moved); the sync's label, which
  the server takes only at the end of a complete update, is then the only witness.

The pure comparison is :func:`judge_probe`; rlbatch.rollout.servers.backend asks the servers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlbatch.config.dtypes import PROBE_NOISE

PROBE_PROMPT = (3, 14, 15, 92, 65, 35, 89, 79)
"""The probe's prompt (ids below every vocabulary rlbatch trains)."""
NOISE = PROBE_NOISE
"""The engine's numeric noise by its dtype (rlbatch.config.vllm.PROBE_NOISE)."""
SEPARATION = 4.0
"""A step must move the probe's log-probabilities by this many times the noise for the probe
to tell the two versions apart."""


def probe_length(num_tokens: int) -> int:
    """The longest sequence the probe of ``num_tokens`` fixed tokens asks a server to hold: its
    prompt, the fixed tokens and the one token sampled after them."""
    return len(PROBE_PROMPT) + num_tokens + 1


def probe_sequence(num_tokens: int, vocab_size: int) -> tuple[list[int], int]:
    """The fixed sequence (prompt + ``num_tokens`` fixed continuation tokens, every id below
    ``vocab_size``) and the prompt's length."""
    prompt = [t % vocab_size for t in PROBE_PROMPT]
    tail = [(7 * i + 11) % vocab_size for i in range(num_tokens)]
    return prompt + tail, len(prompt)


@dataclass(frozen=True)
class ProbeVerdict:
    off: float
    """Largest difference from the trainer's current log-probabilities."""
    moved: Optional[float]
    """Largest move of the trainer's log-probabilities since the previous sync (None: none)."""
    behind: bool
    """The server is closer to the previous sync's log-probabilities than the margin allows."""
    off_previous: Optional[float] = None
    undecided: bool = False
    """The step moved the log-probabilities too little to tell the versions apart."""


def _gap(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def judge_probe(
    server: list[float], current: list[float], previous: Optional[list[float]], noise: float
) -> ProbeVerdict:
    """Compare a server's log-probabilities of the fixed tokens with the trainer's current ones
    and (when there was a previous sync) the previous ones."""
    off = _gap(server, current)
    if previous is None:
        return ProbeVerdict(off, None, False)
    moved = _gap(current, previous)
    off_previous = _gap(server, previous)
    if moved <= SEPARATION * noise:  # the versions are within the engine's noise
        return ProbeVerdict(off, moved, False, off_previous, undecided=True)
    return ProbeVerdict(off, moved, off_previous - off < moved / 2, off_previous)
