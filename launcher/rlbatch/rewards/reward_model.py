"""``data.reward=reward_model``: a local sequence-classification checkpoint scores each sample.

``data.reward_model`` is a Hugging Face directory with a ``*ForSequenceClassification`` model
of one label and its tokenizer (a discriminative reward model such as Skywork-Reward or a
Qwen2.5-RM). The text scored (``data.reward_model_template``) is the prompt as the policy saw
it (its chat template included) followed by the completion (``policy``), or the prompt and
the completion as a user and an assistant turn in the reward model's own chat template
(``model``: what such models are trained on); the reward is the model's logit at the text's
last token. A text over ``data.reward_model_batching.max_length`` tokens (or cut by
``batching.infer.oversize=truncate``) is scored on its last tokens and says so: a failure of
reason ``truncated`` beside its score. The model runs in ``data.reward_model_dtype`` (auto:
bfloat16 on a GPU, float32 on the CPU).

Samples are scored in the trainer process, in micro-batches planned by rlbatch's batching
planner under ``batching.infer`` (the slot of the reference and old-logprob passes): its mode,
``max_tokens``, ``sequence_length_round`` and ``oversize`` policy govern the scoring forwards
too. A padded micro-batch is one right-padded row per sample; a packed one (``mode=packed`` or
``pool_packing``) is one row of the samples back to back, each attending only to itself
(position ids restarting at 0, a block-diagonal causal mask), read at each sample's last token.
A score is the same whatever the plan: only how many forwards it takes changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlbatch.config.enums import OversizePolicy
from rlbatch.config.errors import ConfigError
from rlbatch.config.rewards import RewardModelConfig, RewardModelDtype, RewardModelTemplate
from rlbatch.config.schema import BatchingPassConfig
from rlbatch.rewards.base import Failure, Scored


def resolve_dtype(dtype: RewardModelDtype, cuda: bool) -> str:
    """The torch dtype name of ``data.reward_model_dtype`` (auto: bfloat16 on a GPU)."""
    if RewardModelDtype(dtype) == RewardModelDtype.auto:
        return "bfloat16" if cuda else "float32"
    return RewardModelDtype(dtype).value


def template_problem(path: str) -> str:
    """ "" when the tokenizer at ``path`` has a chat template, else why
    data.reward_model_template=model cannot be used."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - any unreadable tokenizer
        return f"its tokenizer does not load ({type(err).__name__}: {err})"
    if not getattr(tokenizer, "chat_template", None):
        return (
            "its tokenizer has no chat template, which data.reward_model_template=model reads:"
            " set data.reward_model_template=policy"
        )
    return ""


def check_reward_model(path: str) -> str:
    """ "" when ``path`` holds a one-label sequence-classification model, else why not."""
    from pathlib import Path

    if not Path(path).expanduser().is_dir():
        return "is not a directory: point it at a Hugging Face reward model checkpoint"
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - any unreadable config
        return f"has no readable config.json ({type(err).__name__}: {err})"
    archs = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        return f"is a {archs} checkpoint: a reward model is a *ForSequenceClassification one"
    if getattr(config, "num_labels", 1) != 1:
        return f"has num_labels={config.num_labels}: a reward model has one (a scalar score)"
    return ""


