"""megatron-core's own inference engine (``DynamicInferenceEngine``: paged KV cache, continuous
batching, CUDA graphs) decoding token ids, behind ``rollout.backend=megatron_dynamic``. CUDA only.

It decodes token ids (rlbatch.rollout.engines.megatron_dynamic wraps it into the same ``RolloutEngine``
contract as the built-in engine) on the policy's own GPTModel (tp >= 1, pp = 1 here), so the weights it samples from are always
the current policy's: no weight sync. Samples carry megatron's behaviour logprobs (at the
rollout temperature). Seeds: one engine per generate call seeded from ``seed``; megatron's
sampler draws from a CUDA generator, so samples are reproducible on the same GPU and batch but
not equal to the CPU engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlbatch.engine.adapter import unwrap

FLASH_ATTN_MIN = "2.7.3"
"""megatron-core's dynamic batching attends with flash-attention: 2.7.3 or newer, or FA3."""


def flash_attention_problem() -> str | None:
    """Why megatron's dynamic batching cannot attend here (None when it can): it asserts
    flash-attention mid-decode, so this is asked before the engine is built."""
    import importlib.metadata
    import importlib.util

    from packaging.version import Version

    if importlib.util.find_spec("flash_attn_interface") is not None:  # FA3
        return None
    try:
        version = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return f"flash-attn is not installed (pip install 'flash-attn>={FLASH_ATTN_MIN}')"
    if Version(version) < Version(FLASH_ATTN_MIN):
        return f"flash-attn {version} is older than {FLASH_ATTN_MIN} (pip install -U flash-attn)"
    return None


def check_available() -> None:
    """An error before the engine is built when CUDA or flash-attention is missing."""
    if not torch.cuda.is_available():
        raise ValueError(
            "rollout.backend=megatron_dynamic needs CUDA (megatron-core's DynamicInferenceEngine"
            " runs on GPUs only) and none is available: set rollout.backend=megatron"
        )
    problem = flash_attention_problem()
    if problem is not None:
        raise ValueError(
            f"rollout.backend=megatron_dynamic needs flash-attention (megatron-core's dynamic "
            f"batching attends with it): {problem}; or set rollout.backend=megatron"
        )


class _Tokens:
    """The tokenizer surface megatron's controller reads when it gets token ids only."""

    def __init__(self, eos_id: int, vocab_size: int) -> None:
        self.eod = eos_id
        self.vocab_size = vocab_size

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]


class DynamicRolloutEngine:
    """Token-level decoding on megatron-core's DynamicInferenceEngine (see the module
    docstring); rlbatch.rollout.engines.builtin wraps it into a RolloutEngine."""

    def __init__(self, model: Any, params: Any, *, buffer_size_gb: float = 4.0) -> None:
        check_available()
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != 1:
            raise ValueError(
                "rollout.backend=megatron_dynamic supports parallel.pp=1 (one model chunk):"
                " set rollout.backend=megatron for pipeline-parallel generation"
            )
        self.model = unwrap(chunks[0])
        self.params = params
        self.buffer_size_gb = buffer_size_gb

    def _engine(self, max_len: int, max_requests: int, seed: int) -> Any:
        from megatron.core.inference.contexts import DynamicInferenceContext
        from megatron.core.inference.engines import DynamicInferenceEngine
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
            GPTInferenceWrapper,
        )
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig,
        )
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (  # noqa: E501
            TextGenerationController,
        )

        c = self.model.config
        context = DynamicInferenceContext(
            params_dtype=c.params_dtype,
            num_layers=c.num_layers,
            kv_channels=c.kv_channels,
            num_attention_heads=c.num_query_groups or c.num_attention_heads,
            max_sequence_length=max_len,
            buffer_size_gb=self.buffer_size_gb,
            max_requests=max_requests,
            tensor_model_parallel_size=c.tensor_model_parallel_size,
        )
        wrapper_config = InferenceWrapperConfig(
            hidden_size=c.hidden_size,
            params_dtype=c.params_dtype,
            inference_batch_times_seqlen_threshold=-1,
            padded_vocab_size=self.model.vocab_size,
            inference_max_requests=max_requests,
            inference_max_seq_length=max_len,
        )
        wrapped = GPTInferenceWrapper(self.model, wrapper_config, context)
        controller = TextGenerationController(
            wrapped, _Tokens(self.params.eos_id, self.model.vocab_size)
        )
        return DynamicInferenceEngine(controller, context, random_seed=seed)

    def decode(
        self, prompt_ids: Sequence[Sequence[int]], seed: int
    ) -> list[tuple[list[int], list[float], bool]]:
        """One completion per prompt: (response tokens, behaviour logprobs, truncated) each.
        The engine knows token ids only; rlbatch.rollout.engines.builtin turns these into samples."""
        from megatron.core.inference.sampling_params import SamplingParams as MSampling

        p = self.params
        max_len = max(len(ids) for ids in prompt_ids) + p.max_new_tokens
        engine = self._engine(max_len, len(prompt_ids), seed)
        sampling = MSampling(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=0.0 if p.top_p >= 1.0 else p.top_p,
            return_log_probs=True,
            skip_prompt_log_probs=True,
            num_tokens_to_generate=p.max_new_tokens,
            termination_id=p.eos_id,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for i, ids in enumerate(prompt_ids):
                    engine.add_request(i, list(ids), sampling)
                done: dict[int, Any] = {}
                while engine.has_unfinished_requests():
                    for record in engine.step_modern()["finished_request_records"]:
                        request = record.merge() if hasattr(record, "merge") else record
                        done[int(request.request_id)] = request
        finally:
            self.model.train(was_training)
        out = []
        for i in range(len(prompt_ids)):
            tokens = [int(t) for t in done[i].generated_tokens]
            logps = [float(v) for v in done[i].generated_log_probs or []][: len(tokens)]
            out.append(cut_at_eos(tokens, logps, p.eos_ids))
        return out


def cut_at_eos(
    tokens: list[int], logps: list[float], eos_ids: Sequence[int]
) -> tuple[list[int], list[float], bool]:
    """(tokens up to and with the first of ``eos_ids``, their logprobs, truncated): megatron's
    engine stops at one termination id only, so a row that sampled another EOS of the run goes
    on; what it sampled after that EOS is dropped (the tokens before it are what a decoder
    stopping there samples: each token depends only on those before it)."""
    ends = set(eos_ids)
    for n, token in enumerate(tokens):
        if token in ends:
            return tokens[: n + 1], logps[: n + 1], False
    return tokens, logps, True
