"""The engine on gloo: pp=2, pp=2+vpp=2 (5 micro-batches, N=3), tp=2, tp=2 with sequence
parallelism, dp=2 and dp=2 with the distributed optimizer, each compared with a single-process run on the same data (losses,
gradients, an optimizer step, logprobs; rel 1e-5) and generation (same seeded samples). One
2-process launch runs the six layouts one after the other (megatron's parallel state
re-initialised for each: a launch per layout repeated the workers' start, megatron's import
and the process group); rlbatch.distributed is checked inside it too."""

from __future__ import annotations

import sys
from pathlib import Path

import megatron.core  # noqa: F401
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from dist_launch import run_torchrun  # noqa: E402
from engine_case import MICRO_BATCHES, make_cfg, run_case  # noqa: E402

pytestmark = pytest.mark.dist
MODES = ["pp2", "vpp", "tp2", "tp2sp", "dp2", "dp2do"]
REF_MICRO_BATCHES = {"pp2": 3, "vpp": 5, "tp2": 3, "tp2sp": 3, "dp2": 6, "dp2do": 6}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The shared initial weights: a random tiny model exported by rlbatch (single process)."""
    from rlbatch.engine import hf, parallel
    from rlbatch.engine import model as engine_model

    cfg = make_cfg()
    if not parallel.is_initialized():
        parallel.initialize(cfg)
    parallel.seed(7)
    chunks = engine_model.build_model(cfg, wrap_ddp=False)
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in chunks[0].named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("engine") / "hf"
    hf.export_hf(chunks, cfg.model, out)
    return out


@pytest.fixture(scope="module")
def references(hf_dir):
    cfg = make_cfg(hf_path=str(hf_dir))
    return {
        n: run_case(cfg, MICRO_BATCHES[:n], step=(n in (3, 6)))
        for n in sorted(set(REF_MICRO_BATCHES.values()))
    }


@pytest.fixture(scope="module")
def launched_all(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    run_torchrun("engine_worker.py", 2, [",".join(MODES), str(hf_dir), str(out)], timeout=900)
    return out


@pytest.fixture(scope="module", params=MODES)
def launched(request, launched_all):
    out = launched_all / request.param
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return request.param, ranks, out


def _all_tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a HF directory, one file or shards (read by safetensors itself)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def test_export_from_split_model_reproduces_checkpoint(launched, hf_dir):
    _, _, out = launched
    exported = _all_tensors(out / "export")
    original = _all_tensors(hf_dir)
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _close_dicts(got: dict, ref: dict, tol: float = 1e-5, per_tensor_tol: float = 1e-4) -> None:
    """The whole vector within rel ``tol`` (fp32 reductions are reordered by tp / pp / dp), and
    every tensor within ``per_tensor_tol``."""
    assert set(got) == set(ref)
    flat = [torch.cat([d[k].double().reshape(-1) for k in sorted(ref)]) for d in (got, ref)]
    assert _rel(*flat) <= tol
    bad = {k: _rel(got[k].double(), ref[k].double()) for k in ref}
    bad = {k: v for k, v in bad.items() if v > per_tensor_tol}
    assert not bad


def test_matches_single_process(launched, references):
    mode, ranks, _ = launched
    ref = references[REF_MICRO_BATCHES[mode]]
    rank0 = ranks[0]
    if mode in ("dp2", "dp2do"):
        losses = ranks[0]["losses"] + ranks[1]["losses"]
    else:  # the last pipeline stage holds the losses
        losses = ranks[-1]["losses"] if mode in ("pp2", "vpp") else rank0["losses"]
    assert losses == pytest.approx(ref["losses"], rel=1e-5)
    if mode != "dp2do":  # the distributed optimizer reduce-scatters: each rank has its shard
        _close_dicts(rank0["grads"], ref["grads"])
    if "params_after_step" in ref and "params_after_step" in rank0:
        assert rank0["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        _close_dicts(rank0["params_after_step"], ref["params_after_step"])
    for r in ranks:  # generation: the same tokens, logprobs within fp32 reordering
        assert [ids for ids, _ in r["rollout"]] == [ids for ids, _ in ref["rollout"]]
        for (_, got), (_, want) in zip(r["rollout"], ref["rollout"], strict=True):
            assert got == pytest.approx(want, abs=1e-5)
    for r in ranks:  # logprobs on every rank, in sample order
        for got, want in zip(r["logprobs"], ref["logprobs"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        for got, want in zip(r["entropy"], ref["entropy"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_chunked_projection_equals_unchunked(launched, references):
    """model.logits_chunk_tokens: the default, 3 and 0 (full logits) give the same losses,
    gradients (the tied embedding included), logprobs and entropies on every layout, and in
    the single-process reference (fp32, rel 1e-6; each tensor's gradient within rel 1e-5: a
    few, like the key biases', are sums that cancel to near zero)."""
    mode, ranks, _ = launched
    loss_rank = -1 if mode in ("pp2", "vpp") else 0
    for r in [ranks[0], ranks[loss_rank], references[REF_MICRO_BATCHES[mode]]]:
        full = r["by_chunk"][0]
        for variant in (r, r["by_chunk"][3]):
            assert variant["losses"] == pytest.approx(full["losses"], rel=1e-6)
            if mode != "dp2do" and full["grads"]:
                _close_dicts(variant["grads"], full["grads"], tol=1e-6, per_tensor_tol=1e-5)
            for key in ("logprobs", "entropy"):
                for got, want in zip(variant[key], full[key], strict=True):
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_layout_and_distributed_helpers(launched):
    mode, ranks, _ = launched
    states = [r["state"] for r in ranks]
    sizes = {"pp2": (1, 2, 1, 1), "vpp": (1, 2, 2, 1), "tp2": (2, 1, 1, 1), "dp2": (1, 1, 1, 2)}
    sizes["tp2sp"], sizes["dp2do"] = sizes["tp2"], sizes["dp2"]
    assert all((s.tp, s.pp, s.vpp, s.dp) == sizes[mode] for s in states)
    # sequence parallel trains with it (norm weights marked for the TP all-reduce) and is
    # back on after generation switched it off
    assert all(r["sequence_parallel"] == [mode == "tp2sp"] * 2 for r in ranks)
    if mode == "vpp":  # the batch_p2p_comm trap: batched p2p is silently wrong with pp=2
        assert all(r["p2p"] == {"overlap_p2p_comm": True, "batch_p2p_comm": False} for r in ranks)
    for r in ranks:
        d = r["distributed"]
        assert d["all_reduce_sum"] == ([3.0, 6.0], 8.0, 6.0)
        assert "rank 1 disagree" in d["check_same"] and "the step plan" in d["check_same"]
        if mode in ("dp2", "dp2do"):
            assert d["dp_sum"] == [2.0, 1.0]
        if mode == "pp2":
            assert d["broadcast"] == [10.0, 11.0, 12.0, 13.0]
            assert d["reduce_step"] == [5.5, 5.5]
