"""Typed configuration schema of rlbatch.

Pure Python (dataclasses and ``str`` Enums only): the planner, the validator and the workers all
read these classes, and none of them may pull in Hydra or torch through this module. Hydra
registration lives in :mod:`rlbatch.config.store`.

Every field has a docstring (the string literal under it); ``docs/configuration.md`` is generated
from them. Each default lives here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

# --------------------------------------------------------------------------------------------
# Enums (str Enums: OmegaConf matches them by *name*, so names are the user-facing spelling).
# --------------------------------------------------------------------------------------------


class BatchingMode(str, Enum):
    """How one pass (train or infer) over a mini-batch is cut into micro-batches."""

    fixed = "fixed"
    dynamic = "dynamic"
    packed = "packed"
    pool = "pool"


class OversizePolicy(str, Enum):
    """What happens to a sequence longer than the micro-batch token budget."""

    error = "error"
    isolate = "isolate"
    truncate = "truncate"


class PoolStrategy(str, Enum):
    """Best-fit rule of the pool batcher (seed 004)."""

    prefer_closest = "prefer_closest"
    prefer_first = "prefer_first"


class NormalizationMode(str, Enum):
    """How the loss divisor is computed across micro-batches and DP ranks (design.md 6)."""

    eager_global = "eager_global"
    per_micro_batch = "per_micro_batch"
    deferred_global = "deferred_global"


class LossAggMode(str, Enum):
    """Loss aggregation (verl spelling with '_' for '-')."""

    token_mean = "token-mean"
    seq_mean_token_mean = "seq-mean-token-mean"
    seq_mean_token_sum = "seq-mean-token-sum"
    seq_mean_token_sum_norm = "seq-mean-token-sum-norm"


class ScaleRewards(str, Enum):
    """Which standard deviation divides the centred rewards."""

    group = "group"
    batch = "batch"
    none = "none"


class Dtype(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


class DataSource(str, Enum):
    """Where prompts come from."""

    builtin = "builtin"
    jsonl = "jsonl"
    parquet = "parquet"


class BuiltinTask(str, Enum):
    """Tasks that ship with rlbatch (no download); both give partial credit."""

    digit_copy = "digit_copy"
    target_length = "target_length"


class RewardKind(str, Enum):
    """Reward function; ``task`` uses the built-in task's own verifiable reward."""

    task = "task"
    exact_match = "exact_match"
    math = "math"
    format = "format"  # type: ignore[assignment]  # shadows str.format; the user-facing name


class ChatTemplate(str, Enum):
    none = "none"
    qwen = "qwen"


class RolloutBackend(str, Enum):
    """Generation engine; ``megatron`` generates on the policy itself (KV cache, continuous
    batching); ``megatron_dynamic`` through megatron-core's DynamicInferenceEngine (CUDA only)."""

    megatron = "megatron"
    megatron_dynamic = "megatron_dynamic"


