"""A served teacher (grpo.distill.teacher_url): a vLLM server of the teacher scores the student's
sampled tokens with its prompt log-probs (docs/grpo_loss.md, "A served teacher").

Each sample is one request to ``POST /inference/v1/generate`` with the sample's whole sequence
(prompt + response, observation tokens of a multi-turn episode included) as ``token_ids`` and
``prompt_logprobs: 0``: the answer carries, for every position after the first, the server's
log-prob of the token that is there. The response positions' values are the teacher's
log-probs of the response tokens; rlbatch.grpo.distill.apply_teacher keeps those of sampled
tokens only (loss mask). vLLM computes prompt log-probs from the raw logits, i.e. at
temperature 1, which is why rlbatch.config.distill refuses any other rollout.temperature.

Requests go out concurrently (grpo.distill.teacher_max_concurrency; the server batches them),
each bounded by grpo.distill.teacher_timeout_s; a failure stops the step with the server's URL
and what failed. Only the first rank of a model-parallel group asks the server, and every rank
of the group gets its answer, so tp / pp ranks train on the same advantages.

Before launch (:func:`served_teacher_errors`): the server answers, serves the token endpoint
with prompt log-probs, holds the run's longest sequence, and its model directory (``GET
/v1/models``'s ``root``, read on this machine) has the student's tokenizer and a context as
long as the run's sequences, as an in-process teacher's would (rlbatch.grpo.teacher).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlbatch.config.errors import ConfigError, ConfigErrors
from rlbatch.config.lengths import longest_sequence, longest_sequence_text
from rlbatch.config.lora import LoraConfig
from rlbatch.config.schema import ModelConfig, RunConfig
from rlbatch.grpo.types import Sample
from rlbatch.rollout.servers.client import ServerDownError, ServerError, call, health

KEY = "grpo.distill.teacher_url"
ENDPOINT = "/inference/v1/generate"
MAX_RESUBMITS = 3
"""A request the server aborted (another client paused it) is sent again this many times."""
START = (
    "start one with rlbatch-serve and the run's recipe and overrides plus"
    " model.hf_path=TEACHER_DIR rollout.servers.port=PORT (it prints its URL), or with vLLM's"
    " own server: python -m vllm.entrypoints.openai.api_server --model TEACHER_DIR"
    " --enable-scale-out"
)
"""How users start a teacher server, for the errors."""


class TeacherServerError(ServerError):
    """The served teacher failed a scoring request (refused, timed out, answered wrongly)."""


def _params() -> dict[str, Any]:
    """One sampled token (the endpoint must sample one) and the prompt's log-probs: only the
    token at each position (0 alternatives)."""
    return {"max_tokens": 1, "temperature": 1.0, "seed": 0, "logprobs": 0, "prompt_logprobs": 0}


def _sequence(sample: Sample) -> list[int]:
    return [int(t) for t in (*sample.prompt.prompt_ids, *sample.response_ids)]


def score_sequence(
    url: str, tokens: list[int], first: int, *, timeout_s: float, what: str
) -> list[float]:
    """The server's log-probs of ``tokens[first:]`` (each given the tokens before it).
    TeacherServerError naming ``url`` and ``what`` was scored when it fails."""
    body = {"token_ids": tokens, "sampling_params": _params(), "return_token_ids": True}
    for _ in range(MAX_RESUBMITS + 1):
        try:
            answer = call(url, ENDPOINT, body, timeout_s=timeout_s)
        except ServerError as err:
            # server_http words its errors for rollout servers: name the teacher's keys
            why = str(err).replace("rollout.servers.timeout_s", "grpo.distill.teacher_timeout_s")
            why = why.replace("rollout server ", "teacher server ")
            raise TeacherServerError(
                f"the served teacher ({KEY}={url}) failed to score {what}: {why}"
            ) from err
        choice = (answer.get("choices") or [{}])[0] if isinstance(answer, dict) else {}
        if choice.get("finish_reason") != "abort":
            return _read(url, answer, tokens, first, what)
    raise TeacherServerError(
        f"the served teacher ({KEY}={url}) aborted the scoring of {what}"
        f" {MAX_RESUBMITS + 1} times: another client keeps pausing it; give the run a teacher"
        " server of its own"
    )


def _read(url: str, answer: Any, tokens: list[int], first: int, what: str) -> list[float]:
    try:
        scored = answer["prompt_logprobs"]
        if len(scored) != len(tokens):
            raise ValueError(f"{len(scored)} prompt log-probs for {len(tokens)} tokens")
        return [float(scored[i][str(tokens[i])]["logprob"]) for i in range(first, len(tokens))]
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise TeacherServerError(
            f"the served teacher ({KEY}={url}) answered the scoring of {what} without the"
            f" prompt log-probs asked for ({type(err).__name__}: {err})"
        ) from err


def score_samples(
    url: str, samples: list[Sample], *, timeout_s: float, max_concurrency: int
) -> list[list[float]]:
    """Each sample's teacher log-probs of its response tokens, ``max_concurrency`` requests at
    a time; answers in the samples' order."""

    def one(i: int) -> list[float]:
        s = samples[i]
        what = f"sample {i} (prompt index {s.prompt.index}, {len(_sequence(s))} tokens)"
        return score_sequence(
            url, _sequence(s), len(s.prompt.prompt_ids), timeout_s=timeout_s, what=what
        )

    if not samples:
        return []
    with ThreadPoolExecutor(max_workers=min(max_concurrency, len(samples))) as pool:
        return list(pool.map(one, range(len(samples))))