def budget_errors(cfg: RewardModelConfig, infer: BatchingPassConfig) -> list[ConfigError]:
    """data.reward_model_batching.max_length >= 1 and, under batching.infer.oversize=error, a
    text of max_length tokens fits batching.infer.max_tokens (else a long completion would
    stop the run mid-training)."""
    key = "data.reward_model_batching.max_length"
    if cfg.max_length < 1:
        return [ConfigError(key, cfg.max_length, "must be >= 1")]
    r = max(infer.sequence_length_round, 1)
    rounded = -(-cfg.max_length // r) * r
    if infer.oversize != OversizePolicy.error or rounded <= infer.max_tokens:
        return []
    return [
        ConfigError(
            key,
            cfg.max_length,
            f"a text this long (rounded to {rounded}) is over batching.infer.max_tokens="
            f"{infer.max_tokens}, the budget the reward model is scored under: lower it to"
            f" {infer.max_tokens // r * r} or less, raise batching.infer.max_tokens, or set"
            " batching.infer.oversize=isolate (own forward) or truncate (last tokens kept)",
        )
    ]


class RewardModel:
    """The loaded model and tokenizer (eval mode, on the CPU or this rank's GPU, in ``dtype``:
    data.reward_model_dtype), scoring under the ``infer`` pass config (``batching.infer``)."""

    def __init__(
        self,
        path: str,
        cfg: RewardModelConfig,
        infer: BatchingPassConfig,
        dtype: RewardModelDtype = RewardModelDtype.auto,
        template: RewardModelTemplate = RewardModelTemplate.policy,
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.cfg = cfg
        self.infer = infer
        self.template = RewardModelTemplate(template)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, resolve_dtype(dtype, self.device.type == "cuda"))
        self.model: Any = AutoModelForSequenceClassification.from_pretrained(path, dtype=self.dtype)
        self.model.to(self.device).eval()
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        self.pad_id = 0 if pad is None else pad
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.pad_id
        # the head read at chosen positions (Llama, Qwen2, Mistral, Gemma ...: ``score``); a
        # model without one runs a packed micro-batch's samples one row each
        head = getattr(self.model, "score", None)
        self.head = head if isinstance(head, torch.nn.Linear) else None

    def text(self, raw_prompt: Any, prompt: str, completion: str) -> str:
        """What the model reads of one sample (data.reward_model_template): ``prompt`` (as the
        policy saw it) + ``completion``, or ``raw_prompt`` (the row's text or chat messages)
        and the completion in the model's own chat template."""
        if self.template == RewardModelTemplate.policy:
            return prompt + completion
        messages = (
            list(raw_prompt)
            if isinstance(raw_prompt, list)
            else [
                {"role": "user", "content": str(raw_prompt if raw_prompt is not None else prompt)}
            ]
        )
        messages.append({"role": "assistant", "content": completion})
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False))

    def score(self, texts: Sequence[str]) -> list[Scored]:
        """Each text's score; a text scored on its last tokens only carries a ``truncated``
        failure saying how many it had."""
        from rlbatch.batching.planner import plan_pass

        full = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        ids = [x[-self.cfg.max_length :] for x in full]
        try:
            plan = plan_pass([len(x) for x in ids], self.infer, dp=1, pass_name="infer")
        except ValueError as err:
            raise ValueError(
                f"data.reward=reward_model: {err} (the reward model scores under batching.infer;"
                " lower data.reward_model_batching.max_length or raise batching.infer.max_tokens)"
            ) from err
        out = [0.0] * len(texts)
        read = [len(x) for x in ids]
        for mb in plan.for_rank(0).micro_batches:
            if mb.filler:
                continue
            # the oversize policy truncate keeps a sample's last tokens (its completion)
            rows = [ids[i][len(ids[i]) - n :] for i, n in zip(mb.samples, mb.lengths, strict=True)]
            if mb.packed and self.head is not None:
                values = self._packed(rows)
            elif mb.packed:
                values = [v for r in rows for v in self._padded([r], len(r))]
            else:
                values = self._padded(rows, mb.padded_len)
            for i, v in zip(mb.samples, values, strict=True):
                out[i] = v
            for i, n in zip(mb.samples, mb.lengths, strict=True):
                read[i] = n
        return [self._scored(v, len(f), n) for v, f, n in zip(out, full, read, strict=True)]

    def _scored(self, value: float, length: int, read: int) -> Scored:
        if read >= length:
            return Scored(value)
        why = (
            f"{length} tokens, scored on the last {read} (data.reward_model_batching.max_length"
            f"={self.cfg.max_length}, batching.infer.max_tokens={self.infer.max_tokens})"
        )
        return Scored(value, (Failure("truncated", why),))

    def _padded(self, rows: list[list[int]], width: int) -> list[float]:
        """One right-padded row per sample (``width`` >= the longest), each read at its last
        real token."""
        import torch

        width = max(width, max(len(r) for r in rows))
        tokens = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            tokens[j, : len(r)] = torch.tensor(r)
            mask[j, : len(r)] = 1
        if self.head is not None:
            hidden = self._hidden(tokens, mask, None)  # [B, T, H]
            ends = torch.tensor([len(r) - 1 for r in rows])
            with torch.no_grad():
                return self.head(hidden[torch.arange(len(rows)), ends])[:, 0].float().tolist()
        with torch.no_grad():
            logits = self.model(
                input_ids=tokens.to(self.device), attention_mask=mask.to(self.device)
            ).logits  # [B, 1]
        return logits[:, 0].float().tolist()

    def _packed(self, rows: list[list[int]]) -> list[float]:
        """The samples back to back in one row, each attending to itself alone."""
        import torch

        seg = torch.cat([torch.full((len(r),), j) for j, r in enumerate(rows)])  # [T]
        tokens = torch.tensor([t for r in rows for t in r]).unsqueeze(0)  # [1, T]
        positions = torch.cat([torch.arange(len(r)) for r in rows]).unsqueeze(0)  # [1, T]
        causal = torch.ones(len(seg), len(seg), dtype=torch.bool).tril()
        allowed = causal & (seg[:, None] == seg[None, :])  # [T, T]
        blocked = torch.finfo(self.dtype).min
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill(~allowed, blocked)
        mask = mask[None, None]
        hidden = self._hidden(tokens, mask, positions)  # [1, T, H]
        ends = torch.tensor([len(r) for r in rows]).cumsum(0) - 1
        assert self.head is not None
        with torch.no_grad():
            return self.head(hidden[0, ends])[:, 0].float().tolist()

    def _hidden(self, tokens: Any, mask: Any, positions: Any) -> Any:
        import torch

        base = self.model.base_model
        with torch.no_grad():
            return base(
                input_ids=tokens.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=None if positions is None else positions.to(self.device),
            ).last_hidden_state
