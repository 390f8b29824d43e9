"""Every response of a run ends at one of the run's end ids, for every architecture rlbatch
supports on the built-in engine and on vLLM, through the real rlbatch-train with
logging.samples: a response that is not truncated ends with the tokenizer's EOS (258 for the
byte tokenizer). A Llama policy on vLLM used to stop at id 2 as well (transformers' LlamaConfig
default EOS, taken because the engine's config.json had none), a response cut short without
being marked truncated."""

from __future__ import annotations

import json
import subprocess

import pytest

from rlbatch.engine.tokenizer import ByteTokenizer

pytestmark = pytest.mark.e2e

VLLM = [pytest.mark.optional_extra, pytest.mark.slow]
CASES = [
    ("qwen2", "megatron"),
    ("qwen3", "megatron"),
    ("llama", "megatron"),
    # on vLLM the architecture decides only what the engine's config.json says (the stop ids
    # are the same request field for all): llama is the one whose defaults differ (EOS 2), and
    # tests/unit/rollout/test_vllm_model_dir.py reads every architecture's directory back
    pytest.param("llama", "vllm", marks=VLLM),
]


def _stopped_ends(run_dir):
    """(last token of every response not truncated, number of responses)."""
    ends, total = [], 0
    for path in sorted((run_dir / "samples").glob("step_*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            total += 1
            if not record["truncated"]:
                ends.append(record["response_ids"][-1])
    return ends, total


@pytest.mark.parametrize(("arch", "backend"), CASES)
def test_every_stopped_response_ends_with_the_tokenizers_eos(
    bin_dir, subprocess_env, tmp_path, arch, backend
):
    if backend == "vllm":
        pytest.importorskip("vllm")
    run_dir = tmp_path / "run"
    bias = [] if arch == "qwen2" else ["model.add_qkv_bias=false"]
    bias += ["model.qk_layernorm=true"] if arch == "qwen3" else []
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_qwen", f"model.architecture={arch}",
         *bias, "model.num_attention_heads=2", "model.num_query_groups=2",
         f"rollout.backend={backend}", "logging.samples=true", "trainer.max_steps=2",
         f"hydra.run.dir={run_dir}", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ends, total = _stopped_ends(run_dir)
    assert total == 128 and len(ends) >= 3  # the random-init policy stops a few of them
    assert set(ends) == {ByteTokenizer.EOS}, f"stopped at {sorted(set(ends))}"
