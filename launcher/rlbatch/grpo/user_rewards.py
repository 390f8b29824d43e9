"""Reward functions by import path (``data.reward_fn``): loading, signature checks, calling.

A spec is ``PATH.py:function`` (a file, loaded under a private module name) or
``module.path:function`` (imported; the working directory is on the search path). The
function declares what it reads by its parameter names (docs/data_and_rewards.md):

- per sample: ``prompt``, ``completion``, ``completion_ids``, ``answer`` -> a number;
- per batch: ``prompts``, ``completions``, ``completion_ids``, ``answers`` (lists) -> a list;
  ``completion_ids`` is in both: a function that reads only ``completion_ids`` (of the four) is
  called per sample; declare ``completions``, ``prompts`` or ``answers`` too to be called per
  batch;
- any other parameter names a field of the dataset row (a list of them per batch), and
  ``**kwargs`` receives every extra field.

``async def`` functions are awaited (per sample: all samples of a batch concurrently). Loading
happens twice: in the driver before launch (errors become config errors) and in each worker.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbatch.runtime import progress

SAMPLE_ARGS = ("prompt", "completion", "completion_ids", "answer")
"""Parameters of a per-sample reward function."""
BATCH_ARGS = ("prompts", "completions", "completion_ids", "answers")
"""Parameters of a per-batch reward function (one list each)."""
_SAMPLE_ONLY = frozenset({"prompt", "completion", "answer"})
_BATCH_ONLY = frozenset({"prompts", "completions", "answers"})


class RewardSpecError(ValueError):
    """A data.reward_fn entry that cannot be loaded or has an unusable signature."""


class RewardCallError(ValueError):
    """A reward function raised, or returned something that is not a finite number."""


@dataclass(frozen=True)
class UserReward:
    """A loaded reward function and how to call it."""

    spec: str
    """The data.reward_fn entry it came from."""
    fn: Callable[..., Any]
    batched: bool
    """Called once per batch with lists (else once per sample)."""
    field_args: tuple[str, ...]
    """Parameters that name dataset fields (required, no default)."""
    takes_all_fields: bool
    """Has **kwargs: receives every extra field of the row."""

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", self.spec.rsplit(":", 1)[-1])


def is_import_spec(spec: str) -> bool:
    """``x.py:fn`` or ``pkg.mod:fn`` (a built-in reward name has no colon)."""
    return ":" in spec


def load_callable(spec: str, what: str = "function") -> Callable[..., Any]:
    """The function (or class: ``what``) ``spec`` names; RewardSpecError saying what is
    missing."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise RewardSpecError(f"must be PATH.py:{what} or module.path:{what}")
    if target.endswith(".py"):
        module = _load_file(Path(target).expanduser())
    else:
        module = _import_module(target)
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and n[0] != "_")
        raise RewardSpecError(f"{target} has no {what} {attr!r} (it defines: {public})")
    if not callable(fn):
        raise RewardSpecError(f"{target}:{attr} is a {type(fn).__name__}, not a {what}")
    return fn


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise RewardSpecError(f"no such file {path}: fix the path (relative to the launch dir)")
    name = f"rlbatch_user_reward_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise RewardSpecError(f"importing {path} failed: {type(err).__name__}: {err}") from err
    return module


def _import_module(name: str) -> Any:
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise RewardSpecError(
            f"no module {name!r} ({err}): install it, or run from the directory that holds it"
        ) from err
    except Exception as err:
        raise RewardSpecError(f"importing {name} failed: {type(err).__name__}: {err}") from err


def inspect_reward(spec: str, fn: Callable[..., Any]) -> UserReward:
    """How to call ``fn``, from its parameter names; RewardSpecError for an unusable one."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as err:
        raise RewardSpecError(f"has no inspectable signature ({err})") from err
    names = set(params)
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    positional_only = [n for n, p in params.items() if p.kind == p.POSITIONAL_ONLY]
    if positional_only:
        raise RewardSpecError(f"has positional-only parameters {positional_only}: name them")
    sample, batch = names & _SAMPLE_ONLY, names & _BATCH_ONLY
    if sample and batch:
        raise RewardSpecError(
            f"mixes per-sample {sorted(sample)} and per-batch {sorted(batch)} parameters:"
            f" use {list(SAMPLE_ARGS)} or {list(BATCH_ARGS)}"
        )
    if not sample and not batch and "completion_ids" not in names:
        raise RewardSpecError(
            f"declares none of {list(SAMPLE_ARGS)} (per sample) or {list(BATCH_ARGS)}"
            f" (per batch): its parameters are {list(params)}; name the ones it reads, e.g."
            " def reward(completion, answer)"
        )
    known = set(BATCH_ARGS if batch else SAMPLE_ARGS)
    fields = tuple(
        n
        for n, p in params.items()
        if n not in known and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        and p.default is p.empty
    )  # fmt: skip
    return UserReward(spec, fn, bool(batch), fields, takes_all)


def load_reward(spec: str) -> UserReward:
    """Load and inspect one data.reward_fn entry."""
    return inspect_reward(spec, load_callable(spec))


# ------------------------------------------------------------------------------------------
# Calling
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """What a user reward sees of one sample."""

    prompt: str
    completion: str
    completion_ids: list[int]
    answer: str
    fields: Mapping[str, Any]
    """The row's fields other than the prompt and the answer."""
    label: str
    """Names the sample in errors (index in the batch, prompt index)."""


