"""A request's prompt as the engine's token ids: the chat template applied, then tokenized, as vLLM does.

KV-cache-aware routing looks up which endpoint caches the longest prefix of a request's token ids, so the
gateway must compute the ids the engine will compute. A :data:`PromptRenderer` does that for one model:
given the body of ``/v1/chat/completions`` or ``/v1/completions`` it returns the token ids, or ``None``
when it cannot know them exactly (no tokenizer declared, media parts, a template of the request's own, …).

A model's renderer follows its policy entry (``models[].tokenizer``, ``models[].chat_template``):

- ``tokenizer: switchyard-sim``: the simulated engines' own tokenizer and template
  (:mod:`switchyard.simtext`), exactly as ``switchyard sim`` renders a request;
- a ``tokenizer.json``: a chat is rendered with the model's Jinja chat template
  (:mod:`switchyard.gateway.chat_templates`) the way vLLM 0.32 renders it (its message normalisation here,
  then Hugging Face's ``apply_chat_template`` environment), and the text is tokenized without special
  tokens (vLLM's default for chats); a completion prompt is tokenized with them (BOS), and token ids pass
  through.

Renderers are built when a policy is loaded (:func:`load_prompt_renderers`, never on the request path),
with each file read and each template compiled once per process through the
:class:`~switchyard.gateway.tokenizers.TokenizerCache`. A template that is missing, unreadable or not
valid Jinja is a policy error at the model's ``chat_template`` (or ``tokenizer``) YAML location.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from switchyard.decide.picking import PromptRenderer
from switchyard.gateway.chat_templates import ChatTemplate, ChatTemplateError, load_chat_template
from switchyard.gateway.tokenizers import TokenizerCache, TokenizerError, resolve_tokenizer_path
from switchyard.policy.errors import Loc, PolicyError, issues_at
from switchyard.policy.fleet import SIM_TOKENIZER
from switchyard.policy.load import parse_yaml
from switchyard.policy.snapshot import PolicySnapshot

#: Keys of ``chat_template_kwargs`` that are ``apply_chat_template``'s own arguments, not template variables.
_NOT_TEMPLATE_KWARGS = frozenset({
    "tokenize", "chat_template", "conversation", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "continue_final_message",
})
#: Content parts vLLM reads as text, and the key holding the text.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}
#: Content-part keys vLLM knows (the rest of a text part is kept when the template takes parts).
_KNOWN_PART_KEYS = frozenset({
    "type", "text", "refusal", "thinking", "image_url", "input_audio", "audio_url", "video_url", "image_pil",
    "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "data", "uuid", "name", "file",
    "signature", "closed", "detail",
})
_BILLING_HEADER = "x-anthropic-billing-header"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _Unrenderable(Exception):
    """The request holds something the renderer cannot turn into the engine's exact ids."""


# --- a chat request as vLLM hands it to the template --------------------------------------------


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM drops Claude Code's attribution line from system text parts (it changes every request)."""
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) and \
            part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _content(role: str, content: object, parts: bool) -> str | list[dict[str, Any]]:
    if content is None:
        items: list[Any] = []
    elif isinstance(content, str):
        items = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        items = content
    else:
        raise _Unrenderable("content")
    if role == "system":
        items = _strip_billing_header(items)
    texts: list[str] = []
    wrapped: list[dict[str, Any]] = []
    for part in items:
        if isinstance(part, str):
            text: object = part
            extra: dict[str, Any] = {}
        elif isinstance(part, dict) and part.get("type") in _TEXT_PARTS and part.get("uuid") is None:
            text = part.get(_TEXT_PARTS[part["type"]])
            if text is None and part["type"] in ("text", "refusal"):
                continue  # vLLM skips an empty text part
            extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_KEYS}
        else:
            raise _Unrenderable("a media or unknown content part")  # its placeholders are the model's own
        if not isinstance(text, str):
            raise _Unrenderable("text")
        texts.append(text)
        wrapped.append({"type": "text", "text": text, **extra})
    return wrapped if parts else "\n".join(texts)


def _arguments(value: object) -> dict[str, Any]:
    """A tool call's arguments as the object templates expect (vLLM parses the JSON string; {} if it is not)."""
    if not value:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