def served_teacher_logps_fn(cfg: RunConfig) -> Callable[[list[Sample]], list[list[float]]]:
    """The teacher pass of a served teacher: the first rank of each model-parallel group asks
    the server, every rank of the group gets the same log-probs."""
    from rlbatch.distributed import from_first_in_model_parallel_group, model_parallel_group

    d = cfg.grpo.distill
    assert d.teacher_url is not None
    url = str(d.teacher_url).rstrip("/")

    def teacher_logps(samples: list[Sample]) -> list[list[float]]:
        def ask() -> list[list[float]]:
            return score_samples(
                url,
                samples,
                timeout_s=d.teacher_timeout_s,
                max_concurrency=d.teacher_max_concurrency,
            )

        first = model_parallel_group()[0] == 0
        return from_first_in_model_parallel_group(ask if first else None)

    return teacher_logps


# ------------------------------------------------------------------------------------------
# Before launch
# ------------------------------------------------------------------------------------------


def served_teacher_errors(cfg: RunConfig) -> list[ConfigError]:
    """Every problem of the served teacher before launch, each naming grpo.distill.teacher_url
    and its URL."""
    url = str(cfg.grpo.distill.teacher_url or "").rstrip("/")
    if not url.startswith(("http://", "https://")):
        return []  # rlbatch.config.distill reports a missing or malformed URL
    why = health(url, timeout_s=10.0)
    if why is not None:
        return [ConfigError(KEY, url, f"is unreachable ({why}): {START}")]
    try:
        models = call(url, "/v1/models", timeout_s=10.0, get=True)
        root, served_len = models["data"][0]["root"], int(models["data"][0]["max_model_len"])
    except (ServerError, KeyError, IndexError, TypeError, ValueError) as err:
        return [ConfigError(KEY, url, f"does not say what it serves (GET /v1/models: {err})")]
    errors = _length_errors(cfg, url, served_len)
    errors += _label_errors(url)
    errors += _model_errors(cfg, url, str(root))
    if not errors:
        errors += _endpoint_errors(cfg, url)
    return errors


