"""A generation worker process: async run-ahead that really overlaps with training.

The trainer's producer (``RunAheadProducer(threaded=True)``) calls :class:`GenerationWorker` as
its generate_fn from its generation thread; the call ships the request (and, once per policy
version, the weight snapshot) to a spawned process and blocks on the pipe, which releases the
GIL: the worker generates the next round on its own cores while the trainer trains the current
step.

The worker holds everything generation needs, built from the same config as the trainer's
inline path (rlbatch.train.build): its own copy of the policy's architecture (no DDP, no
grads), the reference model (weights sent once, at start), the tokenizer, the prompts, the
reward function and its DP rank's LCM aggregator. It has its own torch.distributed world of one
and its own Megatron parallel state, so it never issues a collective on the trainer's process
groups, and it needs none itself: only layouts whose generation is local (tp = pp = cp = 1)
use it. Samples, versions and the aggregator's counters (seeds) are those the inline path
produces: same seed, same results (tested). The aggregator's state comes back with every round,
for checkpoints, and is restored into the worker on resume.

With rollout.backend=vllm_server the worker's engine is a ServerBackend of its own, told its
trainer's DP rank and the run's sync-label nonce (broadcast by the trainers at build time): DP
rank 0's worker pushes each version it receives to the servers, the other replicas' workers
wait for that version's label, as the replicas of the inline path do. With dp > 1 the
replicas' generation threads meet on a gloo group of their own (created by every trainer rank
at build time, in the training thread) before each call with a new version, so no worker still
samples the previous version when the push replaces it; every replica calls with the same
sequence of versions, and one that died fails the others within trainer.timeout_s. The workers
are the run's only clients of the servers (rlbatch.config.servers_rules refuses evaluation in
the trainer, which would push the trainer's weights under them). The server URLs of
rollout.servers.count reach them through the environment the spawn inherits.

The worker dies with its rank (rlbatch.runtime.lifeline: SIGKILL when the rank process dies,
whatever killed it), and so does any child it forks; multiprocessing's resource tracker, which
the spawn starts, ends by itself once the rank and the worker are gone.
"""

from __future__ import annotations

import os
import signal
import threading
import traceback
from typing import Any, Optional

from rlbatch.config.distill import pure_distillation
from rlbatch.config.schema import RunConfig
from rlbatch.env.protocol import EnvCallError
from rlbatch.rollout.protocol import GenerationRequest, PolicySnapshot, RolloutUnavailableError

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


class GenerationWorkerError(RuntimeError):
    """The generation worker failed; carries its traceback."""


class GenerationWorker:
    """generate_fn (and aggregator state) backed by a spawned generation process."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        dp_rank: int,
        threads: int,
        ref_weights: Optional[list[dict[str, Any]]],
        nonce: Optional[str] = None,
        replicas: Any = None,
    ) -> None:
        """nonce: the run's sync-label nonce (rollout servers); replicas: the gloo process group
        over the trainer's DP ranks whose generation threads meet before each new version
        (rollout servers at dp > 1), None without."""
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve,
            args=(cfg, dp_rank, threads, ref_weights, nonce, child, _main_thread()),
            name=f"rlbatch-generation-{dp_rank}",
            daemon=True,
        )
        self._process.start()
        child.close()
        self._sent_version: Optional[int] = None
        self._replicas = replicas
        self._called_version: Optional[int] = None
        self._shared: Optional[list[dict[str, Any]]] = None
        self.aggregator_state: dict[str, Any] = {}
        self._pending_state: Optional[dict[str, Any]] = None

    def _call(self, *message: Any) -> Any:
        self._conn.send(message)
        kind, payload = self._conn.recv()
        if kind == "env_error":
            raise EnvCallError(payload)
        if kind == "unavailable":  # a rollout server failed: the loop's agreement handles it
            raise RolloutUnavailableError(payload)
        if kind == "error":
            raise GenerationWorkerError(f"generation worker failed:\n{payload}")
        return payload

    def __call__(self, request: GenerationRequest, snapshot: PolicySnapshot) -> Any:
        """The round's samples (a list, or a RoundOutput with the served request and figures)."""
        if self._replicas is not None and snapshot.version != self._called_version:
            self._meet_replicas()
        self._called_version = snapshot.version
        if self._pending_state is not None:
            self._call("load_state", self._pending_state)
            self._pending_state = None
        weights = None
        if snapshot.weights is not None and snapshot.version != self._sent_version:
            weights = self._hand_over(snapshot.weights)
        samples, state = self._call("generate", request, snapshot.version, weights)
        if weights is not None:
            self._sent_version = snapshot.version
        self.aggregator_state = state
        return samples

    def _meet_replicas(self) -> None:
        """Wait until every replica's generation thread is here: none of their workers still
        samples the previous version when DP rank 0's worker pushes the next one. Every replica
        calls with the same sequence of versions, so all arrive; one that died fails the others
        within trainer.timeout_s (the group's timeout)."""
        import torch.distributed as dist

        dist.barrier(group=self._replicas)

    def _hand_over(self, weights: list[dict[str, Any]]) -> Any:
        """The weights message: the first time, shared-memory copies of the tensors (the worker
        keeps them); afterwards the tensors are copied into those same buffers and only the
        word "shared" (and any non-tensor entries) crosses the pipe. Safe without a lock: only
        this thread writes the buffers, and only while the worker waits for a request."""
        import torch

        if self._shared is None:
            self._shared = [
                {k: v.clone().share_memory_() if torch.is_tensor(v) else v for k, v in sd.items()}
                for sd in weights
            ]
            return self._shared
        for buffers, sd in zip(self._shared, weights, strict=True):
            for k, v in sd.items():
                if torch.is_tensor(v):
                    buffers[k].copy_(v)
                else:
                    buffers[k] = v
        return (
            "shared",
            [{k: v for k, v in sd.items() if not torch.is_tensor(v)} for sd in weights],
        )

    # the Components.aggregator contract (checkpoints)
    def state_dict(self) -> dict[str, Any]:
        return self.aggregator_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.aggregator_state = state
        self._pending_state = state  # sent before the next round (from the generation thread)

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()