class DistBackend(str, Enum):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class LrSchedule(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class PassKind(str, Enum):
    train = "train"
    infer = "infer"


class Workload(str, Enum):
    """Synthetic length distributions for rlbatch-plan and rlbatch-bench."""

    grpo_math = "grpo_math"
    long_cot = "long_cot"
    bimodal = "bimodal"
    agentic = "agentic"
    uniform = "uniform"


class FailKind(str, Enum):
    """Fault injection for failure-behaviour tests (debug.fail_*)."""

    raise_error = "raise_error"
    nan_loss = "nan_loss"
    hang = "hang"
    kill = "kill"


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Preset name (informational; the preset files under conf/model set the fields)."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 176
    """SwiGLU intermediate size."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA); must divide num_attention_heads."""
    vocab_size: int = 264
    """Vocabulary size (padded); must cover the tokenizer."""
    max_position_embeddings: int = 512
    """Longest sequence the model accepts (prompt + response)."""
    rope_theta: float = 1000000.0
    """RoPE base (Qwen2.5: 1e6)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = True
    """Share input embedding and output layer (Qwen2.5 <= 3B: true)."""
    add_qkv_bias: bool = True
    """Bias on Q, K, V projections (Qwen2 architecture)."""
    init_method_std: float = 0.02
    """Std of the random initialisation when no weights are loaded."""
    params_dtype: Dtype = Dtype.fp32
    """Parameter dtype (bf16 needs a GPU for the optimizer)."""
    recompute: Recompute = Recompute.none
    """Activation recomputation."""
    hf_path: Optional[str] = None
    """Local Hugging Face Qwen2 directory (config.json + *.safetensors) to load; null = random."""
    tokenizer_path: Optional[str] = None
    """Local HF tokenizer directory; null = hf_path, or the built-in byte tokenizer."""


@dataclass
class DataConfig:
    source: DataSource = DataSource.builtin
    """Prompt source."""
    task: BuiltinTask = BuiltinTask.digit_copy
    """Built-in task when source=builtin."""
    path: Optional[str] = None
    """JSONL / Parquet file when source is jsonl or parquet."""
    prompt_key: str = "prompt"
    """Field holding the prompt text."""
    answer_key: str = "answer"
    """Field holding the reference answer."""
    num_prompts: int = 4096
    """Size of the generated built-in dataset."""
    max_prompt_len: int = 32
    """Longest prompt in tokens; longer prompts are rejected at load with their index."""
    chat_template: ChatTemplate = ChatTemplate.none
    """Wrap prompts in a chat template (qwen for real Qwen tokenizers)."""
    reward: RewardKind = RewardKind.task
    """Reward function."""
    shuffle: bool = True
    """Reshuffle prompts every epoch (seeded by trainer.seed and the epoch)."""


@dataclass
class RolloutConfig:
    backend: RolloutBackend = RolloutBackend.megatron
    """Generation engine: megatron (built-in, CPU and GPU) or megatron_dynamic (megatron-core's
    DynamicInferenceEngine: paged KV cache, CUDA graphs; CUDA only, pp=1)."""
    max_new_tokens: int = 24
    """Longest response in tokens."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Top-k sampling; 0 disables."""
    micro_batch_size: int = 4
    """Prompts per rollout chunk (LCM aggregation input)."""
    kv_cache: bool = True
    """Incremental decoding with a KV cache (false: recompute the prefix every token)."""


@dataclass
class BatchingPassConfig:
    mode: BatchingMode = BatchingMode.dynamic
    """fixed | dynamic | packed | pool."""
    max_tokens: int = 1024
    """Hard cap on computed (rounded, padded) tokens per micro-batch."""
    micro_batch_size: int = 8
    """Samples per micro-batch in fixed mode."""
    sequence_length_round: int = 8
    """Sequence lengths are rounded up to a multiple of this (multiple of tp*cp)."""
    oversize: OversizePolicy = OversizePolicy.error
    """Policy for a sequence longer than max_tokens."""
    pool_size: int = 64
    """Samples held per rank by the pool batcher."""
    pool_strategy: PoolStrategy = PoolStrategy.prefer_closest
    """Best-fit rule of the pool batcher."""
    pool_packing: bool = False
    """Pool batcher packs (THD) instead of padding."""
    infinite_loop: bool = True
    """Pool batcher restarts the data with an epoch-reseeded global shuffle."""
    pool_micro_batches_per_step: int = 1
    """Pool batcher: micro-batches per rank per optimizer step (raised to a VPP-valid count)."""
    cost_linear: Optional[float] = None
    """a in the DP cost model a*L + b*L^2; null = derived from the model dimensions."""
    cost_quadratic: Optional[float] = None
    """b in the DP cost model; null = derived from the model dimensions."""
    spread_siblings: bool = True
    """Spread the num_generations siblings of one prompt across DP ranks."""


@dataclass
class BatchingConfig:
    train: BatchingPassConfig = field(default_factory=BatchingPassConfig)
    """Micro-batching of the training (forward/backward) passes."""
    infer: BatchingPassConfig = field(default_factory=lambda: BatchingPassConfig(max_tokens=2048))
    """Micro-batching of forward-only passes (ref / old logprobs, rlbatch-logprobs)."""


@dataclass
class NormalizationConfig:
    mode: NormalizationMode = NormalizationMode.deferred_global
    """eager_global | per_micro_batch | deferred_global."""
    constant: Optional[float] = None
    """deferred_global's in-loss divisor c; null = batching.train.max_tokens for token-level
    aggregation, or the most sequences a micro-batch can hold for sequence-level ones."""


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B); 1 = no interleaving."""
    dp: int = 1
    """Data-parallel size."""
    cp: int = 1
    """Context-parallel size (GPU only)."""
    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Megatron's N for interleaving; null = pp. The planner makes the micro-batch count valid."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (GPU, tp > 1)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across DP (GPU)."""
    overlap_grad_reduce: bool = False
    """Overlap DP gradient reduction with backward."""
    backend: DistBackend = DistBackend.auto
    """torch.distributed backend; auto = nccl with CUDA, gloo otherwise."""
    nnodes: int = 1
    """Nodes (torchrun --nnodes)."""
    node_rank: int = 0
    """This node's rank (torchrun --node_rank)."""
    nproc_per_node: Optional[int] = None
    """Workers on this node; null = tp*pp*cp*dp / nnodes."""
    rdzv_endpoint: Optional[str] = None
    """host:port of the rendezvous for multi-node; null = a free local port."""