def _field_kwargs(reward: UserReward, fields: Mapping[str, Any]) -> dict[str, Any]:
    if reward.takes_all_fields:
        return dict(fields)
    return {k: fields[k] for k in reward.field_args if k in fields}


def _check_value(reward: UserReward, value: Any, c: Completion, abs_max: float) -> float:
    """A finite real number of magnitude <= abs_max (a str, bytes or complex is refused even
    when float() would take it: '1.5' is almost always a bug in the function)."""
    out = math.nan
    if not isinstance(value, (str, bytes, complex)):
        try:
            out = float(value)
        except (TypeError, ValueError):
            pass
    if not math.isfinite(out) or abs(out) > abs_max:
        why = "finite real numbers" if not math.isfinite(out) else f"at most {abs_max:g} in size"
        raise RewardCallError(
            f"reward function {reward.spec} returned {value!r} for {c.label} (a "
            f"{type(value).__name__}; completion {c.completion[:80]!r}): rewards must be {why}"
            " (data.reward_abs_max)"
        )
    return out


def _user_exit(reward: UserReward, err: BaseException, where: str) -> RewardCallError:
    """sys.exit / KeyboardInterrupt (a signal) inside a reward function: a failure of the
    function, never the end of the run (and never exit code 0)."""
    what = f"called sys.exit({err.code!r})" if isinstance(err, SystemExit) else (
        f"was interrupted ({type(err).__name__}: a signal such as SIGINT)"
    )  # fmt: skip
    return RewardCallError(f"reward function {reward.spec} {what} on {where}")


def _run(value: Any) -> Any:
    """Await a coroutine (async def reward) in a fresh event loop; pass anything else through."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    return asyncio.run(wait())


def _call_per_sample(reward: UserReward, batch: Sequence[Completion]) -> list[Any]:
    def call(c: Completion) -> Any:
        kwargs = {
            "prompt": c.prompt,
            "completion": c.completion,
            "completion_ids": c.completion_ids,
            "answer": c.answer,
        }
        wanted = {k: v for k, v in kwargs.items() if k in _params(reward)}
        try:
            return reward.fn(**wanted, **_field_kwargs(reward, c.fields))
        except (SystemExit, KeyboardInterrupt) as err:
            raise _user_exit(reward, err, c.label) from err
        except Exception as err:
            raise RewardCallError(
                f"reward function {reward.spec} raised {type(err).__name__}: {err} on {c.label}"
                f" (completion {c.completion[:80]!r})"
            ) from err

    values = [call(c) for c in batch]
    pending = [i for i, v in enumerate(values) if inspect.isawaitable(v)]
    if pending:

        async def gather() -> list[Any]:
            return await asyncio.gather(*(values[i] for i in pending), return_exceptions=True)

        for i, v in zip(pending, asyncio.run(gather()), strict=True):
            if isinstance(v, (SystemExit, KeyboardInterrupt)):
                raise _user_exit(reward, v, batch[i].label) from v
            if isinstance(v, BaseException):
                raise RewardCallError(
                    f"reward function {reward.spec} raised {type(v).__name__}: {v} on"
                    f" {batch[i].label} (completion {batch[i].completion[:80]!r})"
                ) from v
            values[i] = v
    return values


def _params(reward: UserReward) -> frozenset[str]:
    return frozenset(inspect.signature(reward.fn).parameters)


def _call_batched(reward: UserReward, batch: Sequence[Completion]) -> list[Any]:
    lists: dict[str, Any] = {
        "prompts": [c.prompt for c in batch],
        "completions": [c.completion for c in batch],
        "completion_ids": [c.completion_ids for c in batch],
        "answers": [c.answer for c in batch],
    }
    kwargs = {k: v for k, v in lists.items() if k in _params(reward)}
    keys = set(reward.field_args)
    if reward.takes_all_fields:
        keys |= {k for c in batch for k in c.fields}
    for key in sorted(keys):
        kwargs[key] = [c.fields.get(key) for c in batch]
    try:
        values = _run(reward.fn(**kwargs))
    except (SystemExit, KeyboardInterrupt) as err:
        raise _user_exit(reward, err, f"a batch of {len(batch)} samples") from err
    except Exception as err:
        raise RewardCallError(
            f"reward function {reward.spec} raised {type(err).__name__}: {err} on a batch of"
            f" {len(batch)} samples ({batch[0].label} .. {batch[-1].label})"
        ) from err
    if not isinstance(values, Sequence) and not hasattr(values, "tolist"):
        raise RewardCallError(
            f"reward function {reward.spec} is per batch (plural parameters) but returned"
            f" {type(values).__name__}: return one number per sample"
        )
    values = list(values.tolist() if hasattr(values, "tolist") else values)
    if len(values) != len(batch):
        raise RewardCallError(
            f"reward function {reward.spec} returned {len(values)} rewards for a batch of"
            f" {len(batch)} samples: return one per sample"
        )
    return values


def call_reward(
    reward: UserReward,
    batch: Sequence[Completion],
    *,
    abs_max: float = math.inf,
    timeout_s: float | None = None,
) -> list[float]:
    """One finite float per completion, each of magnitude <= ``abs_max``; RewardCallError
    names the function and the sample. The call is marked for the watchdog, which stops the
    run when it takes longer than ``timeout_s`` (None: trainer.timeout_s)."""
    if not batch:
        return []
    with progress.user_call(f"reward function {reward.spec}", timeout_s):
        raw = _call_batched(reward, batch) if reward.batched else _call_per_sample(reward, batch)
    return [_check_value(reward, v, c, abs_max) for v, c in zip(raw, batch, strict=True)]
