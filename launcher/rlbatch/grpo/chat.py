"""Chat templates, applied to prompt text before tokenizing (``data.chat_template``).

``qwen`` is the Qwen2.5 ChatML format (what its tokenizer_config.json chat_template renders
with ``add_generation_prompt=True``); ``none`` passes a plain-text prompt through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Union

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


def apply_chat_template(template: ChatTemplate, prompt: PromptContent) -> str:
    """The text to tokenize for `prompt` (a string, or a list of {role, content} messages)."""
    template = ChatTemplate(template)
    if template == ChatTemplate.qwen:
        return render_qwen(prompt)
    if not isinstance(prompt, str):
        raise ValueError(
            "a prompt is a list of chat messages but data.chat_template=none: set"
            " data.chat_template=qwen, or store plain-text prompts"
        )
    return prompt
