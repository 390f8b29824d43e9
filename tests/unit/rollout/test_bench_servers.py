"""rlbatch-bench servers' plan and table, without running anything: the variants it trains,
the figures it takes from metrics.jsonl, and the hidden share of generation."""

from __future__ import annotations

from rlbatch.bench.rollout_servers import _parse, figures, hidden_share, render, variants


def test_async_variants_follow_the_sync_ones_of_each_backend():
    args, extra = _parse(["--async", "2", "--servers", "2", "--", "rollout.max_new_tokens=8"])
    plan = variants(args)
    assert list(plan) == ["colocated", "colocated_async", "servers", "servers_async"]
    assert "grpo.num_steps_async=2" in plan["servers_async"]
    assert (
        "rollout.servers.count=2" in plan["servers"] and "grpo.num_steps_async=0" in plan["servers"]
    )
    assert not any(o.startswith("rollout.servers") for o in plan["colocated"])
    assert extra == ["rollout.max_new_tokens=8"]
    assert list(variants(_parse([])[0])) == ["colocated", "servers"]


def test_each_transfer_is_a_servers_variant_of_its_own():
    plan = variants(_parse(["--transfer", "file,broadcast", "--async", "1"])[0])
    assert list(plan) == [
        "colocated", "colocated_async", "servers", "servers_async", "servers_broadcast",
        "servers_broadcast_async",
    ]  # fmt: skip
    assert "rollout.servers.transfer=file" in plan["servers"]
    assert "rollout.servers.transfer=broadcast" in plan["servers_broadcast_async"]
    assert "grpo.num_steps_async=1" in plan["servers_broadcast_async"]


def test_figures_leave_the_warmup_out_and_the_hidden_share_compares_waits():
    records = [
        {"step": 1, "step_time_s": 9.0, "rollout/weight_sync_s": 5.0, "batch_seconds": 8.0},
        {"step": 2, "step_time_s": 2.0, "rollout/weight_sync_s": 0.2, "batch_seconds": 1.0},
        {"step": 3, "step_time_s": 4.0, "rollout/weight_sync_s": 0.4, "batch_seconds": 3.0},
    ]
    sync = figures(records, warmup=1)
    assert sync == {"step_time_s": 3.0, "weight_sync_s": 0.30000000000000004, "wait_s": 2.0}
    assert hidden_share({"wait_s": 0.5}, sync) == 0.75
    assert hidden_share({"wait_s": 0.5}, None) is None


def test_the_table_names_a_refused_variant_and_its_reason():
    table = {
        "tiny/servers": {"model": "tiny", "variant": "servers", "refused": None,
                         "step_time_s": 1.5, "weight_sync_s": 0.1, "wait_s": 1.0,
                         "hidden_share": 0.0},
        "tiny/servers_async": {"model": "tiny", "variant": "servers_async",
                               "refused": "grpo.num_steps_async=1: ..."},
    }  # fmt: skip
    text = render(table).splitlines()
    assert text[0].split() == ["model", "variant", "step_time_s", "weight_sync_s", "wait_s",
                               "hidden_share"]  # fmt: skip
    assert text[1].split() == ["tiny", "servers", "1.500", "0.100", "1.000", "0.000"]
    assert text[2].split()[:4] == ["tiny", "servers_async", "refused:", "grpo.num_steps_async=1:"]
