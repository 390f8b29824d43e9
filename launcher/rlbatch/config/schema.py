"""Typed configuration schema of rlbatch.

Pure Python (dataclasses and ``str`` Enums only): the planner, the validator and the workers all
read these classes, and none of them may pull in Hydra or torch through this module. Hydra
registration lives in :mod:`rlbatch.config.store`.

Every field has a docstring (the string literal under it); ``docs/configuration.md`` is generated
from them. Each default lives here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlbatch.config.distill import DistillConfig
from rlbatch.config.enums import (  # noqa: F401  (re-exported: the schema's vocabulary)
    AdvantageEstimator,
    AnswerFormat,
    Architecture,
    BatchingMode,
    BestMode,
    BuiltinTask,
    ChatTemplate,
    ConsumptionGranularity,
    DataSource,
    DistBackend,
    Dtype,
    EnvOnError,
    FailKind,
    FilterGroups,
    KLEstimator,
    LossAggMode,
    LrSchedule,
    NormalizationMode,
    OversizePolicy,
    PassKind,
    PolicyLoss,
    PoolStrategy,
    Recompute,
    RewardKind,
    RolloutBackend,
    RolloutCorrection,
    RopeScaling,
    RoutingReplay,
    ScaleRewards,
    ServerFailure,
    ServerRouting,
    ServerTransfer,
    ServerUpdate,
    SyncFault,
    TokenizerSource,
    WandbMode,
    Workload,
)
from rlbatch.config.env import EnvConfig
from rlbatch.config.evaluation import EvalConfig, EvalDataConfig  # noqa: F401
from rlbatch.config.lora import LoraConfig, LoraInit  # noqa: F401
from rlbatch.config.moe import MoeFields
from rlbatch.config.objectives import ObjectiveConfig
from rlbatch.config.rewards import (
    CodeExecConfig,
    JudgeConfig,
    RewardModelConfig,
    RewardModelDtype,
    RewardModelTemplate,
    ServedConfig,
)
from rlbatch.config.run_logging import LoggingConfig, MlflowConfig, WandbConfig  # noqa: F401
from rlbatch.config.vllm import ServersConfig, VllmConfig

# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig(MoeFields):
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
    architecture: Architecture = Architecture.qwen2
    """HF architecture (qwen2, qwen3, llama, qwen3_moe, qwen2_moe): tensor names and config.json
    of the HF export."""
    head_dim: Optional[int] = None
    """Per-head width (HF head_dim); null = hidden_size / num_attention_heads."""
    qk_layernorm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3)."""
    rope_scaling: RopeScaling = RopeScaling.none
    """RoPE scaling type (transformers' rope_type)."""
    rope_scaling_factor: float = 1.0
    """RoPE scaling factor (linear, llama3, yarn)."""
    rope_original_max_position_embeddings: Optional[int] = None
    """Context length before scaling (llama3, yarn); null = max_position_embeddings."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: low-frequency band factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: high-frequency band factor."""
    rope_beta_fast: float = 32.0
    """yarn scaling: beta_fast."""
    rope_beta_slow: float = 1.0
    """yarn scaling: beta_slow."""
    init_method_std: float = 0.02
    """Std of the random initialisation when no weights are loaded."""
    params_dtype: Dtype = Dtype.fp32
    """Parameter dtype (bf16 needs a GPU for the optimizer)."""
    recompute: Recompute = Recompute.none
    """Activation recomputation."""
    logits_chunk_tokens: int = 1024
    """Positions projected to the vocabulary at a time in the train, reference and old passes
    (only the scored ones: response tokens); the logits are recomputed in backward, so memory
    holds one chunk's logits, not the micro-batch's. 0 = all positions at once (full logits)."""
    hf_path: Optional[str] = None
    """Hugging Face checkpoint to load (config.json + *.safetensors): a local directory or a
    hub id (org/name, resolved through the huggingface_hub cache); null = random init."""
    tokenizer_path: Optional[str] = None
    """Local HF tokenizer directory; null = hf_path's tokenizer files (model.tokenizer=auto)."""
    tokenizer: TokenizerSource = TokenizerSource.auto
    """auto: tokenizer_path, else hf_path's tokenizer files (tokenizer.json, or vocab.json +
    merges.txt / tokenizer.model through transformers), else the byte tokenizer when there is
    no hf_path; a hf_path without a loadable tokenizer stops the run before launch. bytes: the
    built-in byte tokenizer, deliberately (docs/data_and_rewards.md, "Tokenizers")."""
    extra_eos_token_ids: list[int] = field(default_factory=list)
    """Token ids that also end a response, besides the tokenizer's own end ids (its eos_token
    and the eos_token_id of the directory's generation_config.json / config.json), e.g. a chat
    model's end-of-turn token. Every rollout backend stops at the whole set (docs/rollout.md,
    "End of a response")."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (rank 0 = off: every weight trains); docs/lora.md."""


