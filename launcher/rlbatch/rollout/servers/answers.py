"""What one rollout server's answer to one row may be (rollout.backend=vllm_server).

A request carries the row's own seed, its token limit and the trainer's EOS ids as vLLM's
``stop_token_ids`` with ``ignore_eos``: the server's own end-of-sequence id (its
generation_config, or none at all without a tokenizer) then plays no part, and every stop is
one of the trainer's ids, which vLLM reports as the answer's ``stop_reason``. An answer is a
row only when vLLM finished it:

- ``finish_reason`` ``stop`` with ``stop_reason`` one of the trainer's EOS ids and the last
  token that id: a finished response;
- ``length`` with exactly the row's limit of tokens: a truncated response (fewer: the server's
  own --max-model-len cut it, a wrong sample);
- ``abort``: vLLM ended the request early (another client's ``POST /pause``, whose default
  mode aborts what is in flight; ``/abort_requests``; a server shutting down) and returned the
  tokens so far with HTTP 200. The row is not a sample: it is sent again, with its own seed,
  up to ``rollout.servers.max_resubmits`` times, so the row sampled is the one an undisturbed
  server samples (the seed fixes it for the same weights);
- anything else (``error``, ``repetition``, a stop this run did not ask for): the run stops
  naming the server and the reason.

Every token must also carry the label of the weights this run pushed last (vLLM labels each
span of tokens with the version of the weights that produced it): other labels mean another
process updated the server; vLLM's start-up label ("default") or no label at all (a server that
does not label its tokens) once the run has pushed means the server holds weights the run did
not push: restarted at the same URL, it serves its start-up weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from rlbatch.rollout.protocol import DecodedRow
from rlbatch.rollout.servers.client import ServerError, ServerRestartedError, call

STARTUP_LABEL = "default"
"""vLLM's label of the weights a server started with (none pushed since)."""


class RowAborted(Exception):
    """The server aborted the row before it finished (finish_reason ``abort``)."""


def request_body(
    ids: Sequence[int], seed: int, limit: int, sampling: Any, eos_ids: Sequence[int]
) -> dict[str, Any]:
    """The ``POST /inference/v1/generate`` body of one row: ``eos_ids`` are its only stops."""
    params = {
        "max_tokens": limit, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "top_k": sampling.top_k, "seed": seed, "logprobs": 0,
        "stop_token_ids": list(eos_ids), "ignore_eos": True,
    }  # fmt: skip
    return {"token_ids": list(ids), "sampling_params": params, "return_token_ids": True}


def read_row(
    url: str,
    choice: dict[str, Any],
    *,
    eos_ids: Sequence[int],
    limit: int,
    prompt_len: int,
    label: Optional[str],
) -> DecodedRow:
    """The row of a server's answer (the module's docstring); RowAborted when vLLM aborted it,
    ServerError naming the server for any other answer that is not a finished row.
    ``label``: the weights this run pushed last (None: it has pushed none)."""
    tokens = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    logps = [float(step["logprob"]) for step in content]
    if len(logps) != len(tokens):
        raise ServerError(
            f"rollout server {url} returned {len(tokens)} tokens but {len(logps)} log-probs"
        )
    reason, stop = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "abort":
        raise RowAborted(f"rollout server {url} aborted a row after {len(tokens)} tokens")
    check_labels(url, choice.get("weight_versions"), len(tokens), label)
    if reason == "stop" and stop in eos_ids and tokens and tokens[-1] == stop:
        return DecodedRow(tokens, logps, truncated=False)
    if reason == "length" and len(tokens) == limit:
        return DecodedRow(tokens, logps, truncated=True)
    if reason == "length" and len(tokens) < limit:  # vLLM stops a request at --max-model-len
        raise ServerError(
            f"rollout server {url} stopped a response after {len(tokens)} of {limit} tokens"
            f" (prompt of {prompt_len}): its --max-model-len is shorter than this run's"
            " sequences; restart it with rlbatch-serve and the run's recipe and overrides"
        )
    last = tokens[-1] if tokens else None
    raise ServerError(
        f"rollout server {url} ended a response with finish_reason={reason!r},"
        f" stop_reason={stop!r} after {len(tokens)} of {limit} tokens (last token {last}):"
        f" not a finished row (a stop at one of the run's EOS ids {list(eos_ids)}, or the"
        " row's token limit); is the server started by rlbatch-serve with the run's recipe,"
        " and does no other client change its sampling (repetition detection, stops)?"
    )


