"""The teacher of on-policy distillation (grpo.distill.teacher): the checks before launch (its
architecture splits over the run's layout, its tokenizer is the student's) and the frozen model
that scores the student's sampled tokens (docs/grpo_loss.md, "On-policy distillation").

The teacher is a megatron model like the reference: built on the run's own tp / pp / vpp layout
from its Hugging Face directory's config.json, its weights loaded once, never trained, and its
log-probs taken by the same chunked infer pass (batching.infer) as the reference and old passes,
at rollout.temperature (the temperature of the behaviour log-probs it is compared with).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from rlbatch.config.errors import ConfigError, ConfigErrors
from rlbatch.config.lengths import longest_sequence, longest_sequence_text
from rlbatch.config.lora import LoraConfig
from rlbatch.config.schema import ModelConfig, RunConfig, TokenizerSource

KEY = "grpo.distill.teacher"


def teacher_model_config(cfg: RunConfig) -> ModelConfig:
    """The teacher's ModelConfig: the architecture of its config.json (resolve_model_config),
    without adapters, the student's dtype and recompute settings. An MoE teacher is dropless:
    the student's capacity factor is a training setting, and a teacher that dropped tokens
    would score them as another model (its per-token log-probs are the signal)."""
    from rlbatch.engine.hf_config import resolve_model_config

    assert cfg.grpo.distill.teacher is not None
    base = replace(
        cfg.model,
        hf_path=cfg.grpo.distill.teacher,
        lora=LoraConfig(),
        moe_expert_capacity_factor=None,
    )
    model, _ = resolve_model_config(base)
    return model


def teacher_errors(cfg: RunConfig) -> list[ConfigError]:
    """Before launch: the teacher's architecture is supported and splits over the run's layout,
    and its tokenizer is the student's (:func:`tokenizer_mismatch`)."""
    path = cfg.grpo.distill.teacher
    if not path or not Path(path).is_dir():
        return []  # rlbatch.config.distill reports a missing directory
    try:
        model = teacher_model_config(cfg)
    except ConfigErrors as err:
        return [ConfigError(KEY, path, f"its config.json: {e}") for e in err.errors]
    except (OSError, KeyError, ValueError) as err:
        return [ConfigError(KEY, path, f"cannot read its config.json: {err!r}")]
    errors = _layout_errors(cfg, model)
    longest = longest_sequence(cfg)
    if model.max_position_embeddings < longest:  # past it, its log-probs would be noise
        errors.append(
            ConfigError(
                KEY,
                path,
                f"its context (max_position_embeddings = {model.max_position_embeddings}) is "
                f"shorter than the run's longest sequence ({longest_sequence_text(cfg)} = "
                f"{longest}): it would score tokens past what it was trained on; shorten the "
                "run's sequences or choose a teacher with a longer context",
            )
        )
    problem = tokenizer_mismatch(cfg.model, model)
    if problem:
        errors.append(ConfigError(KEY, path, problem))
    return errors


def _layout_errors(cfg: RunConfig, model: ModelConfig) -> list[ConfigError]:
    p, path, out = cfg.parallel, cfg.grpo.distill.teacher, []
    stages = p.pp * max(p.vpp, 1)
    if model.num_layers % stages:
        out.append(
            ConfigError(
                KEY,
                path,
                f"its {model.num_layers} layers do not split over parallel.pp * parallel.vpp = "
                f"{stages} stages (the teacher is built on the run's layout): choose pp and vpp "
                "that divide the layers of both models",
            )
        )
    if model.num_moe_experts and model.num_moe_experts % p.ep:
        out.append(
            ConfigError(
                KEY, path, f"its {model.num_moe_experts} experts do not split over "
                f"parallel.ep={p.ep} (the teacher is built on the run's layout): choose an ep "
                "that divides the experts of both models"
            )
        )  # fmt: skip
    for name in ("num_attention_heads", "num_query_groups"):
        if getattr(model, name) % p.tp:
            out.append(
                ConfigError(
                    KEY, path, f"its {name}={getattr(model, name)} is not divisible by "
                    f"parallel.tp={p.tp} (the teacher is built on the run's layout)"
                )
            )  # fmt: skip
    return out


def _tokenizer_of(model: ModelConfig) -> Optional[Any]:
    """The tokenizer a model directory brings: an HF tokenizer, the byte tokenizer (an rlbatch
    export of a byte run, or model.tokenizer=bytes), or None (no tokenizer files at all)."""
    from rlbatch.engine.tokenizer import build_tokenizer, marks_bytes, tokenizer_files

    if TokenizerSource(model.tokenizer) == TokenizerSource.bytes or model.tokenizer_path:
        return build_tokenizer(model)
    if not model.hf_path or marks_bytes(model.hf_path) or tokenizer_files(model.hf_path):
        return build_tokenizer(model)
    return None


def _fingerprint(tok: Any) -> dict[str, Any]:
    """What must agree for two tokenizers to give the same ids: the vocabulary (token -> id),
    the special ids and the EOS set."""
    backend = getattr(tok, "_tok", None)
    vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else "bytes"
    return {
        "vocabulary": vocab,
        "eos ids": tuple(tok.eos_ids),
        "bos id": tok.bos_id,
        "pad id": tok.pad_id,
        "special tokens": getattr(tok, "special_tokens", {}),
    }


def tokenizer_mismatch(student: ModelConfig, teacher: ModelConfig) -> str:
    """Why the teacher cannot score the student's token ids ("" when it can): a different
    tokenizer (vocabulary, special ids, EOS); a teacher without tokenizer files is taken with
    the student's tokenizer only when its vocabulary size is the student's. The padded
    embedding size may differ: only the tokenizers' ids matter."""
    from rlbatch.engine.tokenizer import TokenizerLoadError

    try:
        mine = _tokenizer_of(student)
        theirs = _tokenizer_of(replace(teacher, tokenizer=TokenizerSource.auto))
    except (TokenizerLoadError, ValueError) as err:
        return f"its tokenizer does not load: {err}"
    if mine is None:
        return ""  # the student's own tokenizer error is reported by its key
    if theirs is None:
        if teacher.vocab_size != student.vocab_size:
            return (
                f"it has no tokenizer files and its vocab_size={teacher.vocab_size} differs from"
                f" the student's {student.vocab_size}: a teacher must share the student's "
                "tokenizer (copy the tokenizer files into the teacher directory to compare them)"
            )
        return ""
    a, b = _fingerprint(mine), _fingerprint(theirs)
    differ = [k for k in a if a[k] != b[k]]
    if not differ:
        return ""
    detail = ", ".join(k if k == "vocabulary" else f"{k} {b[k]} (student {a[k]})" for k in differ)
    return (
        f"its tokenizer differs from the student's ({detail}): the teacher scores the student's"
        " token ids, so both must use one tokenizer; distill from a teacher of the same family"
    )


def build_teacher(cfg: RunConfig) -> tuple[list[Any], RunConfig]:
    """This rank's frozen teacher chunks (the run's layout, weights from grpo.distill.teacher)
    and the run config whose model is the teacher's (its cost model plans the teacher pass)."""
    from rlbatch.engine import hf
    from rlbatch.engine.model import build_model

    teacher_cfg = replace(cfg, model=teacher_model_config(cfg))
    chunks = build_model(teacher_cfg, wrap_ddp=False)
    assert teacher_cfg.model.hf_path is not None
    hf.load_hf_into(chunks, teacher_cfg.model.hf_path)
    for chunk in chunks:
        chunk.eval()
        for p in chunk.parameters():
            p.requires_grad_(False)
    return chunks, teacher_cfg