@dataclass
class AggregationConfig:
    rollout_micro_batch_size: Optional[int] = None
    """Prompts per rollout chunk; null = rollout.micro_batch_size."""
    ref_logps_micro_batch_size: int = 4
    """Prompts per reference-logprob chunk."""
    old_logps_micro_batch_size: int = 4
    """Prompts per old-logprob chunk."""
    train_micro_batch_size: int = 4
    """Prompts per training micro-batch fed to the aggregator (seed 000's input unit)."""
    logps_use_infer_budget: bool = True
    """Ref/old passes are cut by batching.infer (token budget) instead of fixed chunk sizes."""
    proceed_num_steps: Optional[int] = None
    """Bound on training micro-batches consumed per aggregation round; null = unbounded."""


@dataclass
class GRPOConfig:
    num_generations: int = 8
    """Completions per prompt (sample_repeat)."""
    num_iterations: int = 1
    """Optimizer passes over each generation (batch_repeat)."""
    global_batch_size: int = 64
    """Samples (completions) per optimizer step over all DP ranks: the mini-batch."""
    steps_per_generation: Optional[int] = None
    """Optimizer steps served by one generation round; exclusive with generation_batch_size."""
    generation_batch_size: Optional[int] = None
    """Samples generated per round; exclusive with steps_per_generation (null and null = 1 step)."""
    epsilon_low: float = 0.2
    """Lower clip of the importance ratio (1 - epsilon_low)."""
    epsilon_high: float = 0.2
    """Upper clip of the importance ratio (1 + epsilon_high)."""
    beta: float = 0.0
    """KL coefficient (k3 estimator); 0 skips the reference pass."""
    loss_agg_mode: LossAggMode = LossAggMode.token_mean
    """Divisor kind of the loss."""
    scale_rewards: ScaleRewards = ScaleRewards.group
    """Std used to scale advantages."""
    advantage_eps: float = 1e-4
    """Added to the std before dividing."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_new_tokens without EOS from the loss."""
    num_steps_async: int = 0
    """Generation runs this many optimizer steps ahead of training (0 = synchronous)."""
    max_staleness: int = 1
    """Largest allowed policy lag of a trained sample; the producer waits beyond it."""
    importance_weight_cap: float = 2.0
    """Truncation of the behaviour-policy importance weight for stale samples."""
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    """LCM aggregation of rollout / ref / old / train micro sizes (seed 000)."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of linear/cosine decay."""
    schedule: LrSchedule = LrSchedule.constant
    """Learning-rate schedule over trainer.max_steps."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save every this many optimizer steps (0 = only at the end)."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    dir: Optional[str] = None
    """Checkpoint directory; null = <run_dir>/checkpoints."""
    export_hf: bool = True
    """Export the final policy in Hugging Face format to <run_dir>/hf."""


@dataclass
class TrainerConfig:
    max_steps: int = 60
    """Optimizer steps to run (step-based; data loops forever)."""
    seed: int = 1234
    """Seed of everything: init, shuffles, sampling, planner."""
    resume: str = "none"
    """none | auto (latest checkpoint of checkpoint.dir) | a checkpoint path."""
    timeout_s: int = 300
    """A collective that takes longer ends the run with an error naming the rank."""
    num_threads: Optional[int] = None
    """torch intra-op threads per worker; null = cores / local workers."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""


