"""Turn a composed (plain) config into a typed RunConfig, collecting every structural error.

Composition deliberately does not use the schema as Hydra's base: OmegaConf's structured merge
stops at the first bad key or value. Here the composed tree is walked against the dataclasses
once and every unknown key, wrong type and bad enum value is reported together. Workers load
``resolved.yaml`` through the same path (``load_run_config``), never through Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import typing
from pathlib import Path
from typing import Any, Union

from rlbatch.config.errors import ConfigError, ConfigErrors
from rlbatch.config.schema import PLAN_PASS_KEY, RunConfig

_MISSING = object()
# Field names that differ from their config keys (Python keywords).
_KEY_TO_FIELD = {PLAN_PASS_KEY: "pass_"}
_FIELD_TO_KEY = {v: k for k, v in _KEY_TO_FIELD.items()}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _check_scalar(key: str, value: Any, tp: Any, errors: list[ConfigError]) -> Any:
    """Convert ``value`` to ``tp`` the way a user means it; record an error otherwise."""
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if value in (member.name, member.value) or value is member:
                return member.name
        choices = ", ".join(m.name for m in tp)
        errors.append(ConfigError(key, value, f"is not one of: {choices}"))
        return _MISSING
    if tp is bool:
        if isinstance(value, bool):
            return value
        errors.append(ConfigError(key, value, "must be true or false"))
        return _MISSING
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        errors.append(ConfigError(key, value, "must be an integer"))
        return _MISSING
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        errors.append(ConfigError(key, value, "must be a number"))
        return _MISSING
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        errors.append(ConfigError(key, value, "must be a string"))
        return _MISSING
    raise TypeError(f"schema field {key} has unsupported type {tp!r}")


def _check_list(key: str, value: Any, item_tp: Any, errors: list[ConfigError]) -> Any:
    """A list field; a single value means a one-element list (``data.reward_fn=f.py:fn``)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    before = len(errors)
    out = [_check_scalar(f"{key}[{i}]", v, item_tp, errors) for i, v in enumerate(items)]
    return _MISSING if len(errors) > before else out


def _check_mapping(key: str, value: Any, errors: list[ConfigError]) -> Any:
    """A free-form mapping field (``env.kwargs``): any keys, any YAML values."""
    if isinstance(value, dict):
        return dict(value)
    errors.append(ConfigError(key, value, "must be a mapping ({key: value, ...})"))
    return _MISSING


def _check_node(prefix: str, data: Any, cls: type, errors: list[ConfigError]) -> dict[str, Any]:
    """Walk ``data`` against dataclass ``cls``; return a clean dict of field name -> value."""
    if not isinstance(data, dict):
        errors.append(ConfigError(prefix or "<root>", data, f"must be a mapping ({cls.__name__})"))
        return {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    keys = [_FIELD_TO_KEY.get(name, name) for name in fields]
    clean: dict[str, Any] = {}
    for key, value in data.items():
        name = _KEY_TO_FIELD.get(key, key)
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if name not in fields:
            close = difflib.get_close_matches(str(key), keys, n=1)
            hint = f"did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""
            valid = f"valid keys here: {', '.join(keys)}"
            errors.append(ConfigError(dotted, value, f"unknown key; {hint or valid}"))
            continue
        tp, optional = _unwrap_optional(hints[name])
        if value is None:
            if optional:
                clean[name] = None
            else:
                errors.append(ConfigError(dotted, None, f"may not be null ({_type_name(tp)})"))
            continue
        if dataclasses.is_dataclass(tp):
            clean[name] = _check_node(dotted, value, tp, errors)  # type: ignore[arg-type]
            continue
        if typing.get_origin(tp) is dict:
            converted = _check_mapping(dotted, value, errors)
        elif typing.get_origin(tp) is list:
            converted = _check_list(dotted, value, typing.get_args(tp)[0], errors)
        else:
            converted = _check_scalar(dotted, value, tp, errors)
        if converted is not _MISSING:
            clean[name] = converted
    return clean


def _build(cls: type, clean: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in clean.items():
        tp, _ = _unwrap_optional(hints[name])
        if value is not None and dataclasses.is_dataclass(tp):
            value = _build(tp, value)  # type: ignore[arg-type]
        elif value is not None and isinstance(tp, type) and issubclass(tp, enum.Enum):
            value = tp[value]
        kwargs[name] = value
    return cls(**kwargs)


def check_structure(data: dict[str, Any]) -> tuple[RunConfig, list[ConfigError]]:
    """Typed RunConfig from a plain dict, plus every structural error (unknown key, wrong type,
    bad enum). Bad or absent fields take the schema defaults, so the cross-field rules can still
    run and every error is reported at once. ``hydra`` (Hydra's own node) is ignored."""
    data = {k: v for k, v in data.items() if k != "hydra"}
    errors: list[ConfigError] = []
    clean = _check_node("", data, RunConfig, errors)
    return _build(RunConfig, clean), errors


def to_run_config(data: dict[str, Any]) -> RunConfig:
    """Typed RunConfig from a plain dict; raises ConfigErrors listing every structural error."""
    cfg, errors = check_structure(data)
    if errors:
        raise ConfigErrors(errors)
    return cfg


def to_container(cfg: RunConfig) -> dict[str, Any]:
    """Plain dict with user-facing keys and enum names (the resolved.yaml content)."""

    def convert(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return {
                _FIELD_TO_KEY.get(f.name, f.name): convert(getattr(obj, f.name))
                for f in dataclasses.fields(obj)
            }
        if isinstance(obj, enum.Enum):
            return obj.name
        return obj

    return convert(cfg)


def make_paths_absolute(cfg: RunConfig) -> None:
    """Rewrite the relative file paths of ``cfg`` (relative to the launch directory) as absolute
    ones, so resolved.yaml works from any directory: the workers', ``rlbatch-eval RUN_DIR`` and
    ``rlbatch-export RUN_DIR`` run from anywhere. data.path and eval.data.path always; the
    model, tokenizer and teacher paths when they name a local directory (else they are hub ids).
    Reward and environment paths are made absolute by the pre-launch checks that import them."""
    cfg.data.path = _absolute(cfg.data.path)
    cfg.eval.data.path = _absolute(cfg.eval.data.path)
    for name in ("hf_path", "tokenizer_path"):
        value = getattr(cfg.model, name)
        if value and Path(value).expanduser().exists():
            setattr(cfg.model, name, _absolute(value))
    if cfg.grpo.distill.teacher and Path(cfg.grpo.distill.teacher).expanduser().exists():
        cfg.grpo.distill.teacher = _absolute(cfg.grpo.distill.teacher)


def _absolute(path: str | None) -> str | None:
    return None if not path else str(Path(path).expanduser().resolve())


def same_path(old: Any, new: Any) -> bool:
    """Two values of a path key name the same file (a relative one read from the launch
    directory): resolved.yaml of an earlier rlbatch kept data.path as given."""
    if not isinstance(old, str) or not isinstance(new, str):
        return False
    return _absolute(old) == _absolute(new)


PATH_KEYS = (
    "data.path", "eval.data.path", "model.hf_path", "model.tokenizer_path", "grpo.distill.teacher",
)  # fmt: skip
"""The keys :func:`make_paths_absolute` rewrites."""


def dump_run_config(cfg: RunConfig, path: Path) -> None:
    import yaml

    path.write_text(yaml.safe_dump(to_container(cfg), sort_keys=False))


def load_run_config(path: str | Path) -> RunConfig:
    """What workers call: resolved.yaml -> RunConfig (no Hydra)."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(container, dict)
    return to_run_config(container)  # type: ignore[arg-type]
