"""The vllm extra's install path (pyproject's extra, then removing the CUDA builds of
torchvision / torchaudio / torchcodec it pulls, as README and .ci/run do) leaves transformers
working: its model classes import in a fresh interpreter, beside vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.optional_extra


@pytest.mark.slow  # a fresh interpreter imports vLLM (7-22 s) and transformers
def test_transformers_model_classes_import_beside_vllm():
    pytest.importorskip("vllm")
    code = (
        "import vllm\n"
        "from transformers import Qwen2Config, Qwen2ForCausalLM\n"
        "Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64,"
        " num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ci_installs_the_extra_and_removes_the_broken_packages():
    ci = (REPO / ".ci" / "run").read_text()
    assert "-e '.[vllm]'" in ci
    assert "pip uninstall -y torchvision torchaudio torchcodec" in ci