@dataclass
class LoggingConfig:
    level: str = "INFO"
    """Log level of rank 0 (other ranks log warnings only)."""
    progress: bool = True
    """Rich progress bar over optimizer steps."""
    jsonl: bool = True
    """Write <run_dir>/metrics.jsonl."""
    tensorboard: bool = True
    """Write TensorBoard events to <run_dir>/tb when tensorboard is installed."""
    plot: bool = True
    """Write <run_dir>/metrics.png at the end."""


@dataclass
class DebugConfig:
    check_plan_consistency: bool = True
    """Ranks compare a hash of the step plan; a mismatch stops the run naming the rank."""
    detect_nan: bool = True
    """Stop the step on a NaN/inf loss or gradient, naming micro-batch and rank."""
    fail_at_step: Optional[int] = None
    """Fault injection for tests: fail at this optimizer step."""
    fail_rank: int = 0
    """Rank that fails."""
    fail_kind: FailKind = FailKind.raise_error
    """How it fails."""


@dataclass
class PlanConfig:
    """rlbatch-plan's inputs."""

    lengths: Optional[str] = None
    """JSON file with a list of sequence lengths."""
    synthetic: Optional[Workload] = None
    """Synthetic workload instead of a file."""
    num_samples: int = 8192
    """Samples of the synthetic workload."""
    seed: int = 0
    """Seed of the synthetic workload and the planner."""
    json: bool = False
    """Print exactly one JSON document on stdout and nothing else."""
    num_steps: int = 1
    """Optimizer steps to plan (pool mode)."""
    pass_: PassKind = PassKind.train
    """Which pass to plan: train | infer (spelled ``plan.pass`` in configs)."""


# ``pass`` is a Python keyword: the field is ``pass_`` and the user-facing key is ``plan.pass``;
# rlbatch.config.load translates between the two (the only place that knows).
PLAN_PASS_KEY = "pass"


@dataclass
class LogprobsConfig:
    input: Optional[str] = None
    """JSONL input: {"input_ids": [...]} or {"prompt": str, "completion": str} per line."""
    output: Optional[str] = None
    """JSONL output, one {"index", "token_logprobs"[, "completion_start"]} per input line."""
    entropy: bool = False
    """Also write per-token entropy."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy (and reference) model: a Qwen2-architecture preset from conf/model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt dataset and reward."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation (sampling) settings."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    """Micro-batching of the train and infer passes (the planner)."""
    normalization: NormalizationConfig = field(default_factory=NormalizationConfig)
    """How the loss is divided across micro-batches and DP ranks."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """tp / pp / vpp / dp / cp and the launch topology."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """The GRPO algorithm and its data flow."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, seed, optimizer, checkpoints, resume."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Terminal, JSONL, TensorBoard and plot outputs."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """Consistency checks and fault injection."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """Inputs of rlbatch-plan."""
    logprobs: LogprobsConfig = field(default_factory=LogprobsConfig)
    """Inputs and outputs of rlbatch-logprobs."""
    run_dir: Optional[str] = None
    """Set by the driver: the run directory (resolved.yaml, metrics, checkpoints)."""
