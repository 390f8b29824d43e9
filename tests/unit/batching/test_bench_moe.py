"""rlbatch-bench moe: its planner figures end to end (pure, a second), the step variants it
trains (each a configuration rlbatch-train accepts, the dense one of the MoE's active width),
and its figures and table from metrics records, without starting a run."""

from __future__ import annotations

import json

import pytest

from rlbatch.bench import moe as bench


def test_the_command_lists_and_runs_the_moe_bench(bin_dir, subprocess_env):
    """rlbatch-bench names the bench, and its planner table prints through the real command."""
    import subprocess

    listing = subprocess.run([str(bin_dir / "rlbatch-bench"), "--help"], capture_output=True,
                             text=True, env=subprocess_env, timeout=120)  # fmt: skip
    assert "moe" in listing.stdout and "equal active parameters" in listing.stdout
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-bench"), "moe", "--planner-only", "--samples", "256", "--dp", "4"],
        capture_output=True, text=True, env=subprocess_env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["planned", "by", "cost_b_over_a"]
    assert [line.split()[0] for line in lines[1:]] == list(bench.PLANNERS)


def test_the_planner_balances_the_moe_cost_better_than_token_counts(capsys):
    assert bench.main(["--planner-only", "--json", "--samples", "1024", "--dp", "8"]) == 0
    planner = json.loads(capsys.readouterr().out)["planner"]
    assert set(planner) == set(bench.PLANNERS)
    # Qwen3-30B-A3B by hand: attention 2 x 32 heads x 128 x 48 layers per token pair; a token's
    # linear work 2 x (48 x (QKV + output) + 48 x (router + 8 experts) + logits)
    qkv, out = 2048 * (32 * 128 + 2 * 4 * 128), 32 * 128 * 2048
    sparse = 2048 * 128 + 8 * 3 * 2048 * 768
    linear = 2 * (48 * (qkv + out) + 48 * sparse + 2048 * 151936)
    assert planner["active"]["cost_b_over_a"] == pytest.approx(2 * 32 * 128 * 48 / linear)
    assert planner["tokens"]["cost_b_over_a"] == 0.0
    # every expert counted makes attention look 10x cheaper than it is
    assert planner["total"]["cost_b_over_a"] < planner["active"]["cost_b_over_a"] / 5
    active, tokens = planner["active"], planner["tokens"]
    assert active["cost_imbalance"] < tokens["cost_imbalance"]
    assert active["cost_imbalance"] <= planner["total"]["cost_imbalance"]
    assert tokens["token_imbalance"] <= active["token_imbalance"]
    assert active["micro_batches"] == tokens["micro_batches"]


@pytest.mark.parametrize("variant", list(bench.VARIANTS))
def test_each_step_variant_is_a_run_rlbatch_train_accepts(variant):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rlbatch.config.load import check_structure
    from rlbatch.config.store import conf_dir, register_configs
    from rlbatch.config.validate import check

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(
            config_name="config", overrides=[*bench.COMMON, *bench.VARIANTS[variant]]
        )
    run = check(*check_structure(OmegaConf.to_container(cfg, resolve=True)))
    m, moe = run.model, bench.preset("tiny_moe")
    assert (m.hidden_size, m.num_layers, m.head_dim, m.vocab_size) == (64, 2, 16, 264)
    assert run.parallel.dp == 2 and run.grpo.num_steps_async == 0
    if variant == "dense":  # one SwiGLU as wide as the k experts a token uses
        assert m.num_moe_experts is None
        assert m.ffn_hidden_size == moe.moe_router_topk * moe.moe_ffn_hidden_size
    else:
        assert m.num_moe_experts == 4 and run.parallel.ep == (2 if variant == "moe_ep2" else 1)


def test_step_figures_take_every_runs_timed_steps_and_the_table_names_a_refusal():
    records = [
        {"step": 1, "trainable_params": 1000, "step_time_s": 9.0, "train_seconds": 5.0,
         "train_tokens_per_s": 100.0, "batch_seconds": 3.0, "moe/load_imbalance": 1.5},
        {"step": 2, "trainable_params": 1000, "step_time_s": 2.0, "train_seconds": 1.0,
         "train_tokens_per_s": 400.0, "batch_seconds": 0.5, "moe/load_imbalance": 1.2},
        {"step": 3, "trainable_params": 1000, "step_time_s": 4.0, "train_seconds": 3.0,
         "train_tokens_per_s": 200.0, "batch_seconds": 1.5, "moe/load_imbalance": 1.4},
    ]  # fmt: skip
    # two runs of a variant (the first cut after step 2): medians over both runs' timed steps
    row = bench.step_figures([records[:2], records], warmup=1)
    assert row == {"parameters": 1000.0, "step_time_s": 2.0, "train_s": 1.0,
                   "train_tokens_per_s": 400.0, "wait_s": 0.5, "load_imbalance": 1.2}  # fmt: skip
    dense = bench.step_figures(
        [[{k: v for k, v in r.items() if "moe" not in k} for r in records]], 1
    )
    assert dense["load_imbalance"] is None
    steps = {
        "moe_ep1": {"variant": "moe_ep1", "refused": None, "active_parameters": 90000.0, **row},
        "moe_ep2": {"variant": "moe_ep2", "refused": "parallel.ep=2: ..."},
    }
    planner = {"active": {"cost_b_over_a": 6.5e-5, "cost_imbalance": 1.001, "token_imbalance": 1.02,
                          "lockstep_efficiency": 0.99, "micro_batches": 48}}  # fmt: skip
    text = bench.render(steps, planner).splitlines()
    assert text[1].split() == ["moe_ep1", "1,000", "90,000", "2.000", "1.000", "400.000",
                               "0.500", "1.200"]  # fmt: skip
    assert text[2].split()[:3] == ["moe_ep2", "refused:", "parallel.ep=2:"]
    assert text[-1].split() == ["active", "6.5e-05", "1.001", "1.020", "0.990", "48"]
