"""On-policy distillation: per-token (teacher) advantages in the loss against the float64
reference of test_objectives under every policy loss that accepts them, loss aggregation and
layout; the teacher advantage of a sample from log-probs by hand; collation of per-token
advantages into a micro-batch; the aggregator's teacher pass (its place before the advantages,
its chunks, the split) with deterministic fakes; the combined advantage in the zero-advantage
count and dynamic sampling; and samples pickled before the field existed."""

from __future__ import annotations

import math
import pickle
import random
import zlib

import pytest
import torch
from test_objectives import ALL_MODES, _check, _settings

from rlbatch.batching.plan import MicroBatch
from rlbatch.config.schema import AdvantageEstimator, PolicyLoss, ScaleRewards
from rlbatch.grpo.distill import (
    CLIPPED,
    KL_SUM,
    DistillSettings,
    apply_teacher,
    distill_metrics,
    sample_sums,
    zero_advantage,
)
from rlbatch.grpo.lcm import AggregationPlan, LCMAggregator, Stages
from rlbatch.grpo.loss import build_grpo_batch
from rlbatch.grpo.types import Prompt, Sample
from rlbatch.train.filtering import teaching_groups

PER_TOKEN_LOSSES = [p for p in PolicyLoss if p != PolicyLoss.gspo]


def _dense_seqs(key: str, stale: bool, n: int = 8):
    from test_loss import _random_sequences

    rng = random.Random(zlib.crc32(key.encode()))
    seqs = _random_sequences(rng, n, stale, with_ref=True)
    for s in seqs:
        s["dense"] = [rng.uniform(-1.5, 1.5) for _ in s["toks"]]
    return seqs


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("loss", PER_TOKEN_LOSSES, ids=lambda p: p.value)
def test_per_token_advantages_match_float64_reference(loss, layout, mode):
    """reward_coef * A_i + D_t per token in every policy loss, under a rollout correction, a KL
    term and every aggregation: value to 1e-12, gradient to finite differences."""
    seqs = _dense_seqs(f"dense{loss.value}{layout}{mode.value}", stale=True)
    st = _settings(policy_loss=loss, loss_agg_mode=mode, reward_coef=0.4, beta=0.05)
    terms, _ = _check(f"per-token advantage, policy_loss={loss.value}", seqs, st, layout)
    assert terms.numerator.item() != 0.0


def test_per_token_advantages_change_the_loss_and_pure_distillation_ignores_rewards():
    """The dense part acts (a different numerator than the sample advantage alone), and with
    reward_coef=0 the sample's reward advantage has no effect at all."""
    seqs = _dense_seqs("pure", stale=False)
    _check("pure distillation", seqs, _settings(reward_coef=0.0))
    from test_loss import _padded_batch

    from rlbatch.grpo.loss import loss_from_logps

    def numerator(ss, **kw):
        batch, cur = _padded_batch(ss)
        return loss_from_logps(cur, batch, _settings(**kw)).numerator.item()

    no_dense = [{k: v for k, v in s.items() if k != "dense"} for s in seqs]
    assert numerator(seqs) != pytest.approx(numerator(no_dense), rel=1e-3)
    other_rewards = [{**s, "adv": -s["adv"] + 3.0} for s in seqs]
    assert numerator(seqs, reward_coef=0.0) == numerator(other_rewards, reward_coef=0.0)


def _sample(resp, behaviour, mask=None, advantage=0.0, prompt_ids=(1, 2)):
    prompt = Prompt(index=0, prompt_ids=tuple(prompt_ids), answer="")
    return Sample(
        prompt=prompt,
        group_id=0,
        response_ids=list(resp),
        behaviour_logps=list(behaviour),
        truncated=False,
        policy_version=0,
        advantage=advantage,
        loss_mask=mask,
    )


def test_teacher_advantage_by_hand_with_clip_and_observation_tokens():
    s = _sample([5, 6, 7, 8], [-1.0, -0.5, -2.0, -0.1], mask=[1, 1, 0, 1])
    teacher = [[-0.2, -4.0, -9.0, -0.3]]
    apply_teacher([s], teacher, DistillSettings(coef=0.5, clip=2.0), seconds=3.0)
    # 0.5 * clamp(t - b, -2, 2): 0.8 -> 0.4; -3.5 -> -2 -> -1.0 (clamped); observation 0; -0.2
    assert s.token_advantages == pytest.approx([0.4, -1.0, 0.0, -0.1], abs=1e-15)
    assert s.metrics[KL_SUM] == pytest.approx((-1.0 + 0.2) + (-0.5 + 4.0) + (-0.1 + 0.3))
    assert s.metrics[CLIPPED] == 1.0
    m = distill_metrics(sample_sums([s]), num_ranks=1)
    assert m["distill/teacher_kl"] == pytest.approx((-0.8 + 3.5 + 0.2) / 3)
    assert m["distill/clip_frac"] == pytest.approx(1 / 3)
    assert m["distill/teacher_seconds"] == 3.0