def _conversation(messages: object, parts: bool) -> list[dict[str, Any]]:
    """The ``messages`` vLLM hands the template (``parse_chat_messages``, text only)."""
    if not isinstance(messages, list) or not messages:
        raise _Unrenderable("messages")
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _Unrenderable("message")
        role = message["role"]
        item: dict[str, Any] = {"role": role, "content": _content(role, message.get("content"), parts)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                    raise _Unrenderable("tool_calls")
                if calls:
                    item["tool_calls"] = [_tool_call(c) for c in calls]
            if message.get("reasoning") is not None:
                item["reasoning"] = item["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                item["tool_call_id"] = message["tool_call_id"]
            if isinstance(item["content"], list):  # text parts of a tool result are joined for the template
                item["content"] = "\n".join(p["text"] for p in item["content"])
        if isinstance(message.get("name"), str):
            item["name"] = message["name"]
        if isinstance(message.get("task"), str):
            item["task"] = message["task"]
        if role == "developer":
            item["tools"] = message.get("tools")
        out.append(item)
    return out


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise _Unrenderable("tool call")
    return {**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}}


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's treatment of "developer" messages for a template that does not know the role: they become
    "system" messages, and all system messages are merged into one, first."""
    converted = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer"
                 else m for m in conversation]
    systems: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            others.append(m)
            continue
        merge = merge or i > 0 or bool(systems)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            systems.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *others]


def _tools(tools: object) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM hands them to the template (its pydantic models, dumped)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _Unrenderable("tools")
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _Unrenderable("tool")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _Unrenderable("tool function")
        dumped: dict[str, Any] = {"name": function["name"], "description": function.get("description"),
                                  "parameters": function.get("parameters")}
        defer = function.get("defer_loading", tool.get("defer_loading"))
        if function.get("strict") is not None:
            dumped["strict"] = function["strict"]
        if defer is not None:
            dumped["defer_loading"] = defer
        entry: dict[str, Any] = {"type": "function", "function": dumped}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _Unrenderable(name)
    return value


def render_chat_text(chat: ChatTemplate, body: Mapping[str, Any]) -> str:
    """The text vLLM's chat template makes of a ``/v1/chat/completions`` body.

    Raises:
        _Unrenderable: The body holds what this cannot render exactly (also raised for invalid requests).
    """
    if body.get("chat_template") is not None or body.get("prompt_embeds") is not None:
        raise _Unrenderable("a template or embeddings of the request's own")
    user_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(user_kwargs, dict) or _NOT_TEMPLATE_KWARGS & user_kwargs.keys():
        raise _Unrenderable("chat_template_kwargs")
    tools = _tools(body.get("tools"))
    compiled = chat.for_request(tools)
    if compiled is None:
        raise _Unrenderable("no template")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    if continue_final and add_generation_prompt:
        raise _Unrenderable("both add_generation_prompt and continue_final_message")
    conversation = _conversation(body.get("messages"), compiled.parts)
    if not compiled.developer_role and any(m["role"] == "developer" for m in conversation):
        conversation = _developer_as_system(conversation)
    variables: dict[str, Any] = dict(chat.special_tokens)
    variables |= {k: v for k, v in user_kwargs.items() if v not in (None, "auto") and k in compiled.variables}
    reasoning_effort = body.get("reasoning_effort")
    if reasoning_effort is not None:
        variables["reasoning_effort"] = reasoning_effort
        if "enable_thinking" not in user_kwargs:
            variables["enable_thinking"] = reasoning_effort != "none"
    documents = body.get("documents")
    final = ""
    if continue_final:
        last = conversation[-1]
        if not isinstance(last["content"], str) or "content" not in compiled.source:
            raise _Unrenderable("continue_final_message")
        final = last["content"]
        conversation[-1] = {**last, "content": final + _CONTINUE_TAG}
    try:
        text: str = compiled.template.render(messages=conversation, tools=tools, documents=documents,
                                             add_generation_prompt=add_generation_prompt, **variables)
    except Exception as exc:  # the template refused the request (raise_exception) or failed on it
        raise _Unrenderable("the template failed") from exc
    if continue_final:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise _Unrenderable("continue_final_message")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


# --- renderers --------------------------------------------------------------------------------------


def _completion_ids(prompt: object, encode: Callable[[str], list[int]]) -> list[int] | None:
    """A ``/v1/completions`` prompt: a string is encoded, token ids pass through; several prompts are not one."""
    if isinstance(prompt, str):
        return encode(prompt)
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(type(t) is int for t in prompt):
        return list(prompt)
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        return _completion_ids(prompt[0], encode)
    return None


def _unsupported(body: Mapping[str, Any]) -> bool:
    """What changes the ids or the blocks the engine caches in ways a renderer does not follow (a
    ``cache_salt`` keeps the request's blocks apart from everyone else's)."""
    return body.get("truncate_prompt_tokens") is not None or body.get("cache_salt") is not None


class HfPromptRenderer:
    """Renders with a ``tokenizer.json`` and the model's chat template, as vLLM does (see the module)."""

    __slots__ = ("_chat", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, chat: ChatTemplate | None) -> None:
        self._tokenizer = tokenizer
        self._chat = chat

    def __call__(self, body: Mapping[str, Any]) -> list[int] | None:
        if _unsupported(body):
            return None
        try:
            if "messages" in body:
                if self._chat is None:
                    return None
                text = render_chat_text(self._chat, body)
                special = _flag(body, "add_special_tokens", False)
                return list(self._tokenizer.encode(text, add_special_tokens=special).ids)
            special = _flag(body, "add_special_tokens", True)
        except _Unrenderable:
            return None
        return _completion_ids(body.get("prompt"),
                               lambda text: list(self._tokenizer.encode(text, add_special_tokens=special).ids))


class SimPromptRenderer:
    """Renders with the simulated engines' tokenizer and template, as ``switchyard sim`` does."""

    __slots__ = ("_bos", "_chat_error", "_render_chat", "_tokenize")

    def __init__(self) -> None:
        # Imported when a policy names it: the stand-in tokenizer builds its tables on import.
        from switchyard.simtext.chat import ChatFormatError, render_chat
        from switchyard.simtext.tokens import SPECIAL_TOKENS, tokenize
        self._render_chat, self._chat_error, self._tokenize = render_chat, ChatFormatError, tokenize
        self._bos = SPECIAL_TOKENS["<|begin_of_text|>"]

    def __call__(self, body: Mapping[str, Any]) -> list[int] | None:
        if _unsupported(body):
            return None
        if "messages" in body:
            try:
                add_generation_prompt = _flag(body, "add_generation_prompt", True)
                # (The sim refuses continue_final_message with add_generation_prompt, as vLLM does: so does this.)
                return self._render_chat(body["messages"], body.get("tools"), body.get("response_format"),
                                         add_generation_prompt, _flag(body, "continue_final_message", False))
            except (_Unrenderable, self._chat_error, TypeError, ValueError):
                return None
        return _completion_ids(body.get("prompt"), lambda text: [self._bos, *self._tokenize(text)])


def load_prompt_renderers(snapshot: PolicySnapshot, base_dir: Path, cache: TokenizerCache,
                          source: str = "<policy>") -> dict[str, PromptRenderer]:
    """A prompt renderer for every model of ``snapshot`` that declares a tokenizer (the others have none).

    Args:
        snapshot: The policy whose models name their tokenizers and chat templates.
        base_dir: The folder relative paths are relative to (the policy file's).
        cache: The process's tokenizers and templates, so that each file is read and compiled once.
        source: How errors name the policy (its file), as :func:`~switchyard.policy.compile_policy`.

    Raises:
        PolicyError: A tokenizer or chat template cannot be loaded; each issue names the model's
            ``tokenizer`` or ``chat_template`` field, its YAML line and the file.
    """
    renderers: dict[str, PromptRenderer] = {}
    failed: list[tuple[Loc, str]] = []
    sim: SimPromptRenderer | None = None
    for i, model in enumerate(snapshot.document.models):
        if model.tokenizer is None:
            continue
        if model.tokenizer == SIM_TOKENIZER:
            sim = sim or SimPromptRenderer()
            renderers[model.name] = sim
            continue
        tokenizer_path = resolve_tokenizer_path(model.tokenizer, base_dir)
        try:
            tokenizer = cache.get(tokenizer_path)
        except TokenizerError as exc:
            failed.append((("models", i, "tokenizer"), str(exc)))
            continue
        template_path = None if model.chat_template is None else resolve_tokenizer_path(model.chat_template, base_dir)
        try:
            chat = load_chat_template(tokenizer_path, template_path, cache)
        except ChatTemplateError as exc:
            field = "chat_template" if model.chat_template is not None else "tokenizer"
            failed.append((("models", i, field), str(exc)))
            continue
        renderers[model.name] = HfPromptRenderer(tokenizer, chat)
    if failed:
        raise PolicyError(issues_at(parse_yaml(snapshot.text, source), source, failed))
    return renderers
