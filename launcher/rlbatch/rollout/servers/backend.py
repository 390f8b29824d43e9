"""``rollout.backend=vllm_server``: generation on separate vLLM servers (rlbatch-serve, or
``rollout.servers.count`` servers the launcher starts), over HTTP.

Where requests come from: the first rank of each model-parallel group (tp x pp ranks, one
replica of the model) sends its own data-parallel shard's rows, one request per row
(``POST /inference/v1/generate``: prompt ids, the row's own seed, the EOS ids as its only stop
ids, log-probs of the sampled tokens; what an answer may be: rlbatch.rollout.servers.answers), at
most ``rollout.servers.max_concurrency`` in flight, each to the server with the fewest of this
rank's requests outstanding (an agent episode's calls, env.harness: all to the server its first
call went to, whose prefix cache holds the conversation; a new episode to the server with the
fewest episodes; rollout.servers.routing=least_loaded sends them like any other row); the
decoded rows are broadcast to the group's other ranks, as with
the colocated engines. Every replica thus sends its own share at the same time, with no extra
hop through one client.

Weight sync (whenever the policy version changes): the first replica's group streams the
Hugging Face-named full tensors once from its tp / pp shards (rlbatch.rollout.weights); its
first rank, global rank 0, hands them to every server through vLLM's RL lifecycle, as a file or
a broadcast over one process group (``rollout.servers.transfer``, rlbatch.rollout.servers.sync),
labelling the weights of this sync (finish_weight_update) and dropping the prefix cache (vLLM
keeps it across updates; partial rollouts with rollout.servers.on_update=keep leave it, within
grpo.max_staleness versions, so rows continue on the old KV: rlbatch.rollout.servers.cache).
The other replicas' first ranks wait until every server reports that label (GET /weight_info)
before they decode. Then a probe (rlbatch.rollout.servers.probe): every server scores a fixed
sequence, whose log-probabilities must equal the trainer's own forward of the same tokens
within ``rollout.servers.probe_tolerance`` and be nearer the trainer's current ones than the
previous sync's, or the run stops naming the server.

Failures: a server that refuses a request (no connection, an HTTP 5xx answer) or does not
answer within ``rollout.servers.timeout_s`` stops the run with an error naming it
(``rollout.servers.on_failure=stop``; the loop first saves the last completed step), or with
``on_failure=continue`` leaves this process's pool: its rows go to the servers left (a row's
seed makes it the same row on any server of the same weights), syncs skip it, and the run stops
naming every dropped server when none is left. With ``on_failure=restart`` (servers the
launcher started; it starts a dead one again at the same URL: rlbatch.runtime.driver) a server
that is down, or answers with its start-up weights, leaves the pool the same way, and comes
back at the next sync once its /health answers (the pushing replica pushes it the whole weights
and probes it with the others; a replica that does not push takes it once it holds the sync's
label); when no server is left, the rows wait for the first one back, which the pushing replica
pushes the current sync's weights (kept for this) and probes on its own, up to
``start_timeout_s``. ``max_restarts`` failures of one server later, the next stops the run
naming it and its log. The replicas agree on the pool through the
servers themselves: a replica that does not send the weights takes a server only once it holds
the label of this sync, so a server the first replica dropped during its push is dropped by
every replica at that sync, and one that dies later is dropped by each replica that reaches it.
A row the server aborted (another client's pause) is sent again with its own seed, and so is
the probe. A wrong
answer stops the run in either mode: a response the server stopped short of its limit (vLLM
ends a request at its own --max-model-len with finish_reason "length": trained as a truncated
row, it would be a wrong sample, not an error), any end but a stop at the run's EOS ids or the
row's limit, and a token labelled with other weights than the run pushed last, or with none
(another process updated the server, or it was restarted).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any, Optional

from rlbatch.config.schema import (
    RunConfig,
    ServerFailure,
    ServerRouting,
    ServerUpdate,
    SyncFault,
)
from rlbatch.rollout.protocol import (
    DecodedRow,
    SyncedRolloutEngine,
    TokenSampling,
    TurnDecoder,
    decode_on_group_leader,
    token_sampling,
)
from rlbatch.rollout.servers.answers import RowAborted, probe_server, read_row, request_body
from rlbatch.rollout.servers.cache import drops_cache
from rlbatch.rollout.servers.checks import check_servers  # noqa: F401  (rollout.protocol's)
from rlbatch.rollout.servers.client import ServerDownError, ServerError, call
from rlbatch.rollout.servers.pool import LOGS_ENV, ServerPool, server_urls
from rlbatch.rollout.servers.probe import NOISE, SEPARATION, judge_probe, probe_sequence
from rlbatch.rollout.servers.sync import close_group, push

log = logging.getLogger("rlbatch.rollout")


_SERVERS: list[ServerPool] = []


def run_nonce() -> str:
    """The run's sync-label nonce, the same on every rank (a collective on the default group:
    every rank calls it, in the training thread)."""
    import torch.distributed as dist

    nonce = [uuid.uuid4().hex[:12]]
    if dist.is_initialized():
        dist.broadcast_object_list(nonce, src=0)
    return nonce[0]


def _connect(cfg: RunConfig) -> ServerPool:
    if not _SERVERS:
        join_run(cfg, run_nonce(), pushes=True)
    return _SERVERS[0]


def join_run(cfg: RunConfig, nonce: str, *, pushes: bool) -> None:
    """Connect this process with the run's nonce; pushes=False: it only waits for the labels
    another process pushes (a generation worker of a trainer DP rank other than 0)."""
    s = cfg.rollout.servers
    keep_going = ServerFailure(s.on_failure) == ServerFailure["continue"]
    restart = ServerFailure(s.on_failure) == ServerFailure["restart"]
    urls = server_urls(cfg)
    logs = os.environ.get(LOGS_ENV, "")
    _SERVERS[:] = [
        ServerPool(
            urls, s.timeout_s, s.max_concurrency, nonce, keep_going, pushes=pushes,
            max_restarts=s.max_restarts if restart else None,
            logs=dict(zip(urls, logs.split(","), strict=False)) if logs else None,
            start_timeout_s=s.start_timeout_s,
        )
    ]  # fmt: skip


def shutdown_engine() -> None:
    """Close this process's connection (the servers themselves belong to whoever started
    them: rlbatch-serve, or the launcher)."""
    if _SERVERS:
        servers = _SERVERS.pop()
        close_group(servers)
        servers.pool.shutdown(wait=False, cancel_futures=True)


def release_memory() -> None:
    """A server keeps its memory: nothing to give back in the trainer's process."""