def test_collation_places_token_advantages_at_the_positions_predicting_them():
    a = _sample([5, 6, 7], [-1.0] * 3, mask=[1, 0, 1], advantage=0.3)
    b = _sample([9, 9], [-1.0] * 2, advantage=-0.7, prompt_ids=(1, 2, 3))
    a.token_advantages, b.token_advantages = [0.5, 9.0, -0.25], [1.5, 2.5]
    for packed in (False, True):
        lengths = [a.length, b.length]
        width = 16 if packed else 8
        mb = MicroBatch((0, 1), tuple(lengths), width, 2 * 8, sum(lengths), packed=packed)
        batch, _ = build_grpo_batch([a, b], mb, round_to=4, dtype=torch.float64)
        assert batch.token_advantages is not None
        got = batch.token_advantages[batch.loss_mask].tolist()
        # a: positions 1 and 3 (its second token is an observation: no loss, no advantage)
        assert got == [0.5, -0.25, 1.5, 2.5]
        assert batch.token_advantages[~batch.loss_mask].abs().sum().item() == 0.0
        assert batch.advantages.tolist() == [0.3, -0.7]
    plain = _sample([5], [-1.0])
    mb = MicroBatch((0,), (plain.length,), 4, 4, plain.length)
    assert build_grpo_batch([plain], mb, round_to=4)[0].token_advantages is None


def _rollout(rows, seed):
    rng = random.Random(seed)
    out = []
    for p in rows:
        n = rng.randint(1, 4)
        out.append(
            Sample(
                prompt=p,
                group_id=-1,
                response_ids=[rng.randint(3, 9) for _ in range(n)],
                behaviour_logps=[-rng.uniform(0.1, 2.0) for _ in range(n)],
                truncated=False,
                policy_version=0,
            )
        )
    return out


def test_aggregator_runs_the_teacher_pass_before_the_advantages_in_its_chunks():
    calls = []

    def teacher(samples):
        calls.append(("teacher", len(samples)))
        assert all(s.advantage == 0.0 for s in samples)  # before the advantages
        return [[-0.5 * (i + 1) for i in range(len(s.response_ids))] for s in samples]

    def reward(samples):
        calls.append(("reward", len(samples)))
        assert all(s.token_advantages is not None for s in samples)  # after the teacher
        return [float(len(s.response_ids)) for s in samples]

    plan = AggregationPlan(
        rollout_micro=2, ref_micro=1, old_micro=1, train_micro=1, sample_repeat=2,
        batch_repeat=1, ref_pass=False, old_pass=False, teacher_micro=1, teacher_pass=True,
    )  # fmt: skip
    assert plan.service_target_bs == 2
    agg = LCMAggregator(
        plan,
        Stages(rollout_fn=_rollout, reward_fn=reward, teacher_logps_fn=teacher),
        beta=0.0,
        scale_rewards=ScaleRewards.group,
        advantage_eps=1e-4,
        estimator=AdvantageEstimator.grpo,
        distill=DistillSettings(coef=2.0),
    )
    prompts = [Prompt(index=i, prompt_ids=(1, i + 2), answer="") for i in range(4)]
    out = agg.run([[p] for p in prompts])
    assert [c for c in calls if c[0] == "teacher"] == [("teacher", 2)] * 4  # 1 prompt x 2 rows
    assert agg.records[0].teacher_chunks == [2, 2]
    for ex in out:  # the split keeps each sample's per-token advantages
        for s in ex.samples:
            want = [2.0 * (-0.5 * (i + 1) - b) for i, b in enumerate(s.behaviour_logps)]
            assert s.token_advantages == pytest.approx(want, rel=1e-15)
    # the teacher's chunk size enters the LCM when the pass runs on fixed chunks
    wide = AggregationPlan(
        rollout_micro=1, ref_micro=1, old_micro=1, train_micro=1, sample_repeat=2,
        batch_repeat=1, ref_pass=False, old_pass=False, teacher_micro=3, teacher_pass=True,
    )  # fmt: skip
    assert wide.service_target_bs == 3


