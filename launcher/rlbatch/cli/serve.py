"""rlbatch-serve: one vLLM rollout server for a run's config (docs/rollout.md, "Rollout servers").

    rlbatch-serve +recipe=grpo_qwen rollout.servers.port=8001
    rlbatch-train +recipe=grpo_qwen rollout.backend=vllm_server \
        rollout.servers.urls=[http://HOST:8001,http://HOST:8002]

The config is composed like rlbatch-train's (the same recipe and overrides): the server holds
that model (architecture, dtype, longest sequence, EOS ids; the checkpoint of model.hf_path, or
dummy weights until the trainer's first sync) with rollout.vllm's engine settings, and listens
on rollout.servers.host / rollout.servers.port. It prints its URL once GET /health answers and
runs until Ctrl-C / SIGTERM, which stop vLLM and every process it started. No torch at module
level.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlbatch.cli.common import help_text

USAGE = "One vLLM rollout server for a run's config. rlbatch-serve [+recipe=NAME] [KEY=VALUE ...]"


def server_config(args: list[str]) -> Any:
    """The RunConfig a server holds, composed from the run's recipe and overrides: a
    vllm_server run (its server list a stand-in: the server is its own) checked in
    SERVE_SCOPE, without the trainers' parallel layout."""
    from rlbatch.cli.common import compose
    from rlbatch.config.validate import SERVE_SCOPE

    overrides = [a for a in args if not a.startswith(("rollout.backend=", "rollout.servers.urls="))]
    return compose(
        [*overrides, "rollout.backend=vllm_server", "rollout.servers.urls=[http://rlbatch-serve]",
         "rollout.servers.count=0"],
        "rlbatch-serve",
        SERVE_SCOPE,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(help_text("rlbatch-serve", USAGE))
        return
    from rlbatch.rollout.servers.process import (
        ServerProcess,
        remove_dir,
        server_spec,
        write_server_model_dir,
    )

    cfg = server_config(args)
    s = cfg.rollout.servers
    from rlbatch.rollout.servers.sync import sweep_weight_files, transfer_folder

    sweep_weight_files(transfer_folder(cfg))  # what trainers killed mid-sync left here
    stop: list[int] = []

    def asked_to_stop(signum: int, frame: Any) -> None:
        # at once, also while vLLM starts (wait_healthy would wait for /health first)
        stop.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, asked_to_stop)
    root = Path(tempfile.mkdtemp(prefix="rlbatch-serve-"))
    try:
        real = write_server_model_dir(cfg, root / "model")
        spec = server_spec(cfg, root / "model", s.host, s.port, s.devices[0] if s.devices else None)
        print(
            f"rlbatch-serve: starting vLLM on {s.host}:{s.port} ("
            + ("the checkpoint of model.hf_path" if real else "dummy weights until a sync")
            + ")",
            file=sys.stderr,
            flush=True,
        )
        server = ServerProcess(spec)
        try:
            server.wait_healthy(s.start_timeout_s)
            print(spec.url, flush=True)
            while server.proc.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
            server.stop()
        if server.proc.returncode not in (0, None) and not stop:
            sys.exit(server.proc.returncode)
    except KeyboardInterrupt:
        pass  # asked to stop before vLLM started
    except RuntimeError as err:
        print(f"rlbatch-serve: {err}", file=sys.stderr)
        sys.exit(1)
    finally:
        remove_dir(root)


if __name__ == "__main__":
    main()