def _length_errors(cfg: RunConfig, url: str, served_len: int) -> list[ConfigError]:
    needed = longest_sequence(cfg) + 1  # the endpoint samples one token after the sequence
    if served_len >= needed:
        return []
    return [
        ConfigError(
            KEY,
            url,
            f"serves sequences of at most {served_len} tokens, but scoring this run's longest"
            f" ({longest_sequence_text(cfg)} = {needed - 1}) needs {needed}: restart it with"
            f" a longer context (rlbatch-serve rollout.vllm.max_model_len>={needed}, vLLM's"
            " --max-model-len), or shorten the run's sequences",
        )
    ]


PROBE = [(7 + 37 * i) % 256 for i in range(32)]
"""A fixed token sequence every teacher's vocabulary holds (ids below 256): the test request
before launch, and a served teacher's identity (rlbatch.grpo.teacher_identity)."""
UNIFORM_SPREAD = 1e-2
"""Nats: probe log-probs all within this of each other come from near-uniform weights (vLLM's
dummy initialization); any trained model spreads them by whole nats."""
STARTUP_LABEL = "default"
"""vLLM's weight label until a weight update sets one (rlbatch.rollout.servers.answers)."""


def _label_errors(url: str) -> list[ConfigError]:
    """The server's weights are the ones it started with: a weight label other than vLLM's
    start-up one means a trainer's weight sync replaced them (it is, or was, a rollout server,
    of this run or another, under any spelling of its URL)."""
    try:
        label = call(url, "/weight_info", timeout_s=10.0, get=True).get("weight_version")
    except (ServerError, AttributeError):
        return []  # a server without the endpoint has no weight updates either
    if label is None or str(label) == STARTUP_LABEL:
        return []
    return [
        ConfigError(
            KEY,
            url,
            f"holds weights a trainer's weight sync put there (weight label {str(label)!r}), not"
            " the checkpoint it started with: it is a rollout server (of this run or another),"
            " whose weights are the student's and change with every sync; serve the teacher"
            f" on a server of its own: {START}",
        )
    ]


def _weights_errors(cfg: RunConfig, url: str, root: str) -> list[ConfigError]:
    """The served directory holds a checkpoint (rlbatch-serve serves dummy, random weights
    when model.hf_path has no local *.safetensors) that is not the student's own."""
    files = [f for f in Path(root).iterdir() if f.suffix in (".safetensors", ".bin", ".pt")]
    if not files:
        return [
            ConfigError(
                KEY,
                url,
                f"serves {root}, which holds no weights (*.safetensors): the server runs dummy"
                " (random) weights, as rlbatch-serve does when model.hf_path is not a local"
                ' directory with *.safetensors (it prints "dummy weights until a sync");'
                f" restart it with model.hf_path=TEACHER_DIR: {START}",
            )
        ]
    student = cfg.model.hf_path
    if student and Path(student).is_dir():
        mine = {f.resolve() for f in Path(student).glob("*.safetensors")}
        if mine and mine == {f.resolve() for f in files if f.suffix == ".safetensors"}:
            return [
                ConfigError(
                    KEY,
                    url,
                    f"serves the student's own checkpoint (model.hf_path={student}): the"
                    " teacher would score every sampled token at the behaviour policy's own"
                    " log-prob and nothing would be learnt; serve the stronger model",
                )
            ]
    return []


def served_model_config(cfg: RunConfig, root: str) -> ModelConfig:
    """The teacher's ModelConfig from the served directory's config.json (as the in-process
    teacher's: rlbatch.grpo.teacher.teacher_model_config)."""
    from rlbatch.engine.hf_config import resolve_model_config

    model, _ = resolve_model_config(replace(cfg.model, hf_path=root, lora=LoraConfig()))
    return model


