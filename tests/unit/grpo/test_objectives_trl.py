"""GSPO and SAPO against TRL's own loss code on identical inputs (needs the ``bench`` extra: trl).

One tiny Qwen2 (random weights, float32, no download) scores the same completions twice: once
through TRL's ``GRPOTrainer._compute_loss`` (a real trainer built offline, its fused LM head and
loss code untouched), once through rlbatch's path (``build_grpo_batch`` from ``Sample``s, the
model's logits, ``grpo_loss``). The loss (rlbatch: numerator / count) and the gradient of every
model parameter and of the backbone's last hidden state (the tensor both heads start from) must
agree to float32 rounding. Temperature 0.7, clip-higher epsilons and non-default SAPO
temperatures check that each knob maps to its counterpart.

Mapping (TRL 1.16 -> rlbatch):
- ``importance_sampling_level="sequence"`` with the clipped loss types -> ``grpo.policy_loss=gspo``
  (both: s_i = exp(masked mean of logp - old_logp), clipped to [1 - epsilon, 1 + epsilon_high]);
  ``loss_type="sapo"`` (token level) -> ``grpo.policy_loss=sapo`` with ``sapo_temperature_pos/neg``
  -> ``grpo.sapo_tau_pos/neg``; ``epsilon`` -> ``grpo.epsilon_low``, ``temperature`` ->
  ``rollout.temperature``, ``max_completion_length`` -> ``rollout.max_new_tokens``.
- ``loss_type`` fixes TRL's aggregation: ``grpo`` (and ``sapo``) = seq-mean-token-mean;
  ``bnpo`` = token-mean over the micro-batch; ``dapo`` = token-mean over ``num_items_in_batch``
  (the generation batch: equal to bnpo here, one micro-batch per step); ``dr_grpo`` =
  seq-mean-token-sum-norm with max_completion_length as the constant.

Where the definitions or inputs differ:
- TRL has no token-level aggregation for SAPO (``loss_type="sapo"`` is always seq-mean-token-mean),
  so SAPO is compared under that one mode; rlbatch's SAPO under the other modes only changes the
  shared aggregation, which the GSPO cases cover.
- TRL's SAPO with ``importance_sampling_level="sequence"`` gates the sequence ratio; rlbatch's
  ``sapo`` is the token-level form only (not compared).
- TRL's ``dr_grpo`` divides by every row of the micro-batch, rlbatch's seq-mean-token-sum-norm by
  the sequences with at least one loss token: equal here (every completion has tokens).
- TRL's ``delta`` (a cap on the unclipped ratio) has no rlbatch counterpart (left unset).
- Across micro-batches TRL divides each one's loss by the accumulation steps, rlbatch by the
  global count (docs/normalization.md): one micro-batch here, where both are the loss above.
- Old logps: TRL takes ``old_per_token_logps``; rlbatch the samples' behaviour logps (on-policy
  batch, importance weight 1), the same numbers. The trainer's ``current_gradient_accumulation_steps``
  is 1, as the training loop sets it for one micro-batch per step.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

from rlbatch.batching.plan import MicroBatch
from rlbatch.config.schema import LossAggMode, PolicyLoss, RolloutCorrection
from rlbatch.grpo.loss import STAT_INDEX, LossSettings, build_grpo_batch, grpo_loss
from rlbatch.grpo.types import Prompt, Sample

pytestmark = pytest.mark.optional_extra

VOCAB, PROMPT_LEN, MAX_NEW = 512, 5, 8
GROUPS, GENS = 2, 4
TEMPERATURE, EPS_LOW, EPS_HIGH = 0.7, 0.2, 0.28
TAU_POS, TAU_NEG = 0.8, 1.3
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5

# (rlbatch policy loss, TRL loss_type, TRL importance_sampling_level, rlbatch loss_agg_mode)
CASES = [
    (PolicyLoss.gspo, "grpo", "sequence", LossAggMode.seq_mean_token_mean),
    (PolicyLoss.gspo, "bnpo", "sequence", LossAggMode.token_mean),
    (PolicyLoss.gspo, "dapo", "sequence", LossAggMode.token_mean),
    (PolicyLoss.gspo, "dr_grpo", "sequence", LossAggMode.seq_mean_token_sum_norm),
    (PolicyLoss.sapo, "sapo", "token", LossAggMode.seq_mean_token_mean),
]


@pytest.fixture(scope="module")
def template():
    """The tiny Qwen2 both sides copy, and the completions with their old logps (the test is
    skipped, as an optional extra's, when trl is not installed)."""
    pytest.importorskip("trl")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).float()
    rng = random.Random(25)
    prompts = [[rng.randrange(VOCAB) for _ in range(PROMPT_LEN)] for _ in range(GROUPS)]
    rows = []
    for g in range(GROUPS):
        for _ in range(GENS):
            n = rng.randint(3, MAX_NEW)
            rows.append((prompts[g], [rng.randrange(VOCAB) for _ in range(n)]))
    current = _current_logps(model, rows)
    # old logps: per-sequence shifts put the GSPO ratio s_i on both sides of the clip range,
    # per-token noise makes the token ratios differ within a sequence
    old = []
    for i, lps in enumerate(current):
        shift = [-0.45, -0.1, 0.05, 0.4][i % 4]
        old.append([lp + shift + rng.uniform(-0.3, 0.3) for lp in lps])
    advantages = [1.3, -0.7, 0.4, -1.1, -0.9, 0.8, 1.5, -0.2]
    return model, rows, old, advantages


