"""Generate docs/configuration.md from the schema's field docstrings.

    python -m rlbatch.config.reference > docs/configuration.md

A test keeps the page current and checks that every field has a docstring.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import typing
from typing import Any

from rlbatch.config import schema
from rlbatch.config.load import _FIELD_TO_KEY, _unwrap_optional
from rlbatch.config.schema import RunConfig

INTRO = """# Configuration reference

rlbatch is configured with Hydra. `conf/config.yaml` lists the default option of each group;
a recipe (`+recipe=NAME`, files in `recipes/`) is a small delta on it; command-line
`KEY=VALUE` overrides come last. Select a group option with `GROUP=OPTION` (the batching options
fill two slots: `batching@batching.train=packed`, `batching@batching.infer=dynamic`).

After composition the driver checks the config against the typed schema
(`rlbatch/config/schema.py`) and the cross-field rules (`rlbatch/config/validate.py`) in one
pass and prints **every** error with its dotted key, the bad value and the fix, before anything
heavy is imported. Enum values accept the name (`token_mean`) or the value (`token-mean`).

Cross-field rules: sizes, budgets and steps positive; `batching.*.sequence_length_round` a
multiple of `tp*cp`; `batching.*.max_tokens` at least the longest possible sequence
(`data.max_prompt_len + rollout.max_new_tokens`, rounded; `env.max_total_tokens` for
multi-turn runs) unless `oversize` is `isolate` or `truncate`; a multi-turn run (`env.path`)
needs `tp = pp = cp = 1`, `rollout.kv_cache=true`, `rollout.backend=megatron` and
`env.max_total_tokens > data.max_prompt_len`; an agent harness (`env.harness`, docs/agents.md)
excludes `env.path`, needs a chat template (not `none`) and, today, the same built-in layout
with `grpo.num_steps_async=0` and `grpo.partial_rollouts=false`; `parallel.vpp > 1` needs `pp > 1` and `model.num_layers` divisible by `pp*vpp`;
`parallel.ep` divides `dp*cp` and `model.num_moe_experts` and needs an MoE model (docs/engine.md, "MoE models");
`grpo.global_batch_size` (and `generation_batch_size`) a multiple of
`num_generations * parallel.dp`; `steps_per_generation` and `generation_batch_size` exclusive;
`tp*pp*cp*dp` equal to `nproc_per_node * nnodes`; the aggregation's service_target_bs (the
LCM of the rollout and train micro sizes, plus the ref / old sizes of passes that run when they
are not cut by the infer budget: the runtime's own rule) no larger than the prompts a DP rank
generates per round; `max_staleness >= num_steps_async`;
files and directories named by `data.path`, `model.hf_path`, `trainer.resume` exist.

Each command checks the sections it uses: `rlbatch-train` all of them; `rlbatch-plan` only
`batching`, `parallel` and `plan` (it builds no model, so a layout the preset model could not
split still plans); `rlbatch-logprobs` `model`, `batching.infer`, `parallel` and `logprobs`
(lengths come from its input file). With `model.hf_path` set, the architecture in its
`config.json` replaces the preset's before the rules run (the command prints what changed), so
layer and head divisibility are checked against the real checkpoint.

This page is generated from the schema's docstrings: `python -m rlbatch.config.reference`.
"""


def field_docs(cls: type) -> dict[str, str]:
    """Docstring under each field of dataclass ``cls`` (from its source)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(inspect.getsource(klass))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:] + [None], strict=True):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                    docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return value.name
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _type_text(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        text = " \\| ".join(m.name for m in inner)
    else:
        text = getattr(inner, "__name__", str(inner))
    return f"{text} or null" if optional else text


def _rows(prefix: str, cls: type, default_obj: Any, out: list[tuple[str, list[str]]]) -> None:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows: list[str] = []
    nested: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{_FIELD_TO_KEY.get(f.name, f.name)}"
        tp, _ = _unwrap_optional(hints[f.name])
        value = getattr(default_obj, f.name) if default_obj is not None else _default(f)
        if dataclasses.is_dataclass(tp):
            nested.append((key, tp, value))
            continue
        rows.append(
            f"| `{key}` | {_type_text(hints[f.name])} | `{_show(value)}` | {docs.get(f.name, '')} |"
        )
    if rows:
        out.append((prefix.rstrip(".") or "(root)", rows))
    for key, tp, value in nested:
        _rows(f"{key}.", tp, value, out)


def render_markdown() -> str:
    sections: list[tuple[str, list[str]]] = []
    _rows("", RunConfig, RunConfig(), sections)
    lines = [INTRO]
    for title, rows in sections:
        lines += [f"## `{title}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        lines += rows + [""]
    return "\n".join(lines)


def undocumented_fields() -> list[str]:
    """Schema fields without a docstring (the style requires one per field)."""
    missing = []
    for name, cls in vars(schema).items():
        if dataclasses.is_dataclass(cls) and isinstance(cls, type):
            docs = field_docs(cls)
            missing += [f"{name}.{f.name}" for f in dataclasses.fields(cls) if f.name not in docs]
    return missing


if __name__ == "__main__":
    print(render_markdown(), end="")
