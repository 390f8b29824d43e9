"""Shared CLI plumbing: compose with Hydra, validate into a RunConfig, report errors, help.

Imports no torch or megatron (the CLI must answer --help in well under 2 s).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn

from rlbatch.config.errors import ConfigError, ConfigErrors
from rlbatch.config.schema import RunConfig
from rlbatch.config.store import conf_dir, list_recipes

EXIT_CONFIG_ERROR = 2


def fail_config(err: ConfigErrors, command: str) -> NoReturn:
    """Print every configuration error (key, value, fix) and exit 2, without a traceback."""
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    console.print(f"[bold red]{command}: {len(err.errors)} configuration error(s)[/]")
    for e in err.errors:
        console.print(f"  [red]-[/] [bold]{e.key}[/]={_escape(e)}", soft_wrap=True)
    console.print("Nothing was run. Fix the keys above (see `--help` and docs/configuration.md).")
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    sys.exit(EXIT_CONFIG_ERROR)


def _escape(e: Any) -> str:
    from rich.markup import escape

    return escape(str(e).split("=", 1)[1])


ExtraCheck = Callable[[RunConfig], tuple[list[ConfigError], list[str]]]
"""A command's own checks before it runs: (errors, warnings) of a typed config."""


def to_validated_run_config(
    cfg: Any, command: str, scope: frozenset[str] | None = None, extra: ExtraCheck | None = None
) -> RunConfig:
    """Composed DictConfig -> validated RunConfig, or print all errors and exit 2.

    ``scope`` is the config sections the command uses (rlbatch.config.validate.*_SCOPE; default:
    training's). With ``model.hf_path`` set, the checkpoint's architecture replaces the preset's
    before the rules run, so e.g. layer divisibility is checked against the real model. Multi-node
    keys left null come from the job scheduler's environment (rlbatch.runtime.scheduler).
    ``extra`` (e.g. rlbatch-train's dataset and reward checks) adds its errors to the same
    report and prints its warnings.
    """
    from omegaconf import OmegaConf

    from rlbatch.config.load import check_structure
    from rlbatch.config.validate import TRAIN_SCOPE, check

    scope = TRAIN_SCOPE if scope is None else scope
    container = OmegaConf.to_container(cfg, resolve=True)
    run_cfg, errors = check_structure(container)  # type: ignore[arg-type]
    if "parallel" in scope:
        from rlbatch.runtime.scheduler import apply_scheduler_env

        errors += apply_scheduler_env(run_cfg.parallel, os.environ)
    if "model" in scope:
        errors += _adopt_hf_architecture(run_cfg, command)
    found: list[Any] = []
    if extra is not None:
        found, warnings = extra(run_cfg)
        _warn(command, warnings)
    try:
        return check(run_cfg, errors, scope, found)
    except ConfigErrors as err:
        fail_config(err, command)


def _warn(command: str, warnings: list[str]) -> None:
    if warnings:
        from rich.console import Console

        console = Console(stderr=True, highlight=False)
        for w in warnings:
            console.print(f"[yellow]{command}: warning:[/] {_escape_markup(w)}")