def _current_logps(model, rows) -> list[list[float]]:
    """The model's tempered logps of each completion token (to build old logps near them)."""
    out = []
    with torch.no_grad():
        for prompt, completion in rows:
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])
            out.append(lp[:, 0].tolist())
    return out


def _trl_trainer(model, loss_type: str, level: str, out: Path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlbatch.bench.grpo_trl import trl_tokenizer

    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        per_device_train_batch_size=GROUPS * GENS,
        num_generations=GENS,
        max_completion_length=MAX_NEW,
        temperature=TEMPERATURE,
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        sapo_temperature_pos=TAU_POS,
        sapo_temperature_neg=TAU_NEG,
        beta=0.0,
        report_to="none",
        gradient_checkpointing=False,
        bf16=False,
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["t1 t2"] * (GROUPS * GENS)}),
        processing_class=trl_tokenizer(VOCAB),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop per step
    trainer.model.train()
    return trainer


def _trl_inputs(rows, old, advantages) -> dict[str, torch.Tensor]:
    """TRL's batch: prompts (equal lengths: no left padding), right-padded completions."""
    n_rows = len(rows)
    completion_ids = torch.zeros(n_rows, MAX_NEW, dtype=torch.long)
    completion_mask = torch.zeros(n_rows, MAX_NEW, dtype=torch.long)
    old_logps = torch.zeros(n_rows, MAX_NEW)
    for i, (_, completion) in enumerate(rows):
        n = len(completion)
        completion_ids[i, :n] = torch.tensor(completion)
        completion_mask[i, :n] = 1
        old_logps[i, :n] = torch.tensor(old[i])
    return {
        "prompt_ids": torch.tensor([p for p, _ in rows]),
        "prompt_mask": torch.ones(n_rows, PROMPT_LEN, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "old_per_token_logps": old_logps,
        "advantages": torch.tensor(advantages),
        "num_items_in_batch": completion_mask.sum().float(),
    }


def _rlbatch_batch(rows, old, advantages):
    """rlbatch's padded micro-batch of the same samples, through ``build_grpo_batch``."""
    samples = []
    for i, (prompt, completion) in enumerate(rows):
        samples.append(
            Sample(
                prompt=Prompt(index=i // GENS, prompt_ids=tuple(prompt), answer=""),
                group_id=i // GENS,
                response_ids=list(completion),
                behaviour_logps=list(old[i]),
                truncated=False,
                policy_version=0,
                advantage=advantages[i],
            )
        )
    lengths = tuple(len(s.input_ids) for s in samples)
    width = PROMPT_LEN + MAX_NEW
    micro = MicroBatch(
        samples=tuple(range(len(samples))),
        lengths=lengths,
        padded_len=width,
        computed_tokens=len(samples) * width,
        real_tokens=sum(lengths),
    )
    return build_grpo_batch(samples, micro, round_to=1)


def _grads(model, hidden: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(every parameter's gradient, flattened; d loss / d last hidden state)."""
    params = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return params, hidden[-1].grad


def _record_hidden(model) -> list[torch.Tensor]:
    """Keep the backbone's last hidden state of each forward, with its gradient."""
    kept: list[torch.Tensor] = []

    def hook(_module, _args, output):
        output.last_hidden_state.retain_grad()
        kept.append(output.last_hidden_state)

    model.model.register_forward_hook(hook)
    return kept


def _trl_side(template, loss_type: str, level: str, out: Path):
    base, rows, old, advantages = template
    model = copy.deepcopy(base)
    hidden = _record_hidden(model)
    trainer = _trl_trainer(model, loss_type, level, out)
    loss = trainer._compute_loss(trainer.model, _trl_inputs(rows, old, advantages))
    loss.backward()
    return loss.item(), *_grads(model, hidden)


def _rlbatch_side(template, policy_loss: PolicyLoss, mode: LossAggMode):
    base, rows, old, advantages = template
    model = copy.deepcopy(base)
    hidden = _record_hidden(model)
    batch, tokens = _rlbatch_batch(rows, old, advantages)
    settings = LossSettings(
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        loss_agg_mode=mode,
        max_response_len=MAX_NEW,
        temperature=TEMPERATURE,
        policy_loss=policy_loss,
        sapo_tau_pos=TAU_POS,
        sapo_tau_neg=TAU_NEG,
        rollout_correction=RolloutCorrection.none,
    )
    model.train()
    terms = grpo_loss(model(input_ids=tokens).logits, batch, settings)
    loss = terms.numerator / terms.count.to(terms.numerator.dtype)
    loss.backward()
    return loss.item(), *_grads(model, hidden), terms


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, that over the largest |want|)."""
    abs_d = (got - want).abs().max().item()
    return abs_d, abs_d / want.abs().max().item()


@pytest.mark.parametrize(
    "policy_loss,loss_type,level,mode",
    CASES,
    ids=[f"{c[0].value}-{c[1]}-{c[3].value}" for c in CASES],
)
def test_loss_and_gradient_match_trl(template, tmp_path, policy_loss, loss_type, level, mode):
    trl_loss, trl_params, trl_hidden = _trl_side(template, loss_type, level, tmp_path)
    loss, params, hidden, terms = _rlbatch_side(template, policy_loss, mode)

    n_tokens = sum(len(c) for _, c in template[1])
    assert terms.stats[STAT_INDEX["tokens"]].item() == n_tokens
    if policy_loss == PolicyLoss.gspo:  # both sides of the clip range are exercised
        clipped = terms.stats[STAT_INDEX["clipped"]].item()
        assert 0 < clipped < n_tokens
    assert abs(trl_loss) > 1e-3 and trl_params.abs().max() > 1e-3

    assert loss == pytest.approx(trl_loss, rel=LOSS_RTOL, abs=0.0)
    # gradients compared as max |difference| / max |TRL's|: the hidden state's gradient is 0 at
    # every position that predicts no completion token, where an element-wise ratio is undefined
    for got, want in ((params, trl_params), (hidden, trl_hidden)):
        abs_d, rel_d = _max_diff(got, want)
        assert rel_d < GRAD_RTOL, (abs_d, rel_d)
    print(
        f"\n{policy_loss.value} / TRL loss_type={loss_type} / {mode.value}: "
        f"loss {loss:.8g} vs {trl_loss:.8g} (rel {abs(loss - trl_loss) / abs(trl_loss):.2e}); "
        f"param grad max abs {_max_diff(params, trl_params)[0]:.2e} "
        f"rel {_max_diff(params, trl_params)[1]:.2e}; "
        f"hidden grad max abs {_max_diff(hidden, trl_hidden)[0]:.2e} "
        f"rel {_max_diff(hidden, trl_hidden)[1]:.2e}"
    )
