"""Parsing and validating OpenAI-style generation requests, with vLLM's error messages.

Bodies are decoded with msgspec into plain JSON values and checked field by field (the
``prompt`` union of string / strings / token ids / lists of token ids does not map onto a
typed schema). Every client mistake becomes an ``ApiError`` (400/404) with the message a
vLLM server gives for it; nothing a client sends can produce a 500.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from switchyard.sim.chat import ChatFormatError, render_chat
from switchyard.sim.tokens import SPECIAL_TOKENS, token_hash, tokenize

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed",
                500: "InternalServerError", 503: "ServiceUnavailableError"}
_BOS = SPECIAL_TOKENS["<|begin_of_text|>"]
#: Bounds of the output length a request without ``max_tokens`` gets.
NATURAL_MIN, NATURAL_MAX = 16, 256


class ApiError(Exception):
    """An error answered in vLLM's shape: ``{"error": {message, type, param, code}}``.

    Args:
        status: HTTP status code (also the ``code`` field, as vLLM does).
        message: Human-readable message.
        param: The offending parameter, if any.
        err_type: Error type; defaults from the status (``BadRequestError`` for 400, …).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _ERROR_TYPES.get(status, "InternalServerError")

    def body(self) -> bytes:
        """The JSON error body."""
        return msgspec.json.encode({"error": {"message": self.message, "type": self.err_type,
                                              "param": self.param, "code": self.status}})


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _int(body: dict[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key}: Input should be a valid integer, got {value!r}", key)
    return value


def _float(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{key}: Input should be a valid number, got {value!r}", key)
    return float(value)


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{key}: Input should be a valid boolean, got {value!r}", key)
    return value


@dataclass(frozen=True)
class GenerationSpec:
    """A validated generation request.

    Attributes:
        chat: Chat completion (True) or text completion (False).
        prompts: Token ids of each prompt (one choice per prompt; chat has one).
        max_tokens: Requested output length, or None for a natural length.
        min_tokens: Minimum output length.
        stream: Server-sent events.
        include_usage: ``stream_options.include_usage``.
        priority: vLLM priority (lower first).
        seed: Request seed, if any.
        cache_salt: Prefix-cache salt, if any.
    """

    chat: bool
    prompts: list[list[int]]
    max_tokens: int | None
    min_tokens: int
    stream: bool
    include_usage: bool
    priority: int
    seed: int | None
    cache_salt: str | None


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        ApiError: Not JSON, or not an object.
    """
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise _bad(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise _bad("Input should be a valid dictionary or object to extract fields from")
    return body


def parse_generation(body: dict[str, Any], *, chat: bool, served_model: str,
                     vocab_size: int) -> GenerationSpec:
    """Validate a chat or completion request body and render its prompt(s) to token ids.

    Raises:
        ApiError: 400 for a malformed request, 404 for an unknown model.
    """
    key = "messages" if chat else "prompt"
    if key not in body:
        raise _bad(f"1 validation error: {key}: Field required", key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model: Input should be a valid string", "model")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
        if not isinstance(options, dict):
            raise _bad("stream_options: Input should be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    max_tokens = _int(body, "max_completion_tokens", None) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None)
    min_tokens = _int(body, "min_tokens", 0) or 0
    n = _int(body, "n", 1)
    temperature = _float(body, "temperature")
    top_p = _float(body, "top_p")
    seed = _int(body, "seed", None)
    priority = _int(body, "priority", 0) or 0
    _bool(body, "ignore_eos")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("stop: Input should be a string or a list of strings", "stop")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user: Input should be a valid string", "user")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _bad("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")

    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")

    if n != 1:
        raise _bad(f"The simulator supports only n=1 (got n={n}); send separate requests "
                   "for more choices.", "n")
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if min_tokens < 0:
        raise _bad(f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
                   "min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise _bad(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                   f"got {min_tokens}.", "min_tokens")
    if temperature is not None and temperature < 0:
        raise _bad(f"temperature must be non-negative, got {temperature}.", "temperature")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {top_p}.", "top_p")

    if chat:
        add_gen = body.get("add_generation_prompt", True)
        try:
            prompts = [render_chat(body["messages"], body.get("tools"),
                                   body.get("response_format"), add_gen is not False)]
        except ChatFormatError as exc:
            raise _bad(str(exc), "messages") from None
    else:
        prompts = _completion_prompts(body["prompt"], vocab_size)
    return GenerationSpec(chat=chat, prompts=prompts, max_tokens=max_tokens,
                          min_tokens=min_tokens, stream=stream, include_usage=include_usage,
                          priority=priority, seed=seed, cache_salt=salt)


def _completion_prompts(prompt: object, vocab_size: int) -> list[list[int]]:
    empty = _bad("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if isinstance(prompt, str):
        return [[_BOS, *tokenize(prompt)]]
    if not isinstance(prompt, list) or not prompt:
        raise empty
    if all(isinstance(p, str) for p in prompt):
        return [[_BOS, *tokenize(p)] for p in prompt]
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [_check_ids(prompt, vocab_size)]
    if all(isinstance(p, list) for p in prompt):
        out: list[list[int]] = []
        for p in prompt:
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise empty if not p else _bad(
                    "prompt: expected a string, a list of strings, a list of token ids or a "
                    "list of lists of token ids", "prompt")
            out.append(_check_ids(p, vocab_size))
        return out
    raise _bad("prompt: expected a string, a list of strings, a list of token ids or a list of "
               "lists of token ids", "prompt")


def _check_ids(ids: list[int], vocab_size: int) -> list[int]:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise _bad(f"Token id {t} is out of vocabulary", "prompt")
    return ids


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's input-length validation (``OpenAIServing._validate_input``).

    Raises:
        ApiError: 400 with vLLM's message when the prompt (plus ``max_tokens``) is too long.
    """
    if prompt_len >= max_model_len:
        raise _bad(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input "
            f"messages. (parameter=input_tokens, value={prompt_len})", "input_tokens")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise _bad(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {max_model_len} tokens and your request has "
            f"{prompt_len} input tokens ({max_tokens} > {max_model_len} - {prompt_len}). "
            f"(parameter=max_tokens, value={max_tokens})", "max_tokens")


def plan_output(spec: GenerationSpec, prompt: list[int], max_model_len: int,
                engine_seed: int) -> tuple[int, str, int]:
    """How many tokens a prompt generates, the finish reason, and the text seed.

    With ``max_tokens`` the output is exactly that long (finish reason "length"): that is how
    a trace replays an exact output length. Without it, the length is a deterministic
    function of the seed and prompt in [16, 256] (finish reason "stop"), raised to
    ``min_tokens`` and capped by the context window (then "length", as vLLM reports it).
    """
    seed = token_hash(prompt) ^ (engine_seed * 0x9E3779B1) ^ ((spec.seed or 0) << 17)
    room = max_model_len - len(prompt)
    if spec.max_tokens is not None:
        return spec.max_tokens, "length", seed
    natural = max(NATURAL_MIN + seed % (NATURAL_MAX - NATURAL_MIN + 1), spec.min_tokens)
    if natural >= room:
        return room, "length", seed
    return natural, "stop", seed
