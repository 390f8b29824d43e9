"""Config section ``rollout.vllm``: the vLLM rollout engine (``rollout.backend=vllm``;
docs/rollout.md).

One in-process vLLM engine per training rank (colocated), started from the model config alone
and fed the policy's weights before every generation with a new policy version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlbatch.config.enums import ServerFailure, ServerRouting, ServerTransfer, ServerUpdate


@dataclass
class VllmConfig:
    tensor_parallel_size: int = 1
    """vLLM's own tensor-parallel size, independent of parallel.tp: 1 = one full engine on every
    training rank (a training layout of tp 2 holds two; the first rank of each model-parallel
    group decodes and broadcasts its rows, the other's stays idle). Only 1 is supported in
    this release (the CPU build cannot shard)."""
    dtype: Optional[str] = None
    """Engine dtype: float32, bfloat16 or float16; null = the training dtype
    (model.params_dtype)."""
    kv_cache_space_gb: float = 1.0
    """CPU build: memory reserved for vLLM's paged KV cache, in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.3
    """GPU build: share of the GPU's memory vLLM may take (weights and KV cache), beside the
    training process's own."""
    max_num_seqs: int = 64
    """Most sequences vLLM decodes at once (its continuous batch)."""
    max_model_len: Optional[int] = None
    """Longest sequence (prompt + response) vLLM accepts; null = the run's longest sequence
    (data.max_prompt_len + rollout.max_new_tokens, or evaluation's eval.data.max_prompt_len +
    eval.max_new_tokens when longer). At most model.max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (a group's G rows share their prompt). Reset
    after every weight sync."""
    enforce_eager: bool = True
    """true: no CUDA graphs / torch.compile (fastest start, the CPU default); false: vLLM
    compiles and captures graphs (GPUs: faster decoding after a slower start)."""
    block_size: Optional[int] = None
    """Tokens per KV-cache block; null = vLLM's default (CPU: 128). Only whole blocks are reused
    by the prefix cache."""
    segment_tokens: int = 32
    """Partial rollouts (grpo.partial_rollouts): tokens a row decodes per request before the
    stream checks whether its round can end and refills free slots. A row that goes on is sent
    again as prompt + its tokens so far (the prefix cache keeps its whole KV blocks; after a
    weight sync they are recomputed under the new weights). Smaller: a round ends closer to the
    token at which it could, and free slots refill sooner; larger: fewer requests."""
    sleep: bool = False
    """Give the engine's GPU memory back while training: after each generation round (and
    each evaluation) vLLM sleeps at level 1 (weights copied to CPU memory, KV cache freed) and
    wakes before the next weight sync or decode. Needs generation not to overlap training
    (grpo.num_steps_async=0). The CPU build has no sleep mode: there the calls are made and
    recorded but free nothing."""


@dataclass
class ServersConfig:
    """``rollout.backend=vllm_server``: generation on separate vLLM servers (docs/rollout.md,
    "Rollout servers"); the engine settings are rollout.vllm's."""

    urls: list[str] = field(default_factory=list)
    """Running servers (started with rlbatch-serve), e.g. [http://node7:8000]; empty: rlbatch
    starts ``count`` servers itself."""
    count: int = 0
    """Servers rlbatch starts beside training on this machine (free ports on 127.0.0.1) and
    stops with the run; 0 when ``urls`` names running ones."""
    host: str = "127.0.0.1"
    """rlbatch-serve: the address the server listens on (0.0.0.0: every interface)."""
    port: int = 8000
    """rlbatch-serve: the port the server listens on."""
    devices: list[str] = field(default_factory=list)
    """GPU build: the CUDA_VISIBLE_DEVICES of each server rlbatch starts (one entry per
    server, e.g. ["2", "3"]) or of rlbatch-serve (the first entry); empty: the CPU build, or
    the process's own devices."""
    start_timeout_s: float = 600.0
    """How long a server rlbatch starts may take to answer /health."""
    timeout_s: float = 300.0
    """How long one request to a server may take (a generation, or a step of a weight update)
    before the server counts as failed (``on_failure``): a hung server. A server that dies
    counts as failed at once (its connection refused or closed), and so does one whose engine
    died behind a live HTTP server (its /health, read every few seconds while requests wait
    on it, fails)."""
    on_failure: ServerFailure = ServerFailure.stop  # type: ignore[attr-defined]
    """A server that refuses a request (connection refused, an HTTP 5xx answer) or does not
    answer within ``timeout_s``: ``stop`` ends the run with an error naming it, after saving a
    checkpoint of the last completed step (trainer.resume=auto continues there once the server
    is back); ``continue`` drops it for the rest of the run with a warning naming it, sends its
    rows to the other servers (each row carries its own seed: the same row on any server of the
    same weights) and skips it in weight syncs (metric rollout/servers_alive), and stops the
    run naming every dropped server when none is left. A dropped server is not taken back.
    ``restart`` (servers the run started, ``count``): the launcher starts a server whose
    process died again with the same command line at the same URL; meanwhile its rows go to
    the other servers (or wait for it when none is left), and it takes requests again only once
    it holds the run's current weights (the whole weights pushed and probed, as at the start).
    A server that answers with its start-up weights counts as restarted too. ``max_restarts``
    bounds it. A wrong answer (another process's weights, a response cut by the server's
    length, a failed probe) stops the run in every mode."""
    max_restarts: int = 3
    """``on_failure=restart``: how many times each server may be restarted; one that fails
    once more stops the run naming the server and its log. Counted in
    rollout/server_restarts."""
    max_resubmits: int = 4
    """How many times a row is sent again after its server aborted it (vLLM answers an aborted
    request with the tokens so far and finish_reason ``abort``: another client's ``POST
    /pause``, whose default mode aborts the requests in flight, ``/abort_requests``, a server
    shutting down). The row is sent whole with its own seed, so it is the row an undisturbed
    server samples; nothing of the aborted answer is kept (with partial rollouts, the aborted
    segment is sent again from the row's tokens before it). Counted in
    rollout/server_resubmits; a row aborted once more than this stops the run naming the
    server. 0: the first abort stops the run."""
    max_concurrency: int = 64
    """Requests in flight at once from one issuing rank (spread over the servers)."""
    routing: ServerRouting = ServerRouting.affine
    """Agent harness episodes (env.harness, env.agent.openenv_url): which server each call
    goes to. ``affine``: every call of an episode to the server its first call went to, whose
    prefix cache holds the conversation so far (a new episode to the server with the fewest
    episodes, then the fewest requests in flight); ``least_loaded``: every call to the server
    with the fewest of this rank's requests in flight (a tie: one of them at random), wherever
    its episode's earlier calls went (the conversation is prefilled again on a server that has
    not seen it). Either way a call samples the same tokens (its own seed, the same weights on
    every server). Other requests always go to the least loaded server. rlbatch-bench fleet
    measures both (docs/agents.md)."""
    transfer: ServerTransfer = ServerTransfer.file
    """How a weight sync reaches the servers. ``file``: the trainer's first rank writes the
    Hugging Face-named tensors to one safetensors file (``transfer_dir``) that every server
    reads; needs a directory every server can read (one machine's /dev/shm, or a shared
    filesystem). ``broadcast``: the trainer's first rank and every server's workers form one
    process group (rendezvous at ``transfer_host``) and each tensor is broadcast to all
    servers at once, with nothing written to disk: NCCL between GPUs (the servers run vLLM's
    own ``nccl`` transfer backend; rlbatch-serve starts them so), gloo on CPU (rlbatch's
    transfer plugin). rlbatch-serve starts servers with the backend the config's transfer
    needs. A server that fails before or after the tensors travel is one server's failure
    (``on_failure``); the group not forming, or a broadcast that breaks in the middle, stops the
    run in either mode (the group's other servers cannot finish without it)."""
    transfer_dir: Optional[str] = None
    """``transfer=file``: where the weights file of a sync is written for the servers to read
    (a directory every server can read: the same machine, or a shared filesystem); null:
    /dev/shm when it exists, else the system's temporary directory. The file is removed once
    every server has read it; one that a killed trainer left (a whole model) is removed by the
    next sync or rlbatch-serve on that machine (not one whose lock a live trainer holds)."""
    transfer_host: Optional[str] = None
    """``transfer=broadcast``: the address at which the servers reach the trainer's first rank
    (it hosts the group's rendezvous on a free port); null: 127.0.0.1 when every server is on
    this machine's loopback, else this machine's host name."""
    probe_tokens: int = 4
    """After each weight sync every server scores a fixed prompt followed by this many fixed
    tokens (and samples one token after them), and their log-probabilities are compared with
    the trainer's own: within ``probe_tolerance``, and nearer the trainer's current ones than
    the previous sync's (a server one sync behind is refused even when a step moved them by
    less than the tolerance); 0: no probe. The probe's sequence (8 prompt tokens, these, and the
    one sampled) must fit the servers' length (rollout.vllm.max_model_len), or the run is
    refused before launch."""
    probe_tolerance: Optional[float] = None
    """Largest log-probability difference the probe accepts; null: by the engine's dtype,
    1e-3 for float32 (float32 engines agree to ~1e-6), the dtype's numeric noise for the others
    (5e-2 for bfloat16, 5e-3 for float16). A value below that noise is refused before launch:
    the probe would refuse servers that hold the right weights."""
    on_update: ServerUpdate = ServerUpdate.abort
    """Partial rollouts (grpo.partial_rollouts): what the servers do with the rows still
    decoding when new weights arrive. ``abort``: the prefix cache is dropped with the update,
    so a row's next segment recomputes its prefix (older versions' tokens included) under the
    new weights and every token and behaviour log-prob is exactly its own version's, as with
    rollout.backend=vllm. ``keep``: the cache survives the update and rows continue on the KV
    computed by the old weights (no prefill recompute); their tokens are sampled by a mix of
    versions that no single policy reproduces, their behaviour log-probs the ones that sampled
    them, corrected like any staleness (grpo.rollout_correction). Also fresh rows whose prompt
    blocks are cached reuse the old KV. The cache is still dropped whenever it would hold KV
    grpo.max_staleness versions older than the new weights (metric rollout/kv_cache_age: the
    cache's age in versions after each sync). docs/rollout.md, "Rollout servers", has the
    figures behind the default."""