class ServerBackend:
    """A TokenBackend on the run's vLLM servers (the module's docstring)."""

    def __init__(self, model: Any, cfg: RunConfig) -> None:
        from rlbatch.distributed import dp_rank, max_in_expert_group, model_parallel_group
        from rlbatch.engine.hf import full_model_config

        self.model = model
        self.cfg = cfg
        self.model_cfg = full_model_config(model, cfg.model)
        rank, self.group_size, _ = model_parallel_group()
        self.leader = rank == 0
        self.servers = _connect(cfg)
        # the first replica's group gathers and sends
        self.streams = dp_rank() == 0 and self.servers.pushes
        # an MoE model's experts are spread over the expert-parallel group, which spans
        # replicas: the first replica's peers in it take part in the stream (each gathers its
        # experts to the others) and in the probe's forward (an all-to-all over that group)
        streaming_peer = bool(max_in_expert_group(int(self.streams)))  # every rank calls
        self.expert_peer = streaming_peer and not self.streams
        self.seconds: dict[str, float] = {}
        # vLLM keys its prefix cache by token ids alone: kept across an update, a cached
        # prefix goes on with the old weights' KV (rollout.servers.on_update=keep, partial
        # rollouts only: a whole-round run has no row to continue)
        keep = ServerUpdate(cfg.rollout.servers.on_update) == ServerUpdate.keep
        self.drops_cache = not (keep and cfg.grpo.partial_rollouts)
        # rollout.servers.routing: an agent episode's calls kept on one server, or each call
        # to the least loaded one
        self.affine = ServerRouting(cfg.rollout.servers.routing) == ServerRouting.affine
        if self.servers.max_restarts is not None and self.leader:
            self.servers.rejoin = self._rejoin_any

    @property
    def version(self) -> Optional[int]:
        s = self.servers
        return s.version if s.model_id == id(self.model) else None

    @version.setter
    def version(self, value: Optional[int]) -> None:
        self.servers.model_id, self.servers.version = id(self.model), value

    def sync_weights(self, version: int) -> None:
        drop = self._drops_cache(version)
        self._sync(drop)
        if drop:  # every process of the run follows the same rule
            self.servers.cache_version = version
        self.servers.synced_version = version

    def _sync(self, drop: bool) -> None:
        self.servers.version = None
        self.servers.syncs += 1
        label = self.servers.label()
        from rlbatch.distributed import from_first_in_model_parallel_group
        from rlbatch.rollout.weights import stream_hf_weights

        if self.leader and self.streams:
            self._readmit_at_sync()
        if not self.streams:
            if self.expert_peer:  # the first replica's stream gathers our experts
                for _ in stream_hf_weights(self.model, self.model_cfg):
                    pass
            # the group's ranks all raise what its first rank meets
            from_first_in_model_parallel_group(
                (lambda: self._await_label(label)) if self.leader else None
            )
            if self.expert_peer and self.cfg.rollout.servers.probe_tokens > 0:
                n = self.cfg.rollout.servers.probe_tokens
                sequence, prompt_len = probe_sequence(n, self.model_cfg.vocab_size)
                trainer_logprobs(self.model, self.cfg, [sequence], prompt_len)  # in step
            return

        tensors = {}
        for name, tensor in stream_hf_weights(self.model, self.model_cfg):
            if self.leader:  # a tied head is the embedding's tensor: saved as its own copy
                tensors[name] = tensor.detach().clone().contiguous()
        if self.leader:
            tensors = self._faulty(tensors)
            if self.servers.max_restarts is not None:
                self.servers.kept = (tensors, drop)
        call_ = (
            (lambda: push(self.servers, self.cfg, tensors, label, drop)) if self.leader else None
        )
        from_first_in_model_parallel_group(call_)
        self._probe()

    def _faulty(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """debug.fail_sync=omit_tensor / stale at the sync for step debug.fail_at_step: all
        tensors but one (a norm's), or the previous sync's tensors (tests of the checks)."""
        from rlbatch.runtime import progress

        d = self.cfg.debug
        fault = None if d.fail_sync is None else SyncFault(d.fail_sync)
        if fault not in (SyncFault.omit_tensor, SyncFault.stale):
            return tensors
        previous, self.servers.pushed = self.servers.pushed, tensors
        if progress.current.step != d.fail_at_step:
            return tensors
        if fault == SyncFault.stale:
            return previous if previous is not None else tensors
        left_out = next((name for name in tensors if "norm" in name), next(iter(tensors)))
        return {name: t for name, t in tensors.items() if name != left_out}

    def _drops_cache(self, version: int) -> bool:
        """Whether the sync to ``version`` drops the servers' prefix cache
        (rlbatch.rollout.servers.cache)."""
        return drops_cache(
            not self.drops_cache, self.servers.cache_version, version, self.cfg.grpo.max_staleness
        )

    def _readmit_at_sync(self) -> None:
        """on_failure=restart, the pushing replica at a sync: a server that is back (its
        /health answers) joins the pool before the push, so it is pushed the whole weights and
        probed with the others (a replica that does not push takes it once it holds this
        sync's label: :meth:`_await_label`)."""
        from rlbatch.rollout.servers.client import health

        for url in list(self.servers.down):
            if health(url) is None:
                self.servers.readmit(url)

    def _holds(self, url: str, label: str) -> bool:
        try:
            info = call(url, "/weight_info", timeout_s=self.servers.timeout_s, get=True)
        except ServerError:
            return False
        return str((info or {}).get("weight_version")) == label

    def _rejoin_any(self) -> None:
        """No server is left and some are restarting: wait for the first one back
        (``rollout.servers.start_timeout_s``) and take it once it holds the run's current
        weights: the pushing replica pushes it the last sync's tensors and probes it against
        the trainer's log-probabilities of that sync; another replica waits for that sync's
        label on it."""
        s = self.servers
        deadline = time.monotonic() + s.start_timeout_s
        while time.monotonic() < deadline:
            for url in list(s.down):
                if self._resync(url):
                    s.readmit(url)
                    return
            time.sleep(1.0)
        names = "; ".join(f"{url} (log: {s.log_of(url)})" for url in s.down)
        raise ServerError(
            f"no rollout server is left and none came back within"
            f" rollout.servers.start_timeout_s={s.start_timeout_s:g} s: {names}"
        )

    def _resync(self, url: str) -> bool:
        """Whether ``url`` is back and now holds the run's current weights."""
        from rlbatch.rollout.servers.client import health

        s = self.servers
        if s.syncs == 0:  # nothing pushed yet: the start-up weights are the run's
            return health(url) is None
        label = s.label()
        if s.kept is None:  # another process pushes
            return self._holds(url, label)
        if health(url) is not None:
            return False
        tensors, _ = s.kept
        try:
            push(_OneServer(s, url), self.cfg, tensors, label, True)
            self._probe_alone(url)
        except ServerDownError:
            return False
        return True

    def _probe_alone(self, url: str) -> None:
        """The probe of one server taken back between syncs: its log-probabilities of the
        probe's fixed tokens against the trainer's of this sync (no forward: the trainer's
        ranks are elsewhere in the step)."""
        from rlbatch.config.dtypes import engine_dtype, probe_tolerance

        n = self.cfg.rollout.servers.probe_tokens
        current = self.servers.probe_logps
        if n <= 0 or current is None:
            return
        sequence, prompt_len = probe_sequence(n, self.model_cfg.vocab_size)
        fixed, _, _ = self._score(url, sequence, prompt_len)
        noise = NOISE.get(engine_dtype(self.cfg), NOISE["float32"])
        verdict = judge_probe(fixed, current, None, noise)
        tol = probe_tolerance(self.cfg)
        if verdict.off > tol:
            raise RuntimeError(
                f"rollout server {url}, restarted, holds other weights than the trainer after"
                f" its sync: its log-probabilities of the probe's tokens are {verdict.off:.3g}"
                f" off the trainer's (rollout.servers.probe_tolerance={tol:g})"
            )

    def _await_label(self, label: str) -> None:
        deadline = time.monotonic() + self.servers.timeout_s
        for url in list(self.servers.urls):
            try:
                self._await_server(url, label, deadline)
            except ServerError as err:  # the first replica dropped it, or it is down
                self.servers.drop(url, err)
        for url in list(self.servers.down):  # on_failure=restart: the first replica took it
            try:
                self._await_server(url, label, min(deadline, time.monotonic() + 10.0))
            except ServerError:
                continue
            self.servers.readmit(url)

    def _await_server(self, url: str, label: str, deadline: float) -> None:
        while True:
            info = call(url, "/weight_info", timeout_s=self.servers.timeout_s, get=True)
            if str(info.get("weight_version")) == label:
                return
            if time.monotonic() > deadline:
                raise ServerDownError(
                    f"rollout server {url} did not take the policy's new weights within"
                    f" {self.servers.timeout_s:g} s (rollout.servers.timeout_s)"
                )
            time.sleep(0.05)

    def figures(self) -> dict[str, float]:
        """rollout/servers_alive: the servers in this replica's pool (its first rank counts,
        the loop averages over replicas); rollout/server_resubmits: rows a server aborted and
        this process sent again (summed over replicas); rollout/kv_cache_age: how many policy
        versions older than the last sync's the KV the servers' prefix cache may hold is
        (rlbatch.rollout.servers.cache; averaged over replicas like the pool's size);
        rollout/server_restarts: servers taken back after a restart (on_failure=restart;
        summed over replicas)."""
        s = self.servers
        n = float(len(s.urls)) if self.leader else 0.0
        resubmits = float(s.take_resubmits()) if self.leader else 0.0
        restarts = float(s.take_rejoined()) if self.leader else 0.0
        age = 0.0
        if self.leader and s.synced_version is not None and s.cache_version is not None:
            age = float(s.synced_version - s.cache_version)
        return {
            "rollout/servers_alive": n, "rollout/server_pools": float(self.leader),
            "rollout/server_resubmits": resubmits, "rollout/kv_cache_age": age,
            "rollout/server_restarts": restarts,
        }  # fmt: skip

    def _probe(self) -> None:
        """Every server holds this sync's weights (rlbatch.rollout.servers.probe): its
        log-probabilities of the probe's fixed tokens (and of one token it samples after them)
        equal the trainer's within the tolerance, and are nearer the trainer's current ones than
        the previous sync's."""
        from rlbatch.config.dtypes import engine_dtype, probe_tolerance
        from rlbatch.distributed import from_first_in_model_parallel_group

        n = self.cfg.rollout.servers.probe_tokens
        if n <= 0:
            return
        sequence, prompt_len = probe_sequence(n, self.model_cfg.vocab_size)

        def ask() -> list[tuple[str, list[float], int, float]]:
            answers = []
            for url in list(self.servers.urls):
                try:
                    answers.append((url, *self._score(url, sequence, prompt_len)))
                except ServerError as err:
                    self.servers.drop(url, err)
            return answers

        answers = from_first_in_model_parallel_group(ask if self.leader else None)
        ours = trainer_logprobs(
            self.model, self.cfg, [sequence + [a[2]] for a in answers] or [sequence], prompt_len
        )
        current = ours[0][:n]
        previous, self.servers.probe_logps = self.servers.probe_logps, current
        tol = probe_tolerance(self.cfg)
        noise = NOISE.get(engine_dtype(self.cfg), NOISE["float32"])
        # no answer: every server left the pool during the push (on_failure=restart: the rows
        # wait for one to come back); the forward above ran the probe alone, in step
        for (url, fixed, _, sampled), mine in zip(answers, ours[: len(answers)], strict=True):
            verdict = judge_probe(fixed + [sampled], mine, None, noise)
            if verdict.off > tol:
                raise RuntimeError(
                    f"rollout server {url} holds other weights than the trainer after the sync:"
                    f" its log-probabilities of the probe's tokens are {verdict.off:.3g} off the"
                    f" trainer's (rollout.servers.probe_tolerance={tol:g}); is it serving this"
                    " run's model and dtype?"
                )
            version = judge_probe(fixed, current, previous, noise)
            if version.undecided:
                log.info(
                    "the probe cannot tell this sync's weights from the previous one's: the step"
                    " moved its log-probabilities by %.3g, within the engine's noise (%g x %g);"
                    " checked against rollout.servers.probe_tolerance only",
                    version.moved, SEPARATION, noise,
                )  # fmt: skip
            if version.behind:
                raise RuntimeError(
                    f"rollout server {url} holds the previous sync's weights, not this one's:"
                    f" its log-probabilities of the probe's fixed tokens are {version.off:.3g}"
                    f" off the trainer's current ones but {version.off_previous:.3g} off the"
                    f" previous sync's (the step moved them by {version.moved:.3g}); the sync"
                    " did not reach it whole"
                )

    def _score(
        self, url: str, sequence: list[int], prompt_len: int
    ) -> tuple[list[float], int, float]:
        """The server's answer to the probe (rlbatch.rollout.servers.answers.probe_server)."""
        return probe_server(
            url, sequence, prompt_len, timeout_s=self.servers.timeout_s,
            label=self.servers.label(), max_resubmits=self.cfg.rollout.servers.max_resubmits,
            on_resubmit=self.servers.count_resubmit,
        )  # fmt: skip

    def decode(
        self,
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        sampling: TokenSampling,
        max_tokens: Optional[Sequence[int]] = None,
        episodes: Optional[Sequence[str]] = None,
    ) -> list[DecodedRow]:
        """The TokenBackend's decode; ``episodes``: the agent episode of each row, whose
        requests stay on one server (:meth:`ServerPool.least_loaded`) until :meth:`release`."""
        return decode_on_group_leader(
            lambda: self._generate(prompt_ids, seeds, sampling, max_tokens, episodes),
            self.group_size,
            self.leader,
        )

    def release(self, episodes: Sequence[str]) -> None:
        """The agent ``episodes`` ended: their servers take new episodes."""
        self.servers.unpin(episodes)

    def _generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        sampling: TokenSampling,
        max_tokens: Optional[Sequence[int]],
        episodes: Optional[Sequence[str]] = None,
    ) -> list[DecodedRow]:
        limits = [sampling.max_new_tokens] * len(seeds) if max_tokens is None else max_tokens
        keys: Sequence[Optional[str]] = [None] * len(seeds)
        if episodes is not None and self.affine:  # rollout.servers.routing
            keys = episodes
        futures = [
            self.servers.pool.submit(self._balanced, list(ids), seed, sampling, limit, key)
            for ids, seed, limit, key in zip(prompt_ids, seeds, limits, keys, strict=True)
        ]
        return [f.result() for f in futures]

    def _balanced(
        self,
        ids: list[int],
        seed: int,
        sampling: TokenSampling,
        limit: int,
        episode: Optional[str] = None,
    ) -> DecodedRow:
        """The row from the least loaded server (an agent episode's: its own); with
        on_failure=continue, from the next one when that server is down (the same row: the
        request carries the row's seed)."""
        while True:
            url = self.servers.least_loaded(episode)
            try:
                row = self._request(url, ids, seed, sampling, limit)
                row.server = url
                return row
            except ServerError as err:
                self.servers.drop(url, err)
            finally:
                self.servers.done(url)

    def _request(
        self, url: str, ids: list[int], seed: int, sampling: TokenSampling, limit: int
    ) -> DecodedRow:
        """The row of one request (rlbatch.rollout.servers.answers): a row the server aborted is
        sent again with its own seed, up to rollout.servers.max_resubmits times."""
        eos_ids = [i for i in sampling.eos_ids if i >= 0]
        body = request_body(ids, seed, limit, sampling, eos_ids)
        label = self.servers.label() if self.servers.syncs else None
        most = self.cfg.rollout.servers.max_resubmits
        for attempt in range(most + 1):
            answer = call(url, "/inference/v1/generate", body, timeout_s=self.servers.timeout_s)
            try:
                return read_row(
                    url, answer["choices"][0], eos_ids=eos_ids, limit=limit,
                    prompt_len=len(ids), label=label,
                )  # fmt: skip
            except RowAborted:
                if attempt < most:
                    self.servers.count_resubmit()
        raise ServerError(
            f"rollout server {url} aborted the same row {most + 1} times"
            f" (rollout.servers.max_resubmits={most}): another client keeps pausing it (POST"
            " /pause aborts the requests in flight unless mode=wait or keep) or aborting its"
            " requests; give the run servers of its own, or raise rollout.servers.max_resubmits"
        )


