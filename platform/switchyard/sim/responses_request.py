"""``POST /v1/responses`` requests: validated in vLLM 0.32's order, with its errors, and rendered as a chat.

vLLM checks a Responses request in this order, and so does this module: its model validators, which run
on the raw body before any field is read and, unlike pydantic's own errors, answer with vLLM's message
and the parameter (``tool_choice`` without ``tools``, ``custom`` tools with a grammar, ``prompt``,
``background`` without ``store``, ``cache_salt``); the field types (pydantic, lax mode; only the first
error is reported); the model name (404); ``background`` (refused: vLLM keeps no responses unless
started with ``VLLM_ENABLE_RESPONSES_API_STORE``, and neither does the simulator); ``previous_response_id``
(always 404, for the same reason); rendering (``max_output_tokens`` against the context window, an empty
conversation, the prompt's length); then the sampling parameters.

The input is rendered as a chat (``responses_input.py``) and tokenized, as vLLM does here, with special tokens:
a Llama-3 template's BOS comes twice. ``store`` is accepted and ignored, as by vLLM.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from switchyard.sim.protocol import MAX_LOGPROBS, GenerationSpec, check_context
from switchyard.sim.responses_input import chat_tools, check_input, continues_final, input_messages
from switchyard.sim.validation import (
    ApiError,
    Fields,
    bad,
    input_repr,
    invalid,
    lax_bool,
    lax_float,
    lax_int,
    strict_str,
)
from switchyard.simtext.chat import ChatFormatError, render_chat
from switchyard.simtext.tokens import SPECIAL_TOKENS

_BOS = SPECIAL_TOKENS["<|begin_of_text|>"]
_INT64 = 2**63 - 1
_INCLUDE = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
            "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content")
_SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
_NO_TOOL = "Tool choice 'function' not found in 'tools' parameter."
_NO_STORE = ("This vLLM engine does not support `store=True` and therefore does not support the background mode. "
             "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
             "launching the vLLM server.")
#: The keys pydantic writes for a ``reasoning`` object (openai's ``Reasoning``), in its order.
_REASONING_KEYS = ("context", "effort", "generate_summary", "mode", "summary")
_FUNCTION_TOOL_KEYS = ("name", "parameters", "strict", "type", "allowed_callers", "async", "defer_loading",
                       "description", "output_schema")


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated Responses request.

    Attributes:
        spec: The generation it asks for (a chat of one prompt, one choice).
        response_id: The response's id (the body's ``request_id``, else ``resp_`` and 16 hex digits).
        echo: The request's fields as the response object repeats them, in its key order (from
            ``instructions`` to ``frequency_penalty``; the response's own fields are filled in later).
        top_logprobs: Alternatives per token when log-probabilities are included.
    """

    spec: GenerationSpec
    response_id: str
    echo: dict[str, Any]
    top_logprobs: int


def not_found(response_id: str) -> ApiError:
    """vLLM's answer for a response it does not hold (none, without a store)."""
    return ApiError(404, f"Response with id '{response_id}' not found.", "response_id", "invalid_request_error")


def _bound(kind: str, loc: str, value: object, limit: float) -> ApiError:
    """pydantic's ``ge``/``le`` error (its ``ctx`` holds the limit as a number, which ``invalid`` cannot)."""
    word, key = ("greater", "ge") if kind == "greater_than_equal" else ("less", "le")
    shown = int(limit) if float(limit).is_integer() else limit
    error = {"type": kind, "loc": loc, "msg": f"Input should be {word} than or equal to {shown}",
             "input": input_repr(value), "ctx": {key: limit}}
    return ApiError(400, f"1 validation error:\n  {error!r}", loc, "Bad Request")


def _literal(value: object, loc: str, allowed: tuple[str, ...]) -> str:
    if value in allowed:
        return str(value)
    quoted = [f"'{a}'" for a in allowed]
    expected = ", ".join(quoted[:-1]) + " or " + quoted[-1] if len(quoted) > 1 else quoted[0]
    raise invalid("literal_error", loc, f"Input should be {expected}", value, {"expected": expected})


