"""The str Enums of the config schema (rlbatch.config.schema re-exports every one).

OmegaConf matches str Enums by *name*, so names are the user-facing spelling.
"""

from __future__ import annotations

from enum import Enum


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
    """Best-fit rule of the pool batcher (docs/batching.md, pool mode)."""

    prefer_closest = "prefer_closest"
    prefer_first = "prefer_first"


class NormalizationMode(str, Enum):
    """How the loss divisor is computed across micro-batches and DP ranks (docs/normalization.md)."""

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
    hf_disk = "hf_disk"


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
    math_verify = "math_verify"
    none = "none"
    """No data reward: the environment's own rewards alone (env.path)."""
    code_exec = "code_exec"
    """The completion's program run in a sandbox against the row's tests (data.code_exec)."""
    http = "http"
    """A float from a reward server: each sample posted to data.reward_url (data.served)."""
    judge = "judge"
    """An LLM judge's score from an OpenAI-compatible chat endpoint at data.reward_url."""
    reward_model = "reward_model"
    """A local sequence-classification checkpoint (data.reward_model) scores each sample."""


class AnswerFormat(str, Enum):
    """How the reference answer is read from the answer field."""

    raw = "raw"
    gsm8k = "gsm8k"


class WandbMode(str, Enum):
    """wandb.init's mode: offline writes to <run_dir>/wandb for a later ``wandb sync``."""

    online = "online"
    offline = "offline"
    disabled = "disabled"


class ChatTemplate(str, Enum):
    none = "none"
    qwen = "qwen"
    model = "model"
    """The chat_template of the model's tokenizer_config.json (rendered as transformers does)."""


class Architecture(str, Enum):
    """Hugging Face architecture the model maps to (import, export, tensor names)."""

    qwen2 = "qwen2"
    qwen3 = "qwen3"
    llama = "llama"
    qwen3_moe = "qwen3_moe"
    qwen2_moe = "qwen2_moe"


class RopeScaling(str, Enum):
    """RoPE scaling (transformers' rope_type): none, linear (positions / factor), llama3
    (Llama-3.1 frequency bands), yarn."""

    none = "none"
    linear = "linear"
    llama3 = "llama3"
    yarn = "yarn"


class RolloutBackend(str, Enum):
    """Generation engine; ``megatron`` generates on the policy itself (KV cache, continuous
    batching); ``megatron_dynamic`` through megatron-core's DynamicInferenceEngine (CUDA only);
    ``vllm`` through an in-process vLLM engine fed the policy's weights (rlbatch.rollout);
    ``vllm_server`` through separate vLLM servers fed the policy's weights over HTTP."""

    megatron = "megatron"
    megatron_dynamic = "megatron_dynamic"
    vllm = "vllm"
    vllm_server = "vllm_server"


ServerFailure = Enum(
    "ServerFailure", [("stop", "stop"), ("continue", "continue"), ("restart", "restart")], type=str
)
"""What a rollout server that refuses a request or does not answer in time does to the run
(rollout.servers.on_failure): ``stop`` the run naming it, after a checkpoint of the last
completed step; ``continue`` without it (dropped from the pool, its rows sent to the others)
while any server is left; ``restart`` it (a server the run started, rollout.servers.count),
out of the pool until it is back and holds the run's current weights. A functional Enum:
``continue`` is a Python keyword."""


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


class SyncFault(str, Enum):
    """Fault injection in a weight sync to rollout servers (debug.fail_sync): the trainer
    SIGKILLs itself right after one phase of the sync (``pause``, ``start``, ``update``: with
    rollout.servers.transfer=broadcast in the middle of the broadcast, ``finish``,
    ``resume``), or pushes an incomplete set of weights (``omit_tensor``: all but one tensor)
    or the previous sync's weights under the new label (``stale``)."""

    pause = "pause"
    start = "start"
    update = "update"
    finish = "finish"
    resume = "resume"
    omit_tensor = "omit_tensor"
    stale = "stale"


class PolicyLoss(str, Enum):
    """Per-token policy-gradient term of the loss (docs/grpo_loss.md, "Policy losses")."""

    clip = "clip"
    gspo = "gspo"
    gspo_token = "gspo_token"
    cispo = "cispo"
    sapo = "sapo"


class KLEstimator(str, Enum):
    """Per-token estimator of KL(pi || ref) added with grpo.beta (Schulman's k1 / k2 / k3)."""

    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


