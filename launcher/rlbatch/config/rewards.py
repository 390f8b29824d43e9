"""Config of the rewards users bring (docs/data_and_rewards.md): code run in a sandbox
(``data.code_exec``), rewards served over HTTP or by an LLM judge (``data.served``,
``data.judge``) and a local reward model (``data.reward_model``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from rlbatch.config.enums import ServedOnError


class Isolation(str, Enum):
    """How code_exec isolates a program: ``auto`` (unshare when it works here, else an error),
    ``unshare`` (util-linux namespaces; an error when they do not work) or ``none`` (rlimits and a
    clean environment only: an explicit opt-out, for machines without namespaces)."""

    auto = "auto"
    unshare = "unshare"
    none = "none"


class CodeSource(str, Enum):
    """Which part of a completion is the program: the last fenced code block (```python or
    plain ```; the whole completion when it has none), or the whole completion."""

    last_block = "last_block"
    whole = "whole"


@dataclass
class SandboxLimits:
    """Limits of one sandboxed execution."""

    cpu_s: float = 5.0
    """CPU seconds (RLIMIT_CPU): a busy loop ends here with reason timeout."""
    wall_s: float = 10.0
    """Wall seconds from the program's start, sleeping included but not time spent waiting for a
    CPU or blocked on a busy disk; beyond it every process of the sandbox is killed (never
    later than 10 x wall_s)."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS) in MiB of each process: a bigger allocation raises MemoryError
    (reason memory); with a memory cgroup, memory_mb + scratch_mb for all its processes."""
    file_size_mb: int = 8
    """Largest file the program may write, its standard output included (RLIMIT_FSIZE)."""
    max_open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_processes: int = 16
    """Processes and threads of the program's uid (RLIMIT_NPROC; each execution has its own
    uid when rlbatch runs as root, so a fork bomb stops here)."""
    scratch_mb: int = 64
    """Size of the tmpfs that holds the scratch directory (and covers /tmp, /dev/shm)."""
    max_output_bytes: int = 1_000_000
    """Standard output compared with the expected output (the rest is not read)."""


class RewardModelTemplate(str, Enum):
    """What text the reward model reads: ``policy``, the prompt as the policy saw it (its chat
    template) followed by the completion; ``model``, the prompt and the completion as one user
    and one assistant turn in the reward model's own chat template (what a discriminative RM
    was trained on)."""

    policy = "policy"
    model = "model"


class RewardModelDtype(str, Enum):
    """Weights and activations of the reward model: ``auto`` (bfloat16 on a GPU, float32 on
    the CPU), ``float32`` or ``bfloat16``."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


@dataclass
class CodeExecConfig:
    code: CodeSource = CodeSource.last_block
    """The program: the last fenced code block of the completion, or the whole completion."""
    all_or_nothing: bool = False
    """Reward 1 only when every test passes (false: the fraction of tests passed)."""
    isolation: Isolation = Isolation.auto
    """auto | unshare | none (none: no namespaces; an explicit opt-out, see the docs)."""
    num_workers: int = 2
    """Executions at once (per trainer process)."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    """Per execution limits."""
    stub_check_rows: int = 4
    """Rows of the training dataset (a sample drawn with trainer.seed) whose tests rlbatch-train
    runs against stub programs before launch (returning None, NaN or an opaque object, raising
    StopIteration, printing nothing, echoing the input): a warning names the rows a stub
    passes, whose tests a policy can game. 0 turns the check off; rlbatch-score checks every
    row it scores."""


@dataclass
class ServedConfig:
    """Requests to a reward server (data.reward=http) or judge (data.reward=judge)."""

    timeout_s: float = 30.0
    """Longest one request may take, all of it (connect, send, the whole answer): a deadline,
    not a limit on each read."""
    retries: int = 3
    """Retries of a request that failed with a 5xx status or a connection error (a timeout
    too with retry_timeouts)."""
    retry_timeouts: bool = False
    """Retry a request that ran out of time too (off: a judge slowed by load is not asked
    again, which would only add to its load)."""
    backoff_s: float = 0.5
    """Wait before the first retry; doubled before each next one (each wait drawn between half
    and all of it)."""
    max_response_bytes: int = 1_000_000
    """Largest answer read; a bigger one is a failed request (not retried)."""
    max_concurrency: int = 8
    """Requests in flight at once (per trainer process)."""
    batch_size: int = 1
    """http: samples per request (> 1 posts {"samples": [...]} and reads {"rewards": [...]})."""
    on_error: ServedOnError = ServedOnError.raise_error
    """A request still failing after its retries (no answer, an error status, not the expected
    JSON): raise_error stops the run naming the URL and the sample; zero_reward scores that
    sample 0 (counted in reward_fail/served_error). An answer read but unusable (a judge reply
    without one readable score, a reward out of range) always scores 0 (reward_fail/no_score,
    reward_fail/out_of_range)."""
    max_error_fraction: float = 0.5
    """Most of a step's samples (over every DP rank) that may have a served failure (any of the
    above, scored 0): more stops the run before that step trains, naming the step and an
    example. 1 never stops; 0 stops at the first failure. Under grpo.filter_groups the samples
    a round draws and does not train (a group whose every reward failed is flat, dropped) count
    too, on the round's first step. Must be 0 when data.reward_weights weighs an http or judge
    reward below 0 (its failures, scored 0, would escape the penalty)."""
    check: bool = True
    """Ask the endpoint once before launch (an error names the URL and what came back)."""


@dataclass
class JudgeConfig:
    url: Optional[str] = None
    """The judge's OpenAI-compatible server (base URL or its /v1/chat/completions URL); null =
    data.reward_url (set this one when a run also has data.reward=http)."""
    model: str = "judge"
    """The ``model`` field of the chat request."""
    template: Optional[str] = None
    """Prompt of the judge with {prompt}, {completion}, {answer} and {max_score}; null = the
    built-in one (which asks for a last line ``Score: N``)."""
    score_pattern: Optional[str] = None
    """Regular expression that finds the score in a reply, with a group named ``score`` (and
    optionally one named ``max``, the scale the judge wrote, which must be max_score); null =
    ``Score: N`` or ``Score: N/M``."""
    max_score: float = 10.0
    """The judge's scale: a score in [0, max_score] is divided by this; one outside it is a
    failed request."""
    max_tokens: int = 64
    """Longest judge reply."""
    temperature: float = 0.0
    """Sampling temperature of the judge."""


@dataclass
class RewardModelConfig:
    """Scoring of data.reward=reward_model (its forwards are planned under batching.infer)."""

    max_length: int = 2048
    """Longest prompt + completion scored; longer ones keep their last tokens."""