def check_labels(
    url: str, spans: Optional[list[dict[str, Any]]], num_tokens: int, label: Optional[str]
) -> None:
    """Every one of ``num_tokens`` tokens lies in a span labelled ``label`` (the weights this
    run pushed last); nothing to check before the run's first push (``label`` None)."""
    if label is None or num_tokens == 0:
        return
    spans = spans or []
    for span in spans:
        if str(span.get("version")) == STARTUP_LABEL:
            raise ServerRestartedError(
                f"rollout server {url} sampled with its start-up weights (labelled"
                f" {STARTUP_LABEL!r}), not the ones this run pushed ({label!r}): it was"
                " restarted at the same URL since the run's last push; restart the run"
                " (trainer.resume=auto) to push its weights again"
            )
        if str(span.get("version")) != label:
            raise ServerError(
                f"rollout server {url} sampled with weights labelled"
                f" {span.get('version')!r}, not the ones this run pushed ({label!r}):"
                " another process updated its weights; give each run (and rlbatch-eval)"
                " servers of its own"
            )
    covered = sum(int(s.get("end", 0)) - int(s.get("start", 0)) for s in spans)
    if covered != num_tokens:
        raise ServerError(
            f"rollout server {url} sampled {num_tokens - covered} of {num_tokens} tokens with"
            f" unlabelled weights, not the ones this run pushed ({label!r}): it holds weights"
            " nobody labelled since the run's last push (restarted at the same URL, it serves"
            " its start-up weights); restart the run (trainer.resume=auto) to push its"
            " weights again"
        )


def probe_server(
    url: str,
    sequence: list[int],
    prompt_len: int,
    *,
    timeout_s: float,
    label: str,
    max_resubmits: int,
    on_resubmit: Callable[[], None],
) -> tuple[list[float], int, float]:
    """The probe's answer of ``url`` (rlbatch.rollout.servers.probe): its log-probabilities
    (temperature 1) of ``sequence``'s tokens after the first ``prompt_len``, and the token it
    samples after them with its log-probability. An answer the server aborted (another
    client's pause) is asked again like a row, up to ``max_resubmits`` times (each counted by
    ``on_resubmit``): it carries no log-probabilities and says nothing of the weights."""
    params = {
        "max_tokens": 1, "temperature": 1.0, "seed": 0, "logprobs": 0, "prompt_logprobs": 0,
    }  # fmt: skip
    body = {"token_ids": sequence, "sampling_params": params, "return_token_ids": True}
    for attempt in range(max_resubmits + 1):
        answer = call(url, "/inference/v1/generate", body, timeout_s=timeout_s)
        choice = (answer.get("choices") or [{}])[0] if isinstance(answer, dict) else {}
        if choice.get("finish_reason") != "abort":
            return _probe_answer(url, answer, choice, sequence, prompt_len, label)
        if attempt < max_resubmits:
            on_resubmit()
    raise ServerError(
        f"rollout server {url} aborted the probe {max_resubmits + 1} times"
        f" (rollout.servers.max_resubmits={max_resubmits}): another client keeps pausing it"
        " (POST /pause aborts the requests in flight unless mode=wait or keep) or aborting its"
        " requests; give the run servers of its own, or raise rollout.servers.max_resubmits"
    )


def _probe_answer(
    url: str,
    answer: Any,
    choice: dict[str, Any],
    sequence: list[int],
    prompt_len: int,
    label: str,
) -> tuple[list[float], int, float]:
    tokens = choice.get("token_ids") or []
    check_labels(url, choice.get("weight_versions"), len(tokens), label)
    try:
        scored = answer["prompt_logprobs"]
        fixed = [
            float(scored[i][str(sequence[i])]["logprob"]) for i in range(prompt_len, len(sequence))
        ]
        token = int(choice["token_ids"][0])
        sampled = float(choice["logprobs"]["content"][0]["logprob"])
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise ServerError(
            f"rollout server {url} answered the probe without the log-probabilities it"
            f" asked for ({type(err).__name__}: {err})"
        ) from err
    return fixed, token, sampled