@dataclass
class DataConfig:
    source: DataSource = DataSource.builtin
    """Prompt source."""
    task: BuiltinTask = BuiltinTask.digit_copy
    """Built-in task when source=builtin."""
    path: Optional[str] = None
    """JSONL / Parquet file (source jsonl / parquet), or a directory written by HF datasets'
    ``save_to_disk`` (source hf_disk)."""
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
    """Reward function (built-in); data.reward_fn, when set, replaces it."""
    reward_fn: list[str] = field(default_factory=list)
    """Rewards by import path, summed with data.reward_weights: ``PATH.py:function``,
    ``module.path:function`` or a built-in name (math, format, ...); [] = data.reward."""
    reward_weights: Optional[list[float]] = None
    """Weight of each data.reward_fn entry in the total reward; null = 1.0 each."""
    reward_timeout_s: Optional[float] = None
    """Longest one call of a data.reward_fn function may take before the run fails naming
    it; null = trainer.timeout_s."""
    reward_abs_max: float = 1e6
    """Largest reward magnitude: a user function's larger (or non-finite) value is an error
    naming it and the sample; a served, judge, reward-model or environment one scores 0 with
    reason out_of_range."""
    reward_url: Optional[str] = None
    """Endpoint of data.reward=http (the URL posted to) or judge (an OpenAI-compatible server:
    its base URL or its /v1/chat/completions URL)."""
    reward_model: Optional[str] = None
    """Hugging Face directory of a sequence-classification reward model (data.reward=reward_model)."""
    reward_model_template: RewardModelTemplate = RewardModelTemplate.policy
    """policy: the reward model reads the prompt as the policy saw it plus the completion;
    model: a user and an assistant turn in the reward model's own chat template."""
    reward_model_dtype: RewardModelDtype = RewardModelDtype.auto
    """auto (bfloat16 on a GPU, float32 on the CPU), float32 or bfloat16."""
    code_exec: CodeExecConfig = field(default_factory=CodeExecConfig)
    """Sandboxed execution of data.reward=code_exec."""
    served: ServedConfig = field(default_factory=ServedConfig)
    """Requests of data.reward=http and judge: timeout, retries, concurrency, on_error."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The judge's prompt, model name and score scale (data.reward=judge)."""
    reward_model_batching: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Batching of data.reward=reward_model's forwards."""
    answer_format: AnswerFormat = AnswerFormat.raw
    """raw: the answer field as is; gsm8k: the text after its last '####' (GSM8K's format)."""
    shuffle: bool = True
    """Reshuffle prompts every epoch (seeded by trainer.seed and the epoch)."""


