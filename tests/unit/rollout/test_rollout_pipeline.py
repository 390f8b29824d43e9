"""Generation with pipeline parallelism (pp=2, and pp=2 + vpp=2) under torchrun/gloo equals
single-process generation with the same weights: greedy tokens, sampled tokens (same seed) and
behaviour logprobs. This file is both the pytest test and the torchrun worker (__main__)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

NUM_LAYERS, VOCAB = 4, 264
LENGTHS = [5, 9, 3, 7]


def run_config(pp: int = 1, vpp: int = 1):
    from rlbatch.config.schema import RunConfig

    cfg = RunConfig()
    cfg.model.num_layers = NUM_LAYERS  # pp * vpp = 4 stages of one layer
    cfg.model.init_method_std = 0.3  # peaked logits: greedy choices far from ties
    cfg.parallel.pp, cfg.parallel.vpp = pp, vpp
    return cfg


def build(pp: int = 1, vpp: int = 1):
    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model

    cfg = run_config(pp, vpp)
    parallel.initialize(cfg)
    return build_model(cfg, wrap_ddp=False)


def load_stage(chunk, full: dict) -> None:
    """Copy the full model's weights into a pipeline chunk (global layer = layer_number - 1;
    tied embeddings: the last stage's output layer is the word embedding)."""
    state = {}
    for key in chunk.state_dict():
        if key.startswith("decoder.layers."):
            local = int(key.split(".")[2])
            glob = chunk.decoder.layers[local].layer_number - 1
            src = key.replace(f"decoder.layers.{local}.", f"decoder.layers.{glob}.", 1)
        elif key == "output_layer.weight" and key not in full:
            src = "embedding.word_embeddings.weight"
        else:
            src = key
        state[key] = full[src]
    chunk.load_state_dict(state, strict=True)


def prompts():
    from rlbatch.grpo.types import Prompt

    g = torch.Generator().manual_seed(0)
    return [
        Prompt(
            index=i, prompt_ids=tuple(torch.randint(0, 256, (n,), generator=g).tolist()), answer=""
        )
        for i, n in enumerate(LENGTHS)
    ]


def generate_all(chunks) -> dict:
    from rlbatch.rollout.engines.builtin import MegatronRolloutEngine, SamplingParams

    out = {}
    for name, params, kv in [
        ("greedy_kv", SamplingParams(max_new_tokens=8, eos_id=-1, top_k=1), True),
        ("greedy_recompute", SamplingParams(max_new_tokens=8, eos_id=-1, top_k=1), False),
        ("sampled_kv", SamplingParams(max_new_tokens=8, eos_id=-1, top_k=20), True),
    ]:
        samples = MegatronRolloutEngine(chunks, params, kv_cache=kv).generate(prompts(), 2, 0, 9)
        out[name] = [(s.response_ids, s.behaviour_logps) for s in samples]
    return out


def worker(weights: str, out_dir: str, pp: int, vpps: list[int]) -> None:
    """One launch for every vpp: the same processes re-initialize Megatron's parallel state
    for each layout (parallel.initialize tears the previous one down) and build it anew."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    full = torch.load(weights)
    for vpp in vpps:
        chunks = build(pp, vpp)
        for c in chunks:
            load_stage(c, full)
        result = generate_all(chunks)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if dist.get_rank() == 0:
            torch.save(gathered, os.path.join(out_dir, f"pp{pp}_vpp{vpp}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def workdir():
    """A private temporary directory (pytest's tmp dirs are pruned by concurrent runs)."""
    path = Path(tempfile.mkdtemp(prefix="rlbatch_pp_"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(workdir):
    """Single-process (pp=1) weights and generations, in a subprocess of its own."""
    tmp = workdir
    code = (
        "import sys, torch; sys.argv = ['x']; import test_rollout_pipeline as t;"
        f" t.reference_main({str(tmp)!r})"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp / "weights.pt", torch.load(tmp / "ref.pt")


def reference_main(tmp: str) -> None:
    (model,) = build()
    torch.save(model.state_dict(), os.path.join(tmp, "weights.pt"))
    torch.save(generate_all([model]), os.path.join(tmp, "ref.pt"))


VPPS = [1, 2]


@pytest.fixture(scope="module")
def launched(reference, workdir):
    """pp=2 with each vpp of VPPS, in one torchrun launch of two processes (a launch per layout
    repeated the workers' start: Megatron's import and the process group, ~10 s each)."""
    weights, _ = reference
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--standalone", __file__, str(weights), str(workdir), "2", ",".join(map(str, VPPS))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return workdir


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("vpp", VPPS)
def test_pipeline_generation_equals_single_process(reference, launched, vpp):
    _, ref = reference
    per_rank = torch.load(launched / f"pp2_vpp{vpp}.pt")
    for rank_result in per_rank:  # every pipeline rank returns the same samples
        for name, samples in ref.items():
            got = rank_result[name]
            assert [ids for ids, _ in got] == [ids for ids, _ in samples], name
            for (_, lp_got), (_, lp_ref) in zip(got, samples, strict=True):
                assert lp_got == pytest.approx(lp_ref, abs=1e-4)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(v) for v in sys.argv[4].split(",")])
