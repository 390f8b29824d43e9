"""LoRA under tensor and pipeline parallelism on gloo: tp 2, tp 2 with sequence parallelism and
pp 2 (one 2-process launch) each equal a single-process run from the same base weights and
adapters: losses, every adapter's gradient, an optimizer step, logprobs with the adapters on
and off (the reference policy), and the chunked output projection (rel 1e-5)."""

from __future__ import annotations

import sys
from pathlib import Path

import megatron.core  # noqa: F401
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from dist_launch import run_torchrun  # noqa: E402
from engine_case import MICRO_BATCHES, make_cfg  # noqa: E402
from lora_case import lora_cfg, run_lora_case  # noqa: E402

pytestmark = pytest.mark.dist
LAYOUTS = ("tp2", "tp2sp", "pp2")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Base weights (a random tiny model exported by rlbatch) and random full adapters."""
    from rlbatch.engine import hf, lora, parallel
    from rlbatch.engine import model as engine_model

    out = tmp_path_factory.mktemp("lora")
    cfg = lora_cfg()
    if not parallel.is_initialized():
        parallel.initialize(cfg)
    parallel.seed(7)
    base = engine_model.build_model(make_cfg(), wrap_ddp=False)
    hf.export_hf(base, cfg.model, out / "hf")
    adapted = engine_model.build_model(cfg, wrap_ddp=False)
    g = torch.Generator().manual_seed(9)
    adapters = {
        k: 0.1 * torch.randn(v.shape, generator=g) for k, v in lora.full_adapters(adapted).items()
    }
    torch.save(adapters, out / "adapters.pt")
    return out / "hf", out / "adapters.pt", adapters


@pytest.fixture(scope="module")
def reference(inputs):
    hf_dir, _, adapters = inputs
    return run_lora_case(lora_cfg(hf_path=str(hf_dir)), MICRO_BATCHES[:3], adapters)


@pytest.fixture(scope="module")
def launched(inputs, tmp_path_factory):
    hf_dir, adapters_file, _ = inputs
    out = tmp_path_factory.mktemp("lora_runs")
    run_torchrun("lora_worker.py", 2, [str(hf_dir), str(adapters_file), str(out)], timeout=600)
    runs = {
        (name, r): torch.load(out / f"{name}_rank{r}.pt", weights_only=False)
        for name in LAYOUTS
        for r in range(2)
    }
    return runs, out


def _rel(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    flat = [torch.cat([d[k].double().reshape(-1) for k in sorted(want)]) for d in (got, want)]
    return ((flat[0] - flat[1]).norm() / flat[1].norm()).item()


def _worst(got: dict, want: dict) -> list:
    rel = {k: ((got[k] - want[k]).norm() / want[k].norm()).item() for k in want}
    return sorted(rel.items(), key=lambda kv: -kv[1])[:4]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_single_process(launched, reference, layout):
    ref, (launched, _) = reference, launched
    n_adapters = 4 * 7 * 2  # layers x projections x (A, B)
    assert len(ref["grads_1024"]) == n_adapters
    assert all(ref["grads_1024"][k].abs().sum() > 0 for k in ref["grads_1024"])
    for r in range(2):
        got = launched[(layout, r)]
        losses = launched[(layout, 1)]["losses_1024"] if layout == "pp2" else got["losses_1024"]
        assert losses == pytest.approx(ref["losses_1024"], rel=1e-5)
        for key in ("grads_1024", "grads_3"):
            assert _rel(got[key], ref[key]) < 1e-5, (key, _worst(got[key], ref[key]))
        # Adam's first step divides each gradient entry by its own magnitude: entries near
        # zero carry their fp32 reordering noise into the update
        assert _rel(got["after_step"], ref["after_step"]) < 1e-4, _worst(
            got["after_step"], ref["after_step"]
        )
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        for key in ("logprobs", "base_logprobs"):
            for a, b in zip(got[key], ref[key], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_chunked_output_and_reference_policy(reference):
    """The chunked output projection leaves losses and adapter gradients unchanged; the
    adapters move the log-probs and switching them off gives the base model's."""
    ref = reference
    assert ref["losses_3"] == pytest.approx(ref["losses_1024"], rel=1e-6)
    assert _rel(ref["grads_3"], ref["grads_1024"]) < 1e-6
    pairs = zip(ref["logprobs"], ref["base_logprobs"], strict=True)
    diff = max((a - b).abs().max().item() for a, b in pairs if a.numel())
    assert diff > 1e-2


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_adapter_checkpoint_loads_in_one_process(launched, inputs, layout):
    """The checkpoint saved at tp 2 (adapters split along B or A) or pp 2 holds the adapters
    and their optimizer state only, and loads in a single process bit-exactly: every adapter
    equals the saved run's after its step, the Adam moments of every adapter are restored."""
    from torch.distributed.checkpoint import FileSystemReader

    from rlbatch.engine import hf, lora
    from rlbatch.engine import model as engine_model
    from rlbatch.engine.dist_checkpoint import load_sharded

    runs, out = launched
    hf_dir, _, _ = inputs
    keys = list(FileSystemReader(str(out / f"ckpt_{layout}")).read_metadata().state_dict_metadata)
    assert keys and all(".lora.lora_" in k for k in keys), [k for k in keys if ".lora." not in k]
    cfg = lora_cfg(hf_path=str(hf_dir))
    chunks = engine_model.build_model(cfg)
    hf.load_hf_into(chunks, str(hf_dir))
    lora.mark_base_loaded(chunks, str(hf_dir))
    optimizer, _ = engine_model.build_optimizer(cfg, chunks)
    load_sharded(out / f"ckpt_{layout}", chunks, optimizer)
    saved = runs[(layout, 0)]["after_step"]
    loaded = lora.full_adapters(chunks)
    assert set(loaded) == set(saved)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    moments = [s["exp_avg"] for s in optimizer.optimizer.state.values()]
    assert len(moments) == len(saved) and all(m.abs().sum() > 0 for m in moments)
