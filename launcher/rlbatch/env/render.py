"""Observation text as the chat template renders it (``data.chat_template``), appended to a
trajectory after an assistant turn that ended with EOS.

- ``none``: the observation text as is;
- ``qwen``: a Qwen2.5 tool turn (Qwen2.5's template renders ``role: tool`` messages as a user
  turn holding ``<tool_response>``), then the next assistant header::

      \\n<|im_start|>user\\n<tool_response>\\n{observation}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

  (the leading newline follows the assistant turn's ``<|im_end|>``, the EOS it ended with);
- ``model``: the tokenizer's own template: what it adds to a conversation when a ``tool``
  message follows an assistant one, with the generation prompt, minus what closes the assistant
  turn up to and including its EOS text; the byte tokenizer (no template) gets ``qwen``'s form.

An observation longer than env.max_observation_tokens is cut inside its content, never in its
wrapper (what the template puts before and after it, the next assistant header included):
:func:`wrapper_text` gives that wrapper, and a limit that cannot hold it with at least one token
of content is a configuration error before launch (:func:`wrapper_error`).
"""

from __future__ import annotations

from typing import Any, Optional

from rlbatch.config.enums import ChatTemplate
from rlbatch.config.errors import ConfigError
from rlbatch.grpo.chat import render_template

QWEN_TOOL_TURN = (
    "\n<|im_start|>user\n<tool_response>\n{observation}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _model_template_text(template: str, observation: str, tokenizer: Any) -> str:
    special = getattr(tokenizer, "special_tokens", None) or {}
    marker = "\x00assistant\x00"
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}]
    before = render_template(template, base, special, add_generation_prompt=False)
    after = render_template(template, [*base, {"role": "tool", "content": observation}], special)
    if not after.startswith(before) or marker not in before:
        raise ValueError(
            "data.chat_template=model: the tokenizer's chat template does not render a tool"
            " message after an assistant one as an extension of the conversation: set"
            " data.chat_template=qwen or none for multi-turn environments"
        )
    closing = before[before.rindex(marker) + len(marker) :]  # what ends the assistant turn
    eos = special.get("eos_token")
    if eos and eos in closing:
        closing = closing[closing.index(eos) + len(eos) :]  # the sampled EOS already closed it
    return closing + after[len(before) :]


def observation_text(template: ChatTemplate, observation: str, tokenizer: Any) -> str:
    """The text appended after an assistant turn for ``observation`` (see the module docstring)."""
    template = ChatTemplate(template)
    if template == ChatTemplate.none:
        return observation
    own = getattr(tokenizer, "chat_template", None)
    if template == ChatTemplate.model and own is not None:
        return _model_template_text(own, observation, tokenizer)
    return QWEN_TOOL_TURN.format(observation=observation)


_MARKER = "\x00observation\x00"


def wrapper_text(template: ChatTemplate, tokenizer: Any) -> tuple[str, str]:
    """(before, after): the text the template puts around an observation's content (``""``,
    ``""`` for ``none``)."""
    rendered = observation_text(template, _MARKER, tokenizer)
    before, found, after = rendered.partition(_MARKER)
    if not found:
        raise ValueError(
            f"data.chat_template={ChatTemplate(template).name}: the template does not render a"
            " tool message's content as given: set data.chat_template=qwen or none"
        )
    return before, after


def wrapper_error(
    template: ChatTemplate, tokenizer: Any, max_observation_tokens: int
) -> Optional[ConfigError]:
    """The env.max_observation_tokens error when the wrapper leaves no room for content."""
    before, after = wrapper_text(template, tokenizer)
    wrapper = len(tokenizer.encode(before)) + len(tokenizer.encode(after))
    if max_observation_tokens > wrapper:
        return None
    return ConfigError(
        "env.max_observation_tokens",
        max_observation_tokens,
        f"cannot hold the tool turn's wrapper of data.chat_template="
        f"{ChatTemplate(template).name} ({wrapper} tokens: the closing tags and the next"
        f" assistant header) and any content: raise it to at least {wrapper + 1}",
    )
