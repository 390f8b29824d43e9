"""Messages to text for the agent endpoint, and tool calls back out of a completion.

Both chat templates that can render a conversation are supported: ``qwen`` (rlbatch's built-in
Qwen2.5 ChatML, with Qwen2.5's tool section, ``<tool_call>`` blocks in assistant turns and tool
results as ``<tool_response>`` in a user turn) and ``model`` (the tokenizer's own jinja
template, given the messages and ``tools`` as transformers gives them). ``none`` has no
conversation format and is refused before launch.

:func:`continuation_text` is the splice's half: the text that follows an assistant turn the
policy sampled, up to the next generation prompt, for the messages the harness added after it.
It is rendered from those messages alone (behind a fixed stand-in conversation), so what the
template does to earlier turns (Qwen3 drops their ``<think>`` blocks) never reaches the tokens
the policy sampled.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from rlbatch.config.enums import ChatTemplate, ToolParser
from rlbatch.grpo.chat import QWEN_DEFAULT_SYSTEM, render_conversation

Message = Mapping[str, Any]

QWEN_TOOLS = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and"
    " arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""Qwen2.5's tool section of the system turn."""


def _arguments(call: Mapping[str, Any]) -> Any:
    """A tool call's arguments as an object (OpenAI sends a JSON string)."""
    args = call.get("function", call).get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _qwen_tool_call(call: Mapping[str, Any]) -> str:
    fn = call.get("function", call)
    body = json.dumps({"name": fn.get("name"), "arguments": _arguments(call)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _content(message: Message) -> str:
    """Text content (None -> ''; a list of text parts joined, as OpenAI's content parts)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def _render_qwen(
    messages: Sequence[Message], tools: Optional[Sequence[Any]], generation_prompt: bool
) -> str:
    messages = list(messages)
    parts = []
    system = QWEN_DEFAULT_SYSTEM
    if messages and messages[0].get("role") == "system":
        system = _content(messages.pop(0))
    if tools:
        listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        system += QWEN_TOOLS.format(tools=listed)
    parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            if i == 0 or messages[i - 1].get("role") != "tool":
                parts.append("<|im_start|>user")
            parts.append(f"\n<tool_response>\n{_content(m)}\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1].get("role") != "tool":
                parts.append("<|im_end|>\n")
            continue
        text = _content(m)
        for call in m.get("tool_calls") or ():
            text += ("\n" if text else "") + _qwen_tool_call(call)
        parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _jinja_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as HF templates read them: tool-call arguments as objects, content as text."""
    out = []
    for m in messages:
        m = dict(m)
        m["content"] = _content(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c.get("function", {}), "arguments": _arguments(c)}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def render(
    template: ChatTemplate,
    messages: Sequence[Message],
    tokenizer: Any,
    tools: Optional[Sequence[Any]] = None,
    generation_prompt: bool = True,
) -> str:
    """The text of a conversation under data.chat_template (qwen or model)."""
    template = ChatTemplate(template)
    own = getattr(tokenizer, "chat_template", None)
    if template == ChatTemplate.model and own is not None:
        special = getattr(tokenizer, "special_tokens", None) or {}
        return render_conversation(
            own,
            _jinja_messages(messages),
            special,
            tools=tools,
            add_generation_prompt=generation_prompt,
        )
    if template == ChatTemplate.none:
        raise ValueError("data.chat_template=none renders no conversation")
    return _render_qwen(messages, tools, generation_prompt)


_MARKER = "\x00assistant-turn\x00"


def eos_text(template: ChatTemplate, tokenizer: Any) -> str:
    """The text a sampled EOS stands for at the end of an assistant turn."""
    if ChatTemplate(template) == ChatTemplate.model and getattr(tokenizer, "chat_template", None):
        special = getattr(tokenizer, "special_tokens", None) or {}
        return str(special.get("eos_token") or "")
    return "<|im_end|>"


def continuation_text(
    template: ChatTemplate,
    tokenizer: Any,
    added: Sequence[Message],
    tools: Optional[Sequence[Any]],
    ended_with_eos: bool,
) -> str:
    """What follows a sampled assistant turn: the template's closing of that turn (less what a
    sampled EOS already closed), the ``added`` messages, and the next generation prompt.
    ValueError when the template does not render a conversation as a sequence of turns."""
    base: list[Message] = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _MARKER},
    ]
    before = render(template, base, tokenizer, tools, generation_prompt=False)
    after = render(template, [*base, *added], tokenizer, tools, generation_prompt=True)
    if not after.startswith(before) or _MARKER not in before:
        raise ValueError(
            f"data.chat_template={ChatTemplate(template).value}: the template does not render"
            " messages after an assistant turn as an extension of the conversation"
        )
    closing = before[before.rindex(_MARKER) + len(_MARKER) :]
    eos = eos_text(template, tokenizer)
    if ended_with_eos and eos and eos in closing:
        closing = closing[closing.index(eos) + len(eos) :]
    return closing + after[len(before) :]


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(
    text: str, parser: ToolParser, call_ids: Optional[list[str]] = None
) -> tuple[Optional[str], list[dict[str, Any]]]:
    """(content, tool_calls) of a completion's text: hermes ``<tool_call>{json}</tool_call>``
    blocks become OpenAI tool calls (a block that is not a JSON object with a name stays in
    the content); ``call_ids`` gives each call its id (fresh ones when None)."""
    if ToolParser(parser) == ToolParser.none or "<tool_call>" not in text:
        return text, []
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        args = body.get("arguments", {})
        index = len(calls)
        call_id = call_ids[index] if call_ids and index < len(call_ids) else _call_id()
        calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": body["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def same_assistant_turn(sent: Message, returned: Message) -> bool:
    """Whether the assistant message a harness sent back is the one the endpoint returned:
    the same text (surrounding whitespace aside) and the same tool calls (name and parsed
    arguments; ids and formatting aside)."""
    if sent.get("role") != "assistant":
        return False
    if _content(sent).strip() != _content(returned).strip():
        return False
    a, b = sent.get("tool_calls") or [], returned.get("tool_calls") or []
    if len(a) != len(b):
        return False
    return all(
        x.get("function", {}).get("name") == y.get("function", {}).get("name")
        and _arguments(x) == _arguments(y)
        for x, y in zip(a, b, strict=True)
    )


def same_messages(a: Sequence[Message], b: Sequence[Message]) -> bool:
    """Messages equal as the template renders them (role, text, tool calls, tool results)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.get("role") != y.get("role") or _content(x) != _content(y):
            return False
        if (x.get("tool_calls") or y.get("tool_calls")) and not same_assistant_turn(x, y):
            return False
    return True
