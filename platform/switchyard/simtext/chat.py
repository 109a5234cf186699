"""Chat prompts to token ids: a Llama-3-style chat template, tools and images included.

The template's own tokens count, as they do on a real server: every message is wrapped in
``<|start_header_id|>role<|end_header_id|>\\n\\n … <|eot_id|>`` and the prompt ends with the
assistant header (``add_generation_prompt``). With ``continue_final_message`` the final message is
left open instead, as Hugging Face's ``apply_chat_template`` leaves it (vLLM's renderer): the prompt
ends with its last text, without what the template writes after it (tool calls, ``<|eot_id|>``) and
without a generation prompt, so that the model continues that text. Tool definitions and a
``response_format`` schema are rendered as JSON into a system section, so they cost prompt tokens. Image (and
other media) parts count a fixed number of placeholder tokens whose id depends on the
media's URL, so two different images never share a cached prefix.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgspec

from switchyard.simtext.tokens import tokenize

#: Tokens one image costs: a 336x336 image in 14x14 patches (CLIP ViT-L/14-336, LLaVA) = 576.
IMAGE_TOKENS = 576
_MEDIA_PARTS = {"image_url": "url", "image": None, "image_pil": None, "image_embeds": None,
                "input_audio": None, "audio_url": "url", "video_url": "url", "file": None}
_TEXT_PARTS = {"text", "input_text", "refusal"}


class ChatFormatError(ValueError):
    """The messages cannot be rendered (answered 400, parameter ``messages``)."""


def _media_id(part: dict[str, Any], kind: str) -> int:
    inner = part.get(kind)
    ref = inner.get("url") if isinstance(inner, dict) else inner
    digest = zlib.crc32(msgspec.json.encode(ref if ref is not None else part))
    return 100 + digest % 800  # ids below the text range, one per distinct medium


def _content_segments(content: object, where: str) -> list[str | int]:
    """Text pieces and media placeholder ids of one message's content."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatFormatError(f"{where}.content must be a string or a list of content parts")
    out: list[str | int] = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ChatFormatError(f"{where}.content[{i}] must be an object with a 'type'")
        kind = part["type"]
        if kind in _TEXT_PARTS:
            text = part.get(kind if kind != "input_text" else "text", part.get("text"))
            if not isinstance(text, str):
                raise ChatFormatError(f"{where}.content[{i}].text must be a string")
            out.append(text)
        elif kind in _MEDIA_PARTS:
            out.append(_media_id(part, kind))
        else:
            raise ChatFormatError(f"Unknown part type: {kind}")
    return out


#: What ``apply_chat_template`` says to both flags (transformers 5, which vLLM 0.32 ships with).
BOTH_FLAGS = ("continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
              "when you want the model to continue the final message, and add_generation_prompt when you want to "
              "add a header that will prompt it to start a new assistant message instead.")
#: What it says when the final message has content parts and none of them is text.
NO_TEXT_TO_CONTINUE = "continue_final_message is set but we could not find any text to continue in the final message!"


def render_chat(messages: object, tools: object = None, response_format: object = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """Token ids of a chat prompt.

    Args:
        messages: The request's ``messages`` (list of objects with ``role`` and ``content``).
        tools: The request's ``tools``, if any.
        response_format: The request's ``response_format``, if any.
        add_generation_prompt: End with the assistant header (vLLM's default).
        continue_final_message: Leave the final message open (see the module doc); refused together
            with ``add_generation_prompt``, as ``apply_chat_template`` refuses it.

    Raises:
        ChatFormatError: Malformed messages, or both flags.
    """
    if continue_final_message and add_generation_prompt:
        raise ChatFormatError(BOTH_FLAGS)
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    segments: list[str | int] = ["<|begin_of_text|>"]
    extras: list[str] = []
    if tools:
        extras.append("You have access to the following functions:\n"
                      + msgspec.json.encode(tools).decode())
    if response_format:
        extras.append("Respond with JSON matching this format:\n"
                      + msgspec.json.encode(response_format).decode())
    if extras:
        segments.append("<|start_header_id|>system<|end_header_id|>\n\n"
                        + "\n\n".join(extras) + "<|eot_id|>")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatFormatError(f"{where} must be an object with a string 'role'")
        segments.append(f"<|start_header_id|>{message['role']}<|end_header_id|>\n\n")
        content = _content_segments(message.get("content"), where)
        if continue_final_message and i == len(messages) - 1:
            segments.extend(_open_end(content, message.get("content")))
            return _to_ids(segments)
        segments.extend(content)
        calls = message.get("tool_calls")
        if calls:
            segments.append("<|python_tag|>" + msgspec.json.encode(calls).decode())
        segments.append("<|eot_id|>")
    if add_generation_prompt:
        segments.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return _to_ids(segments)


def _open_end(content: list[str | int], raw: object) -> list[str | int]:
    """The final message's content up to its last text, where ``apply_chat_template`` cuts the prompt
    (it marks the end of the last text part and cuts there; media after it go too)."""
    texts = [k for k, seg in enumerate(content) if isinstance(seg, str)]
    if texts:
        return content[:texts[-1] + 1]
    if isinstance(raw, list) and raw:
        raise ChatFormatError(NO_TEXT_TO_CONTINUE)
    return []  # no content at all: the message is continued from its header


def _to_ids(segments: list[str | int]) -> list[int]:
    ids: list[int] = []
    text: list[str] = []
    for seg in segments:
        if isinstance(seg, str):
            text.append(seg)
            continue
        if text:
            ids.extend(tokenize("".join(text)))
            text.clear()
        ids.extend([seg] * IMAGE_TOKENS)
    if text:
        ids.extend(tokenize("".join(text)))
    return ids