def _main_thread() -> bool:
    """Whether the caller is its process's main thread (the kernel's parent-death signal fires
    when the thread that started a child ends)."""
    return threading.current_thread() is threading.main_thread()


def _serve(
    cfg: RunConfig,
    dp_rank: int,
    threads: int,
    ref_weights: Optional[list[dict[str, Any]]],
    nonce: Optional[str],
    conn: Any,
    from_main_thread: bool,
) -> None:
    """The worker's main loop: build, then answer generate / load_state / stop messages."""
    from rlbatch.runtime.lifeline import die_with_parent

    die_with_parent(signal.SIGKILL, kernel=from_main_thread)
    try:
        generate, aggregator, load = _build(cfg, dp_rank, threads, ref_weights, nonce)
    except BaseException:  # noqa: BLE001 - reported to the trainer
        _answer_errors(conn, traceback.format_exc())
        return
    while True:
        message = conn.recv()
        try:
            if message[0] == "stop":
                return
            if message[0] == "load_state":
                aggregator.load_state_dict(message[1])
                conn.send(("ok", None))
            else:
                _, request, version, weights = message
                if weights is not None:
                    load(weights)
                samples = generate(request, PolicySnapshot(version))
                conn.send(("ok", (samples, aggregator.state_dict())))
        except EnvCallError as err:  # the user's environment: its message, no traceback
            conn.send(("env_error", str(err)))
        except RolloutUnavailableError as err:  # a rollout server failed, named in err
            conn.send(("unavailable", str(err)))
        except BaseException:  # noqa: BLE001 - reported to the trainer
            conn.send(("error", traceback.format_exc()))


def _answer_errors(conn: Any, text: str) -> None:
    """Answer every request with the build error until the trainer stops us."""
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "stop":
            return
        conn.send(("error", text))


def _weights_loader(model: list[Any]) -> Any:
    """load(message): load a weights message (GenerationWorker._hand_over) into the model: the
    shared buffers themselves the first time (kept), then ("shared", non-tensor entries) once
    the trainer has copied the new version into them."""
    import torch

    shared: list[dict[str, Any]] = []

    def load(weights: Any) -> None:
        if isinstance(weights, tuple):
            for buffers, extra in zip(shared, weights[1], strict=True):
                buffers.update(extra)
        else:
            shared[:] = weights
        with torch.no_grad():
            for chunk, w in zip(model, shared, strict=True):
                chunk.load_state_dict(w)

    return load


def _build(cfg: RunConfig, dp_rank: int, threads: int, ref_weights: Any, nonce: Optional[str]):
    """generate_fn, aggregator and load(weights) in this process (a world of one)."""
    import copy

    import torch

    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model
    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.grpo.data import load_prompts
    from rlbatch.grpo.stages import build_aggregator
    from rlbatch.rollout.streaming import local_generation

    for key in _TORCHRUN_ENV:  # a world of one, apart from the trainer's
        os.environ.pop(key, None)
    local = copy.deepcopy(cfg)
    local.parallel.dp = 1
    local.parallel.nproc_per_node = None
    local.parallel.nnodes = 1
    local.trainer.num_threads = threads
    parallel.initialize(local)
    torch.set_num_threads(threads)
    if nonce is not None:  # rollout servers: the trainer's labels, and DP rank 0's worker pushes
        from rlbatch.rollout.servers.backend import join_run

        join_run(cfg, nonce, pushes=dp_rank == 0)

    def frozen() -> list[Any]:
        chunks = build_model(local, wrap_ddp=False)
        for chunk in chunks:
            chunk.eval()
            for p in chunk.parameters():
                p.requires_grad_(False)
        return chunks

    model = frozen()
    ref = None
    if ref_weights is not None:
        ref = frozen()
        for chunk, weights in zip(ref, ref_weights, strict=True):
            chunk.load_state_dict(weights)

    load = _weights_loader(model)

    tokenizer = build_tokenizer(local.model)
    prompts = load_prompts(
        local.data, tokenizer, local.trainer.seed, need_answer=not pure_distillation(local)
    )
    aggregator = build_aggregator(local, tokenizer, ref, dp_rank, policy=model)
    # the trainer's sharding (its dp): this worker generates DP rank dp_rank's share
    generate, state = local_generation(cfg, model, tokenizer, prompts, aggregator, dp_rank)
    return generate, state, load