class AdvantageEstimator(str, Enum):
    """How rewards become advantages (docs/grpo_loss.md, "Advantage estimators")."""

    grpo = "grpo"
    rloo = "rloo"
    reinforce_pp = "reinforce_pp"
    reinforce_pp_baseline = "reinforce_pp_baseline"


class RolloutCorrection(str, Enum):
    """How the weight pi_old / pi_behaviour is applied: truncated (tis) or as a rejection mask,
    per token or per sequence; ``none`` applies no weight."""

    none = "none"
    token_tis = "token_tis"
    seq_tis = "seq_tis"
    token_mask = "token_mask"
    seq_mask = "seq_mask"


class RoutingReplay(str, Enum):
    """Which routing an MoE policy's training passes replay (docs/grpo_loss.md, "Routing
    replay"): ``none`` = every pass routes for itself; ``r2`` = the training forward and
    backward replay the old-logprob pass's routing; ``r3`` = every policy pass (old-logprob
    pass, training forward and backward) replays the routing the rollout sampled with."""

    none = "none"
    r2 = "r2"
    r3 = "r3"


class FilterGroups(str, Enum):
    """DAPO dynamic sampling: which groups are dropped before training (and replaced)."""

    none = "none"
    zero_variance = "zero_variance"


class ConsumptionGranularity(str, Enum):
    """What a partial-rollout round trains: its own draw of prompts (batch) or the first
    groups to finish (group)."""

    batch = "batch"
    group = "group"


class ServerUpdate(str, Enum):
    """What a rollout server does with a partial row's cached prefix at a weight update
    (rollout.servers.on_update): ``abort`` drops it (the next segment recomputes the prefix
    under the new weights), ``keep`` keeps the old weights' KV cache and continues on it."""

    abort = "abort"
    keep = "keep"


class ServerRouting(str, Enum):
    """Which rollout server an agent episode's calls go to (rollout.servers.routing):
    ``affine``, every call of an episode to the server of its first call (the one with the
    fewest episodes then); ``least_loaded``, every call to the server with the fewest requests
    in flight."""

    affine = "affine"
    least_loaded = "least_loaded"


class ServerTransfer(str, Enum):
    """How a weight sync reaches the rollout servers (rollout.servers.transfer): ``file``, one
    safetensors file every server reads; ``broadcast``, one process group of the trainer's
    first rank and every server's workers (NCCL on GPUs, gloo on CPU)."""

    file = "file"
    broadcast = "broadcast"


class BestMode(str, Enum):
    """Whether a higher or a lower value of trainer.checkpoint.keep_best is better."""

    max = "max"
    min = "min"


class TokenizerSource(str, Enum):
    """Which tokenizer a run uses: ``auto`` = model.tokenizer_path, else the tokenizer files of
    model.hf_path (an error when neither has a loadable one, or when model.hf_path has none);
    the built-in byte tokenizer only for a random-init model (no model.hf_path). ``bytes`` =
    the built-in byte tokenizer, chosen deliberately (e.g. a checkpoint trained with it)."""

    auto = "auto"
    bytes = "bytes"


class ToolParser(str, Enum):
    """How the agent endpoint reads tool calls from a completion (env.agent.tool_parser)."""

    none = "none"
    hermes = "hermes"
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Qwen3)."""


class OnDivergence(str, Enum):
    """What a harness call that rewrote its episode's history does (env.agent.on_divergence)."""

    split = "split"  # type: ignore[assignment]  # shadows str.split; the user-facing name
    error = "error"


class EnvOnError(str, Enum):
    """What an exception (or a timeout, or a wrong return type) in an environment's reset / step
    or an agent harness does (env.on_error): stop the run naming the environment, sample and
    turn; end that episode with reward 0 and train it (zero_reward: a crash is paid 0, more than
    a wrong answer scored below 0); or end it and leave it out of the loss and of its group's
    baseline (skip). Errored episodes count in the ``env_errors`` metric."""

    raise_error = "raise_error"
    zero_reward = "zero_reward"
    skip = "skip"


class ServedOnError(str, Enum):
    """What a served reward request (data.served: http, judge) still failing after its retries
    does: stop the run, or score its samples 0."""

    raise_error = "raise_error"
    zero_reward = "zero_reward"


class DistillEstimator(str, Enum):
    """Per-token teacher advantage of on-policy distillation (docs/grpo_loss.md,
    "On-policy distillation")."""

    reverse_kl = "reverse_kl"
    """log pi_teacher(y_t) - log pi_behaviour(y_t) on the sampled token: minus the one-sample
    estimate of the per-token reverse KL(student || teacher)."""