@dataclass
class RolloutConfig:
    backend: RolloutBackend = RolloutBackend.megatron
    """Generation engine: megatron (built-in, CPU and GPU), megatron_dynamic (megatron-core's
    DynamicInferenceEngine: paged KV cache, CUDA graphs; CUDA only, pp=1), vllm (an in-process
    vLLM engine per rank, weights synced every policy version; pip install 'rlbatch[vllm]') or
    vllm_server (separate vLLM servers, rollout.servers)."""
    max_new_tokens: int = 24
    """Longest response in tokens."""
    temperature: float = 1.0
    """Sampling temperature (> 0); every logprob the loss compares is taken at it."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Top-k sampling; 0 disables."""
    micro_batch_size: int = 4
    """Prompts per rollout chunk (LCM aggregation input)."""
    kv_cache: bool = True
    """Incremental decoding with a KV cache (false: recompute the prefix every token)."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """The vLLM engine (rollout.backend=vllm, and the servers of vllm_server)."""
    servers: ServersConfig = field(default_factory=ServersConfig)
    """rollout.backend=vllm_server: the vLLM servers generation runs on."""


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
    pool_micro_batches_per_step: int = 1
    """Pool batcher: at least this many micro-batches per rank per pass (raised to a VPP-valid
    count; more when the pass needs more)."""
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
    """Micro-batching of forward-only passes (ref / old logprobs, rlbatch-logprobs, the local
    reward model of data.reward_model)."""


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
    ep: int = 1
    """Expert-parallel size (MoE models): the experts of each layer split over ep ranks, carved
    out of dp * cp (no extra processes); must divide dp * cp and model.num_moe_experts."""
    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Megatron's N for interleaving; null = pp. The planner makes the micro-batch count valid."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (tp > 1; CPU and GPU). Generation runs with it off."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across DP (megatron's DistributedOptimizer; CPU and GPU)."""
    overlap_grad_reduce: bool = False
    """Overlap DP gradient reduction with backward."""
    backend: DistBackend = DistBackend.auto
    """torch.distributed backend; auto = nccl with CUDA, gloo otherwise."""
    nnodes: int = 1
    """Nodes (torchrun --nnodes)."""
    node_rank: Optional[int] = None
    """This node's rank, 0..nnodes-1 (torchrun --node-rank); null = SLURM_NODEID under SLURM,
    else 0 on a single node (multi-node without SLURM: set it on each node)."""
    nproc_per_node: Optional[int] = None
    """Workers on this node; null = tp*pp*cp*dp / nnodes."""
    rdzv_endpoint: Optional[str] = None
    """host:port of node 0 (rank 0 serves the rendezvous) for multi-node; null = under SLURM the
    first host of SLURM_JOB_NODELIST, port 29500 + job id % 1000; single node: a free local port."""
    run_id: Optional[str] = None
    """Id shared by every node of a run: torchrun's --rdzv-id and the run directory
    (outputs/<run_id>); null = multi-node: the scheduler's job id (SLURM_JOB_ID[.SLURM_STEP_ID],
    PBS_JOBID, LSB_JOBID), single node: the run directory's name (a new one per run)."""


@dataclass
class AggregationConfig:
    rollout_micro_batch_size: Optional[int] = None
    """Prompts per rollout chunk; null = rollout.micro_batch_size."""
    ref_logps_micro_batch_size: int = 4
    """Prompts per reference-logprob chunk (when logps_use_infer_budget is false)."""
    old_logps_micro_batch_size: int = 4
    """Prompts per old-logprob chunk (when logps_use_infer_budget is false)."""
    teacher_logps_micro_batch_size: int = 4
    """Prompts per teacher-logprob chunk (grpo.distill.teacher; when logps_use_infer_budget is
    false)."""
    train_micro_batch_size: int = 4
    """Prompts per training micro-batch fed to the aggregator (its input unit)."""
    logps_use_infer_budget: bool = True
    """Ref/old passes are cut by batching.infer (token budget) instead of fixed chunk sizes."""
    proceed_num_steps: Optional[int] = None
    """Bound on training micro-batches consumed per aggregation round; null = unbounded."""