def test_combined_advantage_in_the_zero_advantage_count_and_dynamic_sampling():
    flat = [_sample([5, 6], [-1.0, -1.0]) for _ in range(4)]  # equal rewards: A = 0
    assert all(zero_advantage(s, 1.0) for s in flat)
    assert teaching_groups(flat, 2) == [False, False]
    flat[3].token_advantages = [0.0, 0.2]
    assert not zero_advantage(flat[3], 1.0)
    assert teaching_groups(flat, 2) == [False, True]
    rewarded = _sample([5], [-1.0], advantage=0.5)
    assert not zero_advantage(rewarded, 1.0) and zero_advantage(rewarded, 0.0)
    # a teacher equal to the student through another fp32 engine: noise, not a signal
    noise = _sample([5, 6], [-1.0, -1.0])
    noise.token_advantages = [3e-6, -8e-6]
    assert zero_advantage(noise, 0.0) and zero_advantage(noise, 1.0)
    assert not zero_advantage(noise, 0.0, coef=0.5)  # 8e-6 / 0.5 = 1.6e-5 nats
    noise.token_advantages = [3e-6, -2e-5]
    assert not zero_advantage(noise, 0.0)


def test_samples_pickled_before_per_token_advantages_load_without_them():
    s = _sample([5, 6], [-1.0, -1.0])
    state = dict(s.__dict__)
    del state["token_advantages"]
    old = Sample.__new__(Sample)
    old.__setstate__(state)
    assert old.token_advantages is None
    s.token_advantages = [0.1, -0.2]
    assert pickle.loads(pickle.dumps(s)).token_advantages == [0.1, -0.2]
    with pytest.raises(ValueError, match="token_advantages has 1 entries for 2"):
        Sample(**{**s.__dict__, "token_advantages": [0.1]})
    assert math.isfinite(sum(s.token_advantages))


def _tokenizer_dir(path, vocab, eos="<|endoftext|>"):
    import json

    import tokenizers

    path.mkdir()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<|endoftext|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": eos, "pad_token": "<pad>"})
    )
    return str(path)


def test_teacher_tokenizer_must_be_the_students(tmp_path):
    """Vocabulary (ids), EOS and special ids compared; a teacher without tokenizer files is
    taken only at the student's vocab_size; rlbatch's byte export is the byte tokenizer."""
    from dataclasses import replace

    from rlbatch.config.schema import ModelConfig
    from rlbatch.grpo.teacher import tokenizer_mismatch

    vocab = {"<pad>": 0, "<|endoftext|>": 1, "[UNK]": 2, "hello": 3, "world": 4, "<|im_end|>": 5}
    swapped = {**vocab, "hello": 4, "world": 3}
    student = replace(
        ModelConfig(vocab_size=8), tokenizer_path=_tokenizer_dir(tmp_path / "s", vocab)
    )

    def teacher(path, **kw):
        return replace(ModelConfig(vocab_size=kw.pop("vocab_size", 16)), hf_path=path, **kw)

    same = _tokenizer_dir(tmp_path / "same", vocab)
    assert tokenizer_mismatch(student, teacher(same)) == ""  # padded vocab 16 != 8: fine
    other_ids = _tokenizer_dir(tmp_path / "ids", swapped)
    assert "vocabulary" in tokenizer_mismatch(student, teacher(other_ids))
    other_eos = _tokenizer_dir(tmp_path / "eos", vocab, eos="<|im_end|>")
    problem = tokenizer_mismatch(student, teacher(other_eos))
    assert "eos ids (5,) (student (1,))" in problem and "special tokens" in problem
    bare = tmp_path / "bare"
    bare.mkdir()
    assert tokenizer_mismatch(student, teacher(str(bare), vocab_size=8)) == ""
    assert "vocab_size=16 differs" in tokenizer_mismatch(student, teacher(str(bare)))
    byte_student = ModelConfig()  # the built-in byte tokenizer
    assert "vocabulary" in tokenizer_mismatch(byte_student, teacher(same))
    exported = tmp_path / "export"
    exported.mkdir()
    (exported / "rlbatch_tokenizer.json").write_text('{"tokenizer": "bytes"}')
    assert tokenizer_mismatch(byte_student, teacher(str(exported), vocab_size=512)) == ""


def test_pure_distillation_warns_of_the_reward_settings_it_leaves_unused():
    """An environment's step rewards and a data.reward_fn that evaluation does not use either;
    a data.reward_fn that evaluation scores with is not warned about."""
    from rlbatch.cli.common import compose
    from rlbatch.config.distill import distill_warnings

    cfg = compose(["+recipe=grpo_qwen"], "test")
    cfg.grpo.distill.teacher, cfg.grpo.distill.reward_coef = "/t", 0.0
    cfg.env.path, cfg.data.reward_fn = "my_env.py:Env", ["math"]
    warned = distill_warnings(cfg)
    assert len(warned) == 2
    assert warned[0].startswith("env.path=my_env.py:Env: the environment's step rewards")
    assert warned[1].startswith("data.reward_fn=['math'] is ignored: pure distillation")
    cfg.eval.every_steps = 5  # evaluation scores with data.reward_fn
    assert distill_warnings(cfg) == [warned[0]]
    cfg.grpo.distill.reward_coef = 1.0  # the rewards are trained on
    assert distill_warnings(cfg) == []