class _OneServer:
    """One server as a pool of its own (rlbatch.rollout.servers.sync.ServerPool): the push to
    a server taken back between syncs; its failure is raised."""

    def __init__(self, servers: ServerPool, url: str) -> None:
        self.urls = [url]
        self.nonce = servers.nonce
        self.timeout_s = servers.timeout_s
        self.group: Any = None

    def drop(self, url: str, error: ServerError) -> None:
        raise error


def trainer_logprobs(
    model: Any, cfg: RunConfig, sequences: list[list[int]], prompt_len: int
) -> list[list[float]]:
    """The policy's own log-probabilities (temperature 1) of each sequence's tokens after the
    first ``prompt_len`` (collective over the model-parallel group, and the expert-parallel
    group: its peers call it too, on sequences of their own)."""
    from rlbatch.batching import plan_pass
    from rlbatch.engine.logprobs import compute_logprobs
    from rlbatch.grpo.stages import in_step_with_expert_group

    infer, p = cfg.batching.infer, cfg.parallel
    plan = plan_pass(
        [len(s) for s in sequences], infer, dp=1, pp=p.pp, vpp=p.vpp,
        microbatch_group_size=p.microbatch_group_size_per_vp_stage, seed=cfg.trainer.seed,
    )  # fmt: skip
    # MoE at ep > 1: as many forwards as the expert-parallel peers run (filler micro-batches)
    plan = in_step_with_expert_group(plan, infer.sequence_length_round)
    logps = compute_logprobs(
        model, sequences, plan, round_to=infer.sequence_length_round, temperature=1.0,
        score_from=[prompt_len - 1] * len(sequences),
    )  # fmt: skip
    return [lp.tolist() for lp in logps]


def build_server_engine(
    cfg: RunConfig, model: Any, *, eos_ids: Sequence[int], turns: Optional[TurnDecoder] = None
) -> SyncedRolloutEngine:
    """The RolloutEngine of rollout.backend=vllm_server on this rank's policy chunks."""
    backend = ServerBackend(model, cfg)
    return SyncedRolloutEngine(backend, token_sampling(cfg.rollout, eos_ids), turns=turns)
