"""A Responses request's ``input``: pydantic's checks of its items, and the chat messages vLLM renders for them.

vLLM's ``construct_input_messages`` for a plain (non-harmony) chat model: ``instructions`` as a system message, a
string as one user message, items as chat messages (an assistant item's first text part as its content,
``function_call`` items as the assistant's tool calls, ``function_call_output`` items as tool messages; other
tool items are refused). A final assistant item whose status is ``in_progress`` or ``incomplete`` is continued
rather than answered.
"""

from __future__ import annotations

from typing import Any

from switchyard.sim.validation import ApiError, bad, input_repr, invalid

_ROLES = ("user", "assistant", "system", "developer")
#: Input item types the Responses API defines that vLLM refuses to render for a plain chat model.
_UNSUPPORTED_ITEMS = frozenset({
    "file_search_call", "computer_call", "computer_call_output", "web_search_call", "image_generation_call",
    "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
    "apply_patch_call", "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "item_reference", "compaction"})


def check_input(value: object) -> None:
    """The union ``str | list[item]``: the string branch's error, then the first item's (pydantic lists one
    per member of the item union, over two hundred; the simulator reports the first member's)."""
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        raise invalid("string_type", "body.input", "Input should be a valid string", value,
                      more=[{"type": "list_type", "loc": "body.input", "msg": "Input should be a valid list",
                             "input": input_repr(value)}])
    string_error = {"type": "string_type", "loc": "body.input", "msg": "Input should be a valid string",
                    "input": input_repr(value)}
    for i, item in enumerate(value):
        problem = _item_problem(item, f"body.input.{i}.EasyInputMessageParam")
        if problem is not None:
            kind, loc, msg, shown = problem
            lines = [string_error, {"type": kind, "loc": loc, "msg": msg, "input": input_repr(shown)}]
            raise ApiError(400, "2 validation errors:\n  " + "\n  ".join(repr(e) for e in lines), "body.input",
                           "Bad Request")


def _item_problem(item: object, base: str) -> tuple[str, str, str, object] | None:
    if not isinstance(item, dict):
        return "dict_type", base, "Input should be a valid dictionary", item
    kind = item.get("type", "message")
    if kind == "function_call":
        missing = [k for k in ("arguments", "call_id", "name") if not isinstance(item.get(k), str)]
    elif kind in ("function_call_output", "custom_tool_call_output"):
        missing = [k for k in ("call_id", "output") if k not in item]
    elif kind in ("reasoning", "custom_tool_call") or kind in _UNSUPPORTED_ITEMS:
        missing = []
    elif kind == "message":
        if "content" not in item:
            return "missing", f"{base}.content", "Field required", item
        if "role" not in item:
            return "missing", f"{base}.role", "Field required", item
        if item["role"] not in _ROLES:
            return "literal_error", f"{base}.role", "Input should be 'user', 'assistant', 'system' or 'developer'", \
                item["role"]
        if not isinstance(item["content"], str | list):
            return "string_type", f"{base}.content", "Input should be a valid string", item["content"]
        missing = []
    else:
        return "literal_error", f"{base}.type", "Input should be 'message'", kind
    return ("missing", f"{base}.{missing[0]}", "Field required", item) if missing else None


def _part(part: object) -> object:
    """A Responses content part as the simulator's chat renderer reads parts."""
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind == "input_image":
        return {"type": "image_url", "image_url": {"url": part.get("image_url") or part.get("file_id")}}
    if kind == "input_file":
        return {"type": "file", "file": part}
    if kind == "output_text":
        return {"type": "text", "text": part.get("text")}
    return part


def _first_text(content: object) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    arguments = item.get("arguments") if item.get("type") == "function_call" else item.get("input") or ""
    return {"id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": arguments}}


def input_messages(instructions: str | None, value: str | list[Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM renders for the input (``construct_input_messages``)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    for item in value:
        kind = item.get("type", "message")
        prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        if kind in ("function_call", "custom_tool_call"):
            if prev is not None:
                prev.setdefault("tool_calls", []).append(_tool_call(item))
            else:
                messages.append({"role": "assistant", "tool_calls": [_tool_call(item)]})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise bad("Encrypted content is not supported.", "input")
            if prev is None or "reasoning" in prev:  # the simulator's template does not render reasoning
                messages.append({"role": "assistant", "reasoning": ""})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
        elif kind in _UNSUPPORTED_ITEMS:
            raise bad(f"Unsupported input item type: {kind}", "input")
        elif item.get("role") == "assistant":
            text = _first_text(item.get("content"))
            if text is None:
                continue
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
            else:
                messages.append({"role": "assistant", "content": text})
        else:
            content = item.get("content")
            messages.append({"role": item["role"],
                             "content": [_part(p) for p in content] if isinstance(content, list) else content})
    return messages


def continues_final(value: str | list[Any]) -> bool:
    """Whether the last input item is a partial assistant message (or reasoning) to go on with."""
    if isinstance(value, str) or not value:
        return False
    last = value[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
        "in_progress", "incomplete")


def chat_tools(tools: list[Any]) -> list[dict[str, Any]] | None:
    """Function tools in the chat shape the template renders."""
    out = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
           for t in tools if isinstance(t, dict) and t.get("type") == "function"]
    return out or None
