"""rollout.backend=vllm with LoRA in bf16: an adapter update smaller than a bf16 step of the
weights reaches the vLLM engine (tests/lora_bf16.py), because vLLM receives the adapters
themselves (its own LoRA) rather than weights merged and rounded to bf16.

The measurement starts its own vLLM engine, so it runs in a fresh interpreter (vLLM keeps
process-wide state: one engine per process, and this process may hold another module's).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.optional_extra, pytest.mark.slow]  # bf16 policy + vLLM start: ~2 min

MEASURE = (
    "import dataclasses, json, lora_bf16\n"
    "print('GAP ' + json.dumps(dataclasses.asdict(lora_bf16.vllm_gap())), flush=True)\n"
)


def test_bf16_vllm_engine_samples_adapter_updates_smaller_than_a_bf16_step():
    """After an adapter-only update of rms 1e-5 (under half the bf16 step of every adapted
    weight entry), vLLM's behaviour log-probs equal the trainer's bf16 forward within the
    noise of two bf16 kernels (the same comparison with the adapters off), instead of lagging
    by the update's whole effect as an engine fed bf16-merged weights does."""
    pytest.importorskip("vllm")
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE],
        cwd=REPO / "tests",
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("GAP "))
    gap = json.loads(line[4:])
    assert gap["effect"] > 1e-3, gap  # the trainer's forward sees the update
    assert abs(gap["mean_gap"]) < 0.35 * gap["effect"], gap  # merged bf16: mean gap ~ -effect
    assert gap["max_gap"] < 2 * gap["max_noise"], gap  # per token: bf16 noise of two kernels
