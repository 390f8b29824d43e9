"""The objective keys through the real rlbatch-train (docs/grpo_loss.md): one run with GSPO,
RLOO, the k2 KL with bias correction, the entropy bonus, overlong shaping and a masked rollout
correction under perturbed behaviour log-probs; and DAPO dynamic sampling on two DP ranks with
run-ahead, CISPO and REINFORCE++-baseline: exact batches every step and a resume from a
mid-run checkpoint that continues exactly like the uninterrupted run."""

from __future__ import annotations

import pytest

from recipe_runs import stable, train_recipe

pytestmark = pytest.mark.e2e

SMALL = [
    "grpo.num_generations=2", "grpo.global_batch_size=8", "rollout.micro_batch_size=1",
    "grpo.aggregation.train_micro_batch_size=1", "grpo.aggregation.ref_logps_micro_batch_size=1",
    "grpo.aggregation.old_logps_micro_batch_size=1",
]  # fmt: skip


def _train(bin_dir, env, cwd, run_dir, *overrides):
    return train_recipe(bin_dir, env, run_dir, *overrides, cwd=cwd)


def test_objective_keys_act_end_to_end(bin_dir, subprocess_env, tmp_path):
    records = _train(
        bin_dir, subprocess_env, tmp_path, tmp_path / "run", "trainer.max_steps=2",
        "grpo.num_generations=4", "grpo.global_batch_size=16",
        "grpo.policy_loss=gspo", "grpo.epsilon_low=3e-4", "grpo.epsilon_high=4e-4",
        "grpo.advantage_estimator=rloo", "grpo.kl_estimator=k2", "grpo.kl_bias_correction=true",
        "grpo.entropy_coef=0.01", "grpo.overlong_buffer_len=8", "grpo.overlong_penalty_factor=0.5",
        "grpo.rollout_correction=token_mask", "grpo.rollout_correction_cap=1.3",
        "grpo.rollout_correction_lower=0.7", "debug.perturb_behaviour_logps=0.3",
    )  # fmt: skip
    assert [r["samples"] for r in records] == [16, 16]
    for r in records:
        # overlong shaping is its own reward part, summed into the reward
        assert -0.5 <= r["reward/overlong_mean"] < 0.0
        total = r["reward/task_mean"] + r["reward/overlong_mean"]
        assert r["reward_mean"] == pytest.approx(total, abs=1e-9)
        # on-policy: pi_old is the training forward, the weight is pi_trainer / pi_rollout and
        # the perturbation (std 0.3 per token) makes the mismatch and the mask visible
        assert r["ratio_mean"] == 1.0 and r["clip_fraction"] == 0.0
        assert r["mismatch_kl_k1"] == pytest.approx(0.0, abs=0.05)  # E[-d] = 0 for the noise
        assert 0.02 < r["mismatch_kl_k3"] < 0.1  # ~ std^2 / 2 = 0.045
        assert 0.8 < r["mismatch_ess"] < 0.99
        assert 0.1 < r["is_masked_fraction"] < 0.6 and r["is_capped_fraction"] == 0.0
        assert r["is_weight_max"] > 1.3
        assert r["entropy"] > 0
    assert records[0]["kl"] == 0.0 < records[1]["kl"]  # k2 against the step-0 reference


def test_dynamic_sampling_exact_batches_and_exact_resume(bin_dir, subprocess_env, tmp_path):
    common = [
        *SMALL, "parallel.dp=2", "grpo.filter_groups=zero_variance", "grpo.num_steps_async=1",
        "grpo.policy_loss=cispo", "grpo.advantage_estimator=reinforce_pp_baseline",
        "trainer.max_steps=4", "trainer.checkpoint.every_steps=2",
    ]  # fmt: skip
    ref = _train(bin_dir, subprocess_env, tmp_path, tmp_path / "ref", *common)
    assert [r["samples"] for r in ref] == [8] * 4  # exactly grpo.global_batch_size every step
    for i, r in enumerate(ref):
        assert r["prompts_drawn"] == 4 * r["generation_rounds"]  # every draw counted
        # each round trains exactly 4 groups; the last step also reports the round generated
        # ahead for step 5 (num_steps_async=1), which this run never trains
        rounds = 2 if i == len(ref) - 1 else 1
        assert r["prompts_drawn"] - r["groups_filtered"] - r["groups_unused"] == 4 * rounds
    assert sum(r["groups_filtered"] for r in ref) > 0  # the filter acted
    assert any(r["generation_rounds"] > 1 for r in ref)  # and the batch was refilled
    assert [r["staleness_mean"] for r in ref] == [0.0, 1.0, 1.0, 1.0]  # run-ahead kept working
    assert all("advantage_batch_std" in r for r in ref)  # REINFORCE++ over both ranks

    step2 = tmp_path / "ref" / "checkpoints" / "step_00000002"
    resumed = _train(
        bin_dir, subprocess_env, tmp_path, tmp_path / "resumed", *common,
        f"trainer.resume={step2}",
    )  # fmt: skip
    assert [stable(r) for r in resumed] == [stable(r) for r in ref]