@dataclass
class GRPOConfig(ObjectiveConfig):
    num_generations: int = 8
    """Completions per prompt (sample_repeat)."""
    num_iterations: int = 1
    """Optimizer passes over each generation (batch_repeat): each mini-batch is trained this
    many times in a row (a a b b); > 1 makes the samples off-policy (old-logprob pass)."""
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
    """Std used to scale advantages: the group's, the whole generation batch's (all DP ranks),
    or none."""
    advantage_eps: float = 1e-4
    """Added to the std before dividing."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_new_tokens without EOS from the loss."""
    num_steps_async: int = 0
    """Generation runs this many optimizer steps ahead of training (0 = synchronous); > 0 makes
    the samples off-policy (pi_old from the training forward, or an old-logprob pass when a
    round spans several steps)."""
    max_staleness: int = 1
    """Largest allowed policy lag of a trained sample; the producer waits beyond it."""
    overlap_generation: bool = True
    """With num_steps_async > 0 and tp = pp = cp = 1: generate the next round in a generation
    worker process on a model copy while training runs (on rollout servers: the workers drive
    them, DP rank 0's pushing, the replicas meeting before each new version; evaluation is
    refused); false = generate inline (same samples, no overlap)."""
    partial_rollouts: bool = False
    """With num_steps_async > 0: one long-lived continuous batch of rollout rows across policy
    versions (built-in engine; in segments on vllm and vllm_server): finished rows' slots take
    new rows at once and rows still decoding at a weight swap go on under the new weights
    (caches recomputed; rollout.servers.on_update=keep keeps the servers'), every token
    recording its version; needs max_staleness >= num_steps_async + steps per round (x2 for
    consumption_granularity=group)."""
    consumption_granularity: ConsumptionGranularity = ConsumptionGranularity.batch
    """With partial_rollouts: what a round trains. batch = exactly its own draw of prompts
    (waiting for their slowest row while other rows keep the slots busy); group = the first
    groups to finish (groups at the staleness bound first), longer ones trained in later rounds."""
    routing_replay: RoutingReplay = RoutingReplay.none
    """MoE policies: the expert routing the policy passes replay. none = each pass routes for
    itself; r2 = the training forward and backward replay the old-logprob pass's routing (needs
    that pass: a round of several steps under a rollout correction); r3 = the old-logprob pass
    and the training forward and backward replay the routing the built-in rollout engine sampled
    each token with (prompt tokens included). The reference pass always routes for itself. Under
    model.recompute=full the recomputed forward replays the same routing."""
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    """LCM aggregation of rollout / ref / old / train micro sizes (docs/lcm_aggregation.md)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation: a teacher's per-token advantage on the student's samples
    (docs/grpo_loss.md, "On-policy distillation")."""


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
    every_steps: int = 50
    """Save every this many optimizer steps (0 = by every_minutes only); always at the end."""
    every_minutes: float = 30.0
    """Also save when this many minutes passed since the last save (rank 0's clock, all ranks
    agree; 0 = off), so a crash loses at most this much work whatever the step time."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    dir: Optional[str] = None
    """Checkpoint directory; null = <run_dir>/checkpoints."""
    export_hf: bool = True
    """Export the final policy in Hugging Face format to <run_dir>/hf."""
    keep_best: Optional[str] = None
    """An eval metric (e.g. eval/pass@1): the checkpoint of its best value survives keep_last
    pruning, and a new best is saved when evaluated; null = off."""
    keep_best_mode: BestMode = BestMode.max
    """max: a higher keep_best value is better; min: a lower one."""


@dataclass
class TrainerConfig:
    max_steps: int = 60
    """Optimizer steps to run (step-based; data loops forever)."""
    seed: int = 1234
    """Seed of everything: init, shuffles, sampling, planner."""
    resume: str = "none"
    """none | auto (latest checkpoint of checkpoint.dir) | a checkpoint path."""
    timeout_s: int = 300
    """A step phase (generation, rewards, training, a collective) that makes no progress for
    this long ends the run with an error naming the rank, the step and the phase."""
    preempt_timeout_s: float = 120.0
    """After SIGTERM / SIGUSR1 / SIGHUP: the most seconds to finish the step, save and exit
    (then the workers are stopped; keep it below the scheduler's grace or warning time)."""
    num_threads: Optional[int] = None
    """torch intra-op threads per worker; null = cores / local workers."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""


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
    fail_sync: Optional[SyncFault] = None
    """Fault injection for tests of rollout.backend=vllm_server: the fault happens in the
    weight sync made for step ``fail_at_step`` instead (rank 0, which pushes): the trainer
    SIGKILLs itself right after a phase of the sync (pause, start, update, finish, resume),
    or pushes all tensors but one (omit_tensor) or the previous sync's weights under the new
    label (stale); null: no sync fault. It takes the place of fail_rank / fail_kind (which
    must stay unset) and needs generation inline (not overlapping training: a generation
    worker's syncs never meet fail_at_step)."""
    perturb_behaviour_logps: float = 0.0
    """Add Gaussian noise of this std to the behaviour log-probs the rollout returns (seeded per
    token): makes the rollout-mismatch correction and its diagnostics visible on CPU (0 = off)."""
    response_length_median: int = 0
    """> 0: every rollout row stops after its own lognormal-drawn number of tokens (median this,
    sigma debug.response_length_sigma, clamped to [1, rollout.max_new_tokens]; a row stopped
    below max_new_tokens is not truncated): a long-tailed workload for benchmarks on a model that
    seldom samples EOS. Training rollouts only (evaluation keeps it off); 0 = off."""
    response_length_sigma: float = 1.0
    """Sigma (log scale) of debug.response_length_median's lognormal: larger, a heavier tail."""


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
    """Seed of the synthetic workload (the planner uses trainer.seed, as training does)."""
    json: bool = False
    """Print exactly one JSON document on stdout and nothing else."""
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
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn environments and tool calls (null env.path: single-turn rollouts)."""
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
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation on held-out prompts during training and by rlbatch-eval."""
    run_dir: Optional[str] = None
    """Set by the driver: the run directory (resolved.yaml, metrics, checkpoints)."""
