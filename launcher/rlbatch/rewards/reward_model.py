"""``data.reward=reward_model``: a local sequence-classification checkpoint scores each sample.

``data.reward_model`` is a Hugging Face directory with a ``*ForSequenceClassification`` model
of one label and its tokenizer (a discriminative reward model such as Skywork-Reward or a
Qwen2.5-RM). The text scored is the prompt as the policy saw it (chat template included)
followed by the completion; the reward is the model's logit. Samples are scored in the
trainer process, sorted by length and batched under ``data.reward_model_batching.batch_tokens``
(padded tokens per forward), so that long and short samples do not share a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlbatch.config.rewards import RewardModelConfig
from rlbatch.rewards.base import Scored


def token_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so that each batch's padded size (count x longest) stays
    within ``batch_tokens`` (a sequence longer than that is a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


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


class RewardModel:
    """The loaded model and tokenizer (float32, eval mode, on the CPU or this rank's GPU)."""

    def __init__(self, path: str, cfg: RewardModelConfig) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model: Any = AutoModelForSequenceClassification.from_pretrained(
            path, torch_dtype=torch.float32
        )
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        self.pad_id = 0 if pad is None else pad
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.pad_id

    def score(self, texts: Sequence[str]) -> list[Scored]:
        import torch

        ids = [
            self.tokenizer(t, add_special_tokens=False)["input_ids"][-self.cfg.max_length :]
            for t in texts
        ]
        out = [0.0] * len(texts)
        for batch in token_batches([len(x) for x in ids], self.cfg.batch_tokens):
            width = max(len(ids[i]) for i in batch)
            tokens = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, T]
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                tokens[row, : len(ids[i])] = torch.tensor(ids[i])
                mask[row, : len(ids[i])] = 1
            with torch.no_grad():
                logits = self.model(
                    input_ids=tokens.to(self.device), attention_mask=mask.to(self.device)
                ).logits  # [B, 1]
            for row, i in enumerate(batch):
                out[i] = float(logits[row, 0])
        return [Scored(v) for v in out]
