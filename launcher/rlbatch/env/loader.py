"""Environments by import path (``env.path``), with the loader and the kind of pre-launch checks
reward functions get (rlbatch.grpo.user_rewards): ``PATH.py:Class`` (a file) or
``module.path:Class`` (importable; the launch directory is on the search path).

:func:`check_environment` runs in the driver before any worker starts (its message becomes a
configuration error on ``env.path``); workers construct the environment with
:func:`build_environment`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from rlbatch.env.protocol import EnvSpecError
from rlbatch.grpo.user_rewards import RewardSpecError, load_callable

METHODS = {"reset": ("row",), "step": ("state", "text")}
"""Protocol methods and the arguments rlbatch passes them (positionally)."""


def load_environment_class(spec: str) -> Any:
    """The class (or factory) ``spec`` names; EnvSpecError saying what is missing."""
    try:
        return load_callable(spec, what="class")
    except RewardSpecError as err:
        raise EnvSpecError(str(err)) from err


def _method_problems(cls: Any, spec: str) -> list[str]:
    problems = []
    for name, args in METHODS.items():
        method = getattr(cls, name, None)
        if method is None or not callable(method):
            problems.append(
                f"{spec} has no method {name}({', '.join(args)}): an environment needs"
                f" reset(row) and step(state, text)"
            )
            continue
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):
            continue  # a builtin or C method: trusted
        bound_args = (None, *args) if inspect.isclass(cls) else args  # unbound: self first
        try:
            signature.bind(*bound_args)
        except TypeError as err:
            problems.append(f"{spec}.{name} cannot be called as {name}({', '.join(args)}): {err}")
    return problems


def check_environment(spec: str, kwargs: Mapping[str, Any]) -> None:
    """Importable, ``reset`` / ``step`` present with usable signatures, and a constructor that
    accepts env.kwargs; EnvSpecError naming the file and everything missing."""
    cls = load_environment_class(spec)
    problems = _method_problems(cls, spec)
    try:
        inspect.signature(cls).bind(**dict(kwargs))
    except TypeError as err:
        problems.append(f"{spec} cannot be constructed with env.kwargs={dict(kwargs)}: {err}")
    except ValueError:
        pass  # no inspectable signature: construction in the worker reports it
    if problems:
        raise EnvSpecError("; ".join(problems))


def build_environment(spec: str, kwargs: Mapping[str, Any]) -> Any:
    """An instance of ``spec`` constructed with ``kwargs`` (checked first)."""
    check_environment(spec, kwargs)
    cls = load_environment_class(spec)
    try:
        return cls(**dict(kwargs))
    except Exception as err:
        raise EnvSpecError(
            f"constructing {spec} with env.kwargs={dict(kwargs)} raised {type(err).__name__}: {err}"
        ) from err


def environment_name(env: Any) -> str:
    """The class name errors use."""
    return type(env).__qualname__
