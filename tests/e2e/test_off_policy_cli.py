"""The policy loss acts only off-policy, through the real rlbatch-train (docs/grpo_loss.md,
"Where pi_old comes from"): a synchronous round of several optimizer steps trains steps 2.. of
the round against the policy that generated it, so their ratio moves and the clip acts while
each round's first step has ratio 1; a resume in the middle of such a round continues exactly
(the old logprobs ride in the checkpointed round); and every preset of docs/grpo_loss.md's
table exercises its objective (a non-zero clip fraction; SAPO, which has no clip: a moving
ratio)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from recipe_runs import stable, train_recipe

pytestmark = pytest.mark.e2e

DOC = Path(__file__).resolve().parents[2] / "docs" / "grpo_loss.md"
SMALL = (
    "grpo.num_generations=2", "grpo.global_batch_size=8", "rollout.micro_batch_size=1",
    "grpo.aggregation.train_micro_batch_size=1", "grpo.aggregation.ref_logps_micro_batch_size=1",
    "grpo.aggregation.old_logps_micro_batch_size=1", "grpo.beta=0",
)  # fmt: skip
SCALED = {  # the presets' length and round keys, scaled to the tiny recipe
    "rollout.max_new_tokens": "16",
    "grpo.overlong_buffer_len": "4",
    "grpo.steps_per_generation": "2",
}


def _train(bin_dir, env, run_dir, *overrides):
    return train_recipe(bin_dir, env, run_dir, *SMALL, *overrides)


@pytest.mark.slow
def test_steps_after_the_first_of_a_round_clip_and_resume_mid_round_exactly(
    bin_dir, subprocess_env, tmp_path
):
    """Synchronous rounds of three steps (the default rollout correction, token_tis): steps 1
    and 4 start a round (old-logprob pass, ratio 1, nothing clips); steps 2 and 3 train samples
    of the round's first policy: the ratio moves and epsilon clips. A resume from the
    checkpoint of step 2, in the middle of round 0, reproduces steps 3 and 4."""
    common = (
        "trainer.max_steps=4", "grpo.steps_per_generation=3", "grpo.epsilon_low=0.05",
        "grpo.epsilon_high=0.05", "trainer.checkpoint.every_steps=2",
    )  # fmt: skip
    ref = _train(bin_dir, subprocess_env, tmp_path / "ref", *common)
    assert [r["round"] for r in ref] == [0, 0, 0, 1]
    assert [("old_logps_seconds" in r) for r in ref] == [True, False, False, True]
    for r in (ref[0], ref[3]):  # a round's first step: pi_old is the policy being trained
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and r["ratio_std"] < 1e-5
        assert r["clip_fraction"] == 0.0
    for r in ref[1:3]:  # steps 2, 3: off-policy against the generating policy
        assert r["ratio_std"] > 1e-2
        assert 0.0 < r["clip_fraction"] < 1.0
        assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # behaviour = pi_old

    step2 = tmp_path / "ref" / "checkpoints" / "step_00000002"
    resumed = _train(bin_dir, subprocess_env, tmp_path / "resumed", *common,
                     f"trainer.resume={step2}")  # fmt: skip
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # steps 1-2 carried over from the run
    assert [stable(r) for r in resumed] == [stable(r) for r in ref]


def presets() -> dict[str, list[str]]:
    """setup -> overrides of each row of docs/grpo_loss.md's preset table."""
    text = DOC.read_text().split("## Presets", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|`]+?) \| `([^`]+)`", text, flags=re.M)
    return {name.split(" (")[0]: overrides.split() for name, overrides in rows}


def test_the_preset_table_is_parsed():
    assert sorted(presets()) == ["CISPO", "DAPO", "Dr. GRPO", "GSPO", "SAPO"]
    for overrides in presets().values():  # every preset trains each rollout in several steps
        keys = dict(o.split("=", 1) for o in overrides)
        assert int(keys["grpo.steps_per_generation"]) > 1


@pytest.mark.slow
@pytest.mark.parametrize("setup", sorted(presets()))
def test_each_preset_exercises_its_objective(bin_dir, subprocess_env, tmp_path, setup):
    keys = dict(o.split("=", 1) for o in presets()[setup])
    keys.update({k: v for k, v in SCALED.items() if k in keys})
    records = _train(
        bin_dir, subprocess_env, tmp_path / "run", "trainer.max_steps=2",
        "trainer.optim.lr=1e-2",  # one step moves the tiny policy past every preset's bounds
        *(f"{k}={v}" for k, v in keys.items()),
    )  # fmt: skip
    first, second = records
    print(f"{setup}: step 2 ratio_std {second['ratio_std']:.4f} clip {second['clip_fraction']:.4f}")
    assert first["clip_fraction"] == 0.0 and first["ratio_std"] < 1e-5
    assert second["ratio_std"] > 1e-3  # step 2 of the round: the ratio moves
    if keys.get("grpo.policy_loss") == "sapo":
        assert second["clip_fraction"] == 0.0  # no clip: the gate acts on the moving ratio
    else:
        assert second["clip_fraction"] > 0.0