def _before_validators(body: dict[str, Any]) -> None:
    """vLLM's ``mode="before"`` model validators, last defined first (as pydantic runs them)."""
    tools = body.get("tools")
    has_tools = isinstance(tools, list | dict | str) and len(tools) > 0
    choice = body.get("tool_choice", "auto")
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not has_tools:
        if choice in ("auto", "none"):
            body["tool_choice"] = "none"
        elif choice == "required":
            raise bad("Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice")
        elif named:
            raise bad(_NO_TOOL, "tool_choice")
    elif named and isinstance(tools, list):
        names = {t.get("name") for t in tools if isinstance(t, dict)}
        if not choice.get("name") or choice.get("name") not in names:
            raise bad(_NO_TOOL, "tool_choice")
    for tool in tools if isinstance(tools, list) else ():
        fmt = tool.get("format") if isinstance(tool, dict) else None
        if tool.get("type") == "custom" and isinstance(fmt, dict) and fmt.get("type") == "grammar":
            raise bad("Custom tools with a grammar format are not supported; only free-form text custom tools "
                      "are accepted.", "tools")
    if body.get("prompt") is not None:
        raise bad("prompt template is not supported", "prompt")
    if body.get("background") and not body.get("store", True):
        raise bad("background can only be used when `store` is true", "background")
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise bad("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
        if len(salt) > 128 or any(c in "@/\\\x00" for c in salt):
            raise bad("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
                      "'\\\\', or NUL.", "cache_salt")
    if body.get("return_mm_kwargs") is False and "mm_payload" not in body:
        body["mm_payload"] = "none"


def _opt(body: dict[str, Any], key: str, read: Any, *, nullable: bool = True, default: Any = None) -> Any:
    """A field read with ``read(value, loc)``; null is the default where the type allows it."""
    if key not in body:
        return default
    value = body[key]
    if value is None:
        if nullable:
            return default
        kinds = {lax_bool: ("bool_type", "Input should be a valid boolean"),
                 strict_str: ("string_type", "Input should be a valid string")}
        kind, msg = kinds.get(read, ("int_type", "Input should be a valid integer"))
        raise invalid(kind, f"body.{key}", msg, value)
    return read(value, f"body.{key}")


def _int_in(value: object, loc: str) -> int:
    number = lax_int(value, loc)
    if number > _INT64:
        raise _bound("less_than_equal", loc, value, _INT64)
    if number < -_INT64 - 1:
        raise _bound("greater_than_equal", loc, value, -_INT64 - 1)
    return number


def _penalty(value: object, loc: str) -> float:
    number = lax_float(value, loc)
    if number < -2.0:
        raise _bound("greater_than_equal", loc, value, -2.0)
    if number > 2.0:
        raise _bound("less_than_equal", loc, value, 2.0)
    return number


def _metadata(value: object, loc: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise invalid("dict_type", loc, "Input should be a valid dictionary", value)
    for key, item in value.items():
        strict_str(item, f"{loc}.{key}")
    return value


def _include(value: object, loc: str) -> list[str]:
    if not isinstance(value, list):
        raise invalid("list_type", loc, "Input should be a valid list", value)
    return [_literal(v, f"{loc}.{i}", _INCLUDE) for i, v in enumerate(value)]


def _tools(value: object, loc: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid("list_type", loc, "Input should be a valid list", value)
    for i, tool in enumerate(value):
        if isinstance(tool, dict) and tool.get("type") == "function" and not isinstance(tool.get("name"), str):
            raise invalid("missing", f"{loc}.{i}.FunctionTool.name", "Field required", tool)
    return value


def _read_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The fields used, type-checked in the order ``ResponsesRequest`` declares them."""
    f = Fields(body)
    out: dict[str, Any] = {"background": _opt(body, "background", lax_bool, default=False),
                           "include": _opt(body, "include", _include, default=[])}
    if "input" not in body:
        raise invalid("missing", "body.input", "Field required", body)
    check_input(body["input"])
    out["instructions"] = f.get_str("instructions")
    out["max_output_tokens"] = f.get_int("max_output_tokens")
    out["max_tool_calls"] = f.get_int("max_tool_calls")
    out["metadata"] = _opt(body, "metadata", _metadata)
    out["model"] = f.get_str("model")
    out["parallel_tool_calls"] = _opt(body, "parallel_tool_calls", lax_bool, default=True)
    out["previous_response_id"] = f.get_str("previous_response_id")
    _opt(body, "include_reasoning", lax_bool, nullable=False)
    out["service_tier"] = _literal(body.get("service_tier", "auto"), "body.service_tier", _SERVICE_TIERS)
    # Left out, store defaults to true; null is falsy (vLLM's ``bool | None``).
    out["store"] = _opt(body, "store", lax_bool, default="store" not in body)
    out["stream"] = f.get_bool("stream")
    out["temperature"] = f.get_float("temperature")
    out["tools"] = _opt(body, "tools", _tools, nullable=False, default=[])
    out["top_logprobs"] = _opt(body, "top_logprobs", lax_int, default=0)
    out["top_p"] = f.get_float("top_p")
    out["top_k"] = f.get_int("top_k")
    out["min_p"] = f.get_float("min_p")
    truncation = body.get("truncation", "disabled")
    out["truncation"] = None if truncation is None else _literal(truncation, "body.truncation", ("auto", "disabled"))
    out["user"] = f.get_str("user")
    for key in ("skip_special_tokens", "include_stop_str_in_output"):
        _opt(body, key, lax_bool, nullable=False)
    out["presence_penalty"] = _opt(body, "presence_penalty", _penalty)
    out["frequency_penalty"] = _opt(body, "frequency_penalty", _penalty)
    f.get_str("prompt_cache_key")
    out["request_id"] = _opt(body, "request_id", strict_str, nullable=False)
    f.get_str("session_id")
    out["priority"] = _opt(body, "priority", _int_in, nullable=False, default=0)
    out["cache_salt"] = f.get_str("cache_salt")
    out["previous_input_messages"] = body.get("previous_input_messages")
    out["repetition_penalty"] = f.get_float("repetition_penalty")
    out["seed"] = _opt(body, "seed", _int_in)
    out["stop"] = f.stop()
    out["ignore_eos"] = _opt(body, "ignore_eos", lax_bool, nullable=False, default=False)
    return out


def _echo_tool(tool: object) -> object:
    if isinstance(tool, dict) and tool.get("type") == "function":
        return {k: tool.get(k) for k in _FUNCTION_TOOL_KEYS}
    return tool


def _echo_text(text: object) -> object:
    if not isinstance(text, dict):
        return text
    fmt = text.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt = {"name": fmt.get("name"), "schema": fmt.get("schema"), "type": "json_schema",
               "description": fmt.get("description"), "strict": fmt.get("strict")}
    return {"format": fmt, "verbosity": text.get("verbosity")}


def _check_sampling(fields: dict[str, Any], max_tokens: int) -> tuple[float, float]:
    """``SamplingParams`` validation, in its order; the temperature and top_p used."""
    repetition = fields["repetition_penalty"]
    if repetition is not None and not math.isfinite(repetition):
        raise bad(f"repetition_penalty must be a finite number, got {repetition}.", None)
    if repetition is not None and repetition <= 0.0:
        raise bad(f"repetition_penalty must be greater than zero, got {repetition}.", None)
    t = 1.0 if fields["temperature"] is None else fields["temperature"]
    if not math.isfinite(t):
        raise bad(f"temperature must be a finite number, got {t}.", "temperature", t)
    if t < 0:
        raise bad(f"temperature must be non-negative, got {t}.", "temperature", t)
    if t > 2:
        raise bad(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    top_p = 1.0 if fields["top_p"] is None else fields["top_p"]
    if not 0.0 < top_p <= 1.0:
        raise bad(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    if fields["top_k"] is not None and fields["top_k"] < -1:
        raise bad(f"top_k must be 0 (disable), or at least 1, got {fields['top_k']}.", None)
    if fields["min_p"] is not None and not 0.0 <= fields["min_p"] <= 1.0:
        raise bad(f"min_p must be in [0, 1], got {fields['min_p']}.", None)
    if max_tokens < 1:
        raise bad(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if fields["include_logprobs"] and fields["top_logprobs"] < 0:
        raise bad(f"logprobs must be non-negative or -1, got {fields['top_logprobs']}.", "logprobs",
                  fields["top_logprobs"])
    if any(not s for s in fields["stop"]):
        raise bad("stop cannot contain an empty string.", None)
    return t, top_p


def parse_responses(raw: dict[str, Any], *, served_model: str, max_model_len: int) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body and render its prompt.

    Args:
        raw: The decoded request body.
        served_model: The only model name accepted (a request may leave ``model`` out).
        max_model_len: The context window.

    Raises:
        ApiError: 400 for a malformed request, 404 for an unknown model or a previous response.
    """
    body = dict(raw)
    _before_validators(body)
    fields = _read_fields(body)
    fields["include_logprobs"] = "message.output_text.logprobs" in fields["include"]
    if fields["model"] is not None and fields["model"] != served_model:
        raise ApiError(404, f"The model `{fields['model']}` does not exist. Valid aliases: {served_model}.", "model")
    if fields["store"] and fields["background"]:
        raise ApiError(400, _NO_STORE, "background", "invalid_request_error")
    if fields["previous_input_messages"] and fields["previous_response_id"]:
        raise ApiError(400, "Only one of `previous_input_messages` and `previous_response_id` can be set.",
                       "previous_response_id", "invalid_request_error")
    if fields["previous_response_id"] is not None:
        raise not_found(fields["previous_response_id"])

    messages = input_messages(fields["instructions"], body["input"])
    max_output = fields["max_output_tokens"]
    if max_output is not None and max_output > max_model_len:
        raise bad(f"max_output_tokens={max_output} cannot be greater than max_model_len={max_model_len}. "
                  f"Please request fewer output tokens.", "max_output_tokens", max_output)
    if not messages:
        raise bad("Cannot apply chat template to an empty conversation. Provide at least one message.", None)
    continues = continues_final(body["input"])
    try:
        # vLLM tokenizes the rendered chat with special tokens here (chat completions without): the template's
        # BOS gets another before it.
        prompt = [_BOS, *render_chat(messages, chat_tools(fields["tools"]), None, not continues, continues)]
    except ChatFormatError as exc:
        raise bad(str(exc), None) from None
    check_context(len(prompt), max_model_len, from_text=True)
    if len(prompt) >= max_model_len:
        raise ApiError(400, f"The engine prompt length {len(prompt)} exceeds the max_model_len {max_model_len}. "
                            "Please reduce prompt.", "input", "invalid_request_error")
    room = max_model_len - len(prompt)
    max_tokens = room if max_output is None else min(max_output, room)
    temperature, top_p = _check_sampling(fields, max_tokens)
    top = fields["top_logprobs"]
    logprobs = top if fields["include_logprobs"] else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise bad(f"Requested sample logprobs of {logprobs}, which is greater than max allowed: {MAX_LOGPROBS}",
                  "logprobs", logprobs)

    spec = GenerationSpec(
        chat=True, prompts=[prompt], max_tokens=max_output, min_tokens=0, stream=fields["stream"],
        include_usage=False, priority=fields["priority"], seed=fields["seed"], cache_salt=fields["cache_salt"],
        ignore_eos=fields["ignore_eos"], logprobs=logprobs, stop=fields["stop"], continues=continues)
    reasoning = body.get("reasoning")
    echo = {
        "instructions": fields["instructions"], "metadata": fields["metadata"],
        "parallel_tool_calls": fields["parallel_tool_calls"], "temperature": temperature,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": [_echo_tool(t) for t in fields["tools"]], "top_p": top_p, "background": fields["background"],
        "max_output_tokens": max_tokens, "max_tool_calls": fields["max_tool_calls"],
        "previous_response_id": None, "prompt": None,
        "reasoning": {k: reasoning.get(k) for k in _REASONING_KEYS} if isinstance(reasoning, dict) else None,
        "service_tier": fields["service_tier"], "text": _echo_text(body.get("text")), "top_logprobs": logprobs,
        "truncation": fields["truncation"], "user": fields["user"],
        "presence_penalty": fields["presence_penalty"] or 0.0, "frequency_penalty": fields["frequency_penalty"] or 0.0,
    }
    return ResponsesRequest(spec=spec, response_id=fields["request_id"] or f"resp_{uuid.uuid4().hex[:16]}",
                            echo=echo, top_logprobs=top)
