"""``rollout.backend=vllm_server`` before launch: every server of rollout.servers.urls answers,
has vLLM's RL endpoints, holds the run's longest sequence, runs the weight-transfer backend the
run needs, serves the run's model (rlbatch.rollout.servers.model) and holds no weight update of
another live run (rlbatch.rollout.servers.claim); every error at once, each naming the URL."""

from __future__ import annotations

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import RunConfig, ServerTransfer
from rlbatch.rollout.servers.client import ServerError, call, health
from rlbatch.rollout.servers.sync import expected_backend, server_transfer


def check_servers(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """Every server of rollout.servers.urls answers GET /health and has vLLM's RL endpoints
    (GET /is_paused: a server started without VLLM_SERVER_DEV_MODE=1 lacks them); an error
    naming each one that does not, before any worker starts."""
    _check_transfer_host(cfg, errors)
    for url in cfg.rollout.servers.urls:
        url = str(url).rstrip("/")
        if not url.startswith(("http://", "https://")):  # not "unreachable": no URL at all
            errors.append(
                ConfigError(
                    "rollout.servers.urls",
                    url,
                    "is not an http:// or https:// URL: write it as http://HOST:PORT",
                )
            )
            continue
        why = health(url, timeout_s=10.0)
        if why is not None:
            why = why.replace(f"rollout server {url} ", "")
            errors.append(ConfigError("rollout.servers.urls", url, _unhealthy(why)))
            continue
        try:
            call(url, "/is_paused", timeout_s=10.0, get=True)
        except ServerError:
            errors.append(
                ConfigError(
                    "rollout.servers.urls",
                    url,
                    "answers but has no weight-update endpoints (GET /is_paused failed): start"
                    " it with rlbatch-serve, which enables them (VLLM_SERVER_DEV_MODE=1) and"
                    " rlbatch's weight-transfer backend",
                )
            )
            continue
        _check_server_length(cfg, url, errors)
        _check_server_transfer(cfg, url, errors)
        _check_server_model(cfg, url, errors)


def _unhealthy(why: str) -> str:
    """The fix for a server whose GET /health failed (server_http.health's words)."""
    if "GET /health answered" in why:
        return (
            f"answers, but not as a vLLM rollout server ({why}): is it the URL rlbatch-serve"
            " printed? Start the server with rlbatch-serve (the run's recipe and overrides,"
            " rollout.servers.port=PORT), or fix the URL"
        )
    return (
        f"is unreachable ({why}): start the server with rlbatch-serve (the run's recipe and"
        " overrides, rollout.servers.port=PORT), wait for it to print its URL, or fix the URL"
    )


def _check_server_model(cfg: RunConfig, url: str, errors: list[ConfigError]) -> None:
    """The server serves the run's model (rlbatch.rollout.servers.model) and holds no weight
    update of another live run (rlbatch.rollout.servers.claim)."""
    from rlbatch.rollout.servers.claim import describe_live_owner
    from rlbatch.rollout.servers.model import check_server_model

    try:
        models = call(url, "/v1/models", timeout_s=10.0, get=True)
        label = call(url, "/weight_info", timeout_s=10.0, get=True).get("weight_version")
    except (ServerError, AttributeError):
        return  # a server that does not say: the first sync names it
    check_server_model(cfg, url, models, errors)
    owner = describe_live_owner(label, cfg.rollout.servers.timeout_s)
    if owner:
        errors.append(
            ConfigError(
                "rollout.servers.urls",
                url,
                f"holds a weight update of another live run ({owner}): two runs cannot update"
                " one server; give each run servers of its own, or wait until that run ends",
            )
        )


def _check_server_length(cfg: RunConfig, url: str, errors: list[ConfigError]) -> None:
    """The server holds the run's longest sequence (prompt + rollout.max_new_tokens, and the
    evaluation's): vLLM's token endpoint silently stops a request at the server's own
    --max-model-len (finish_reason "length"), which the run would train as a truncated row."""
    from rlbatch.config.vllm_rules import longest_served
    from rlbatch.rollout.servers.probe import probe_length

    try:
        served = int(call(url, "/v1/models", timeout_s=10.0, get=True)["data"][0]["max_model_len"])
    except (ServerError, KeyError, IndexError, TypeError, ValueError):
        return  # a server that does not report its length: the backend's own check catches it
    needed = longest_served(cfg)
    if cfg.rollout.servers.probe_tokens > 0:  # the probe's sequence, after every sync
        needed = max(needed, probe_length(cfg.rollout.servers.probe_tokens))
    if served < needed:
        errors.append(
            ConfigError(
                "rollout.servers.urls",
                url,
                f"serves sequences of at most {served} tokens, but this run's longest is"
                f" {needed} (the longest prompt + rollout.max_new_tokens, the evaluation's, or"
                " the probe's: rollout.servers.probe_tokens + 9):"
                " restart it with rlbatch-serve and the run's recipe and overrides (or"
                f" rollout.vllm.max_model_len>={needed}), or shorten the run's sequences",
            )
        )


def _check_server_transfer(cfg: RunConfig, url: str, errors: list[ConfigError]) -> None:
    """The server runs the weight-transfer backend rollout.servers.transfer needs from this
    trainer (a server of another config would fail the first sync, after the workers started)."""
    import torch

    from rlbatch.rollout.servers.process import TRANSFER_BACKEND

    try:
        backend, _ = server_transfer(url, timeout_s=10.0)
    except (ServerError, KeyError, TypeError, ValueError):
        return  # a server that does not report it: the first sync names the server
    transfer = ServerTransfer(cfg.rollout.servers.transfer)
    broadcast = transfer == ServerTransfer.broadcast
    want = expected_backend(torch.cuda.is_available()) if broadcast else TRANSFER_BACKEND
    if backend != want:
        errors.append(
            ConfigError(
                "rollout.servers.urls",
                url,
                f"runs the {backend!r} weight-transfer backend, but rollout.servers.transfer="
                f"{transfer.value} from this trainer needs {want!r}: restart it with"
                " rlbatch-serve and the run's recipe and overrides (rlbatch-serve picks the"
                " backend from rollout.servers.transfer), or change rollout.servers.transfer",
            )
        )


def _check_transfer_host(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """rollout.servers.transfer_host names an address this machine has a name for (the
    servers' side of it shows only at the first sync, as a rendezvous that does not form)."""
    import socket

    host = cfg.rollout.servers.transfer_host
    if not host or ServerTransfer(cfg.rollout.servers.transfer) != ServerTransfer.broadcast:
        return
    try:
        socket.getaddrinfo(str(host), None)
    except (OSError, UnicodeError) as err:
        errors.append(
            ConfigError(
                "rollout.servers.transfer_host",
                host,
                f"does not resolve ({err}): give an address of this machine that every server"
                " can reach (a host name or IP), or null (127.0.0.1 for servers on this"
                " machine, else this machine's host name)",
            )
        )