def _escape_markup(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _adopt_hf_architecture(cfg: RunConfig, command: str) -> list[ConfigError]:
    """Take the architecture of ``model.hf_path``'s config.json (torch-free; a hub id is first
    resolved to its local snapshot, which the workers then read); note what changed."""
    path = cfg.model.hf_path
    if not path:
        return []
    from rlbatch.engine.hf_config import resolve_model_config
    from rlbatch.engine.hub import resolve_hf_path

    try:
        local = resolve_hf_path(path)
    except ConfigErrors as err:
        return list(err.errors)
    if not local.is_dir():
        return []  # a missing directory is reported by the model.hf_path rule
    try:
        cfg.model, changed = resolve_model_config(replace(cfg.model, hf_path=str(local)))
    except ConfigErrors as err:
        return [ConfigError("model.hf_path", path, f"config.json {e}") for e in err.errors]
    except (OSError, ValueError, KeyError, TypeError) as err:
        detail = f"config.json lacks {err}" if isinstance(err, KeyError) else str(err)
        return [ConfigError("model.hf_path", path, f"not a usable HF model directory: {detail}")]
    if changed:
        from rich.console import Console

        Console(stderr=True, highlight=False).print(
            f"{command}: the architecture comes from {path}/config.json: " + "; ".join(changed),
            markup=False,
        )
    return []


def compose(
    overrides: list[str],
    command: str,
    scope: frozenset[str] | None = None,
    extra: ExtraCheck | None = None,
) -> RunConfig:
    """Compose conf/ + overrides with Hydra's compose API (no run dir, no logging setup);
    ``extra``: the command's own checks (:func:`to_validated_run_config`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from rlbatch.config.store import register_configs

    register_configs()
    unknown = check_override_keys(overrides)
    if unknown:
        fail_config(ConfigErrors(unknown), command)
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"{command}: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    return to_validated_run_config(cfg, command, scope, extra)


def check_override_keys(args: list[str]) -> list[ConfigError]:
    """An error for each ``KEY=VALUE`` override whose key the config does not have, with the
    closest existing key ("did you mean grpo.policy_loss?"), as the validator words it.

    Hydra would refuse such a key alone, telling the user to add it with ``+``, which for a
    misspelled key is the wrong fix. Checked against the schema: flags (``-m``), additions and
    deletions (``+KEY``, ``~KEY``), config groups (``model=tiny``, ``batching@...``,
    ``hydra/launcher=...``), ``hydra.*`` keys and the keys under a free-form mapping
    (``env.kwargs.*``) are left to Hydra."""
    import dataclasses
    import difflib
    import typing

    from rlbatch.config.load import _FIELD_TO_KEY, _KEY_TO_FIELD, _unwrap_optional

    groups = set(config_groups())
    errors: list[ConfigError] = []
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or arg.startswith(("-", "+", "~")) or any(c in key for c in "@/"):
            continue
        if key in groups or key.split(".", 1)[0] == "hydra":
            continue
        cls: Any = RunConfig
        prefix = ""
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not dataclasses.is_dataclass(cls):
                break  # under a mapping or a scalar: Hydra's own checks
            fields = {f.name: f for f in dataclasses.fields(cls)}
            name = _KEY_TO_FIELD.get(part, part)
            if name not in fields:
                keys = [_FIELD_TO_KEY.get(n, n) for n in fields]
                close = difflib.get_close_matches(part, keys, n=1)
                rest = "".join(f".{p}" for p in parts[i + 1 :])
                fix = (
                    f"did you mean {prefix}{close[0]}{rest}?"
                    if close
                    else f"valid keys here: {', '.join(keys)}"
                )
                errors.append(ConfigError(key, value, f"unknown key; {fix}"))
                break
            cls = _unwrap_optional(typing.get_type_hints(cls)[name])[0]
            prefix += f"{part}."
    return errors


def config_groups() -> dict[str, list[str]]:
    """Each config group under conf/ with its options (batching@... slots share 'batching');
    not model_base, the keys every model preset has (composed under the chosen preset)."""
    groups: dict[str, list[str]] = {}
    for path in sorted(conf_dir().iterdir()):
        if path.is_dir() and path.name not in ("hydra", "__pycache__", "model_base"):
            groups[path.name] = sorted(p.stem for p in path.glob("*.yaml"))
    return groups


def help_text(command: str, usage: str, extra: str = "") -> str:
    lines = [f"{command}: {usage}", "", "Recipes (select with +recipe=NAME):"]
    for recipe in list_recipes():
        lines.append(f"  {recipe.name:<22} {recipe.summary}")
    lines += [
        "",
        "Config groups (select with GROUP=OPTION; the batching options fill both slots,",
        "batching@batching.train=OPTION and batching@batching.infer=OPTION):",
    ]
    for group, options in config_groups().items():
        lines.append(f"  {group:<14} {', '.join(options)}")
    lines += [
        "",
        "Any field can be overridden with KEY=VALUE (e.g. trainer.max_steps=200 parallel.pp=2).",
        "Every field is documented in docs/configuration.md; --cfg job prints the composed config.",
    ]
    if extra:
        lines += ["", extra]
    return "\n".join(lines)