def _model_errors(cfg: RunConfig, url: str, root: str) -> list[ConfigError]:
    """The served directory's tokenizer is the student's and its context holds the run."""
    from rlbatch.grpo.teacher import tokenizer_mismatch

    if (Path(root) / "config.json").is_file():
        weights = _weights_errors(cfg, url, root)
        if weights:
            return weights
    if cfg.grpo.distill.teacher_tokenizer or not (Path(root) / "config.json").is_file():
        found = _local_copy(cfg, root)
        if found is None and cfg.grpo.distill.teacher_tokenizer:
            return [
                ConfigError(
                    "grpo.distill.teacher_tokenizer",
                    cfg.grpo.distill.teacher_tokenizer,
                    "is neither a directory with config.json (the teacher's config and"
                    " tokenizer files) nor a Hub id in the local Hugging Face cache",
                )
            ]
        if found is None:
            return [
                ConfigError(
                    KEY,
                    url,
                    f"serves {root!r}, which is not a model directory this machine can read"
                    " (nor a Hub id in the local Hugging Face cache): the teacher's tokenizer"
                    " cannot be compared with the student's. Give a local copy of the teacher's"
                    " config.json and tokenizer files as grpo.distill.teacher_tokenizer=DIR"
                    " (a teacher served from another machine), or serve a directory this"
                    " machine can read (a shared filesystem)",
                )
            ]
        root = found
    try:
        model = served_model_config(cfg, root)
    except ConfigErrors as err:
        return [ConfigError(KEY, url, f"its model {root}: {e}") for e in err.errors]
    except (OSError, KeyError, ValueError) as err:
        return [ConfigError(KEY, url, f"cannot read its model's config.json in {root}: {err!r}")]
    errors = []
    longest = longest_sequence(cfg)
    if model.max_position_embeddings < longest:
        errors.append(
            ConfigError(
                KEY,
                url,
                f"its model's context (max_position_embeddings = {model.max_position_embeddings}"
                f" in {root}) is shorter than the run's longest sequence"
                f" ({longest_sequence_text(cfg)} = {longest}): it would score tokens past what it"
                " was trained on; shorten the run's sequences or serve a longer-context teacher",
            )
        )
    problem = tokenizer_mismatch(cfg.model, model)
    if problem:
        errors.append(ConfigError(KEY, url, f"its model {root}: {problem}"))
    return errors


def _local_copy(cfg: RunConfig, root: str) -> str | None:
    """Where the checks read the teacher's config and tokenizer when the served directory is
    not on this machine: grpo.distill.teacher_tokenizer (a directory, or a Hub id in the
    local cache), else the served root as a Hub id in the local cache; None: neither."""
    from rlbatch.config.hub_id import looks_like_hub_id

    given = cfg.grpo.distill.teacher_tokenizer
    for candidate in (given,) if given else (root,):
        if (Path(candidate) / "config.json").is_file():
            return str(candidate)
        if looks_like_hub_id(str(candidate)):
            try:
                from huggingface_hub import snapshot_download

                return str(snapshot_download(str(candidate), local_files_only=True))
            except Exception:  # noqa: BLE001 - not in the local cache (or no huggingface_hub)
                continue
    return None


def _endpoint_errors(cfg: RunConfig, url: str) -> list[ConfigError]:
    """One scoring request of two tokens: the token endpoint is on and answers prompt
    log-probs."""
    try:
        logps = score_sequence(
            url, PROBE, 1, timeout_s=cfg.grpo.distill.teacher_timeout_s, what="a test"
        )
    except TeacherServerError as err:
        cause = err.__cause__
        if isinstance(cause, ServerError) and not isinstance(cause, ServerDownError):
            return [
                ConfigError(
                    KEY,
                    url,
                    f"does not score tokens ({ENDPOINT} failed: {cause}): start it with"
                    " rlbatch-serve, or give vLLM's server --enable-scale-out (or --tokens-only)",
                )
            ]
        return [ConfigError(KEY, url, str(err))]
    if max(logps) - min(logps) < UNIFORM_SPREAD:
        return [
            ConfigError(
                KEY,
                url,
                f"gives every token of a fixed probe the same log-prob ({logps[0]:.4f}): it"
                " serves near-uniform, untrained weights (vLLM's dummy weights: rlbatch-serve"
                " without a local model.hf_path with *.safetensors, or --load-format dummy),"
                f" which would teach noise; {START}",
            )
        ]
    return []
