"""model.hf_path as a hub id through the real rlbatch-logprobs: offline with an empty cache it
is a configuration error naming the id and how to pre-download it; with a cache laid out like
the hub's (models--org--name/refs/main -> snapshots/<rev>/) it runs offline and matches
transformers."""

from __future__ import annotations

import json
import subprocess

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

from hf_reference import reference_logps, save_tiny  # noqa: E402

pytestmark = pytest.mark.e2e

REPO_ID = "tiny-org/tiny-qwen3"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _logprobs(bin_dir, env, cwd, cache):
    env = {**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cwd / "h")}
    (cwd / "in.jsonl").write_text(json.dumps({"input_ids": list(range(3, 40))}) + "\n")
    cmd = [
        str(bin_dir / "rlbatch-logprobs"), f"model.hf_path={REPO_ID}",
        f"logprobs.input={cwd / 'in.jsonl'}", f"logprobs.output={cwd / 'out.jsonl'}",
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_offline_empty_cache_is_a_config_error(tmp_path, bin_dir, subprocess_env):
    proc = _logprobs(bin_dir, subprocess_env, tmp_path, tmp_path / "empty-cache")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "model.hf_path" in proc.stderr and REPO_ID in proc.stderr
    assert f"huggingface-cli download {REPO_ID}" in " ".join(proc.stderr.split())


def test_offline_cached_hub_id_runs(tmp_path, bin_dir, subprocess_env):
    cache = tmp_path / "hub"
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    ref = save_tiny(repo / "snapshots" / REVISION, "qwen3")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    proc = _logprobs(bin_dir, subprocess_env, tmp_path, cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "out.jsonl").read_text())["token_logprobs"]
    assert got == pytest.approx(reference_logps(ref, list(range(3, 40))), abs=1e-4)
