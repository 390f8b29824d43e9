"""Chat templates, applied to prompt text before tokenizing (``data.chat_template``).

``model`` renders the model's own template (tokenizer_config.json ``chat_template`` or
chat_template.jinja) with jinja2 exactly as transformers' ``apply_chat_template`` does
(sandboxed environment, trim_blocks / lstrip_blocks, loop controls, ``tojson``,
``raise_exception``, ``strftime_now``, the special tokens as variables,
``add_generation_prompt=True``); the built-in byte tokenizer has no template and gets ChatML.
``qwen`` is the built-in Qwen2.5 ChatML format; ``none`` passes a plain-text prompt through
unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional, Union

from rlbatch.config.schema import ChatTemplate

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
"""System message Qwen2.5's template inserts when the conversation has none."""

Messages = Sequence[Mapping[str, str]]
PromptContent = Union[str, Messages]


def _as_messages(prompt: PromptContent) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = []
    for i, m in enumerate(prompt):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(
                f"chat message {i} is {m!r}: each message needs 'role' and 'content' keys"
            )
        messages.append({"role": str(m["role"]), "content": str(m["content"])})
    return messages


def render_qwen(prompt: PromptContent, system: str = QWEN_DEFAULT_SYSTEM) -> str:
    """Qwen2.5 ChatML: system (default unless given), the messages, then the assistant turn."""
    messages = _as_messages(prompt)
    if not messages or messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_template(
    template: str,
    prompt: PromptContent,
    special_tokens: Optional[Mapping[str, str]] = None,
    add_generation_prompt: bool = True,
) -> str:
    """A model's jinja chat template over ``prompt`` (``add_generation_prompt=True`` unless
    told otherwise)."""
    return _compile(template).render(
        messages=_as_messages(prompt),
        add_generation_prompt=add_generation_prompt,
        **(special_tokens or {}),
    )


def render_conversation(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    special_tokens: Optional[Mapping[str, str]] = None,
    *,
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    add_generation_prompt: bool = True,
) -> str:
    """A model's jinja chat template over whole OpenAI-style messages (tool calls, tool
    results and the ``tools`` list passed through as transformers passes them)."""
    extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
    return _compile(template).render(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        **extra,
        **(special_tokens or {}),
    )


def apply_chat_template(
    template: ChatTemplate, prompt: PromptContent, tokenizer: Any = None
) -> str:
    """The text to tokenize for `prompt` (a string, or a list of {role, content} messages).
    ``data.chat_template=model`` uses ``tokenizer.chat_template`` (ChatML when the tokenizer
    has none: the built-in byte tokenizer)."""
    template = ChatTemplate(template)
    if template == ChatTemplate.model:
        own = getattr(tokenizer, "chat_template", None)
        if own is None:
            if getattr(tokenizer, "path", None) is not None:  # an HF tokenizer without one
                raise ValueError(
                    f"data.chat_template=model: {tokenizer.path} has no chat_template "
                    "(tokenizer_config.json or chat_template.jinja): set data.chat_template="
                    "qwen or none"
                )
            return render_qwen(prompt)
        return render_template(own, prompt, getattr(tokenizer, "special_tokens", None))
    if template == ChatTemplate.qwen:
        return render_qwen(prompt)
    if not isinstance(prompt, str):
        raise ValueError(
            "a prompt is a list of chat messages but data.chat_template=none: set"
            " data.chat_template=qwen, or store plain-text prompts"
        )
    return prompt
