"""Parsing and validating OpenAI-style generation requests, in vLLM's order and with its errors.

The checks run in the order vLLM 0.32's OpenAI server runs them, so a request with several
mistakes gets the same answer from both: chat's ``continue_final_message`` with
``add_generation_prompt`` (a model validator that runs before any field is read), the body's field
types (pydantic, lax mode), the
request validators (``stream_options``, ``cache_salt``, a missing prompt), the model name
(404), ``max_tokens`` against the context window, rendering the prompt, the prompt's length,
then the sampling parameters (``n``, ``temperature``, ``top_p``, the output budget,
``min_tokens``) and the token ids. Every client mistake becomes an ``ApiError`` (400/404);
nothing a client sends can produce a 500.

Output budgets are vLLM's: ``max_tokens`` larger than the context window is refused, a budget
that does not fit after the prompt is cut to what fits (the request then ends with ``length``),
and a prompt that leaves no room at all is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from switchyard.sim.validation import (
    ApiError,
    Fields,
    bad,
    decode_body,
    invalid,
    lax_bool,
    lax_int,
)
from switchyard.simtext.chat import ChatFormatError, render_chat
from switchyard.simtext.tokens import SPECIAL_TOKENS, VOCAB_TEXT, filler_ids, token_hash, tokenize

__all__ = ["ApiError", "GenerationSpec", "check_context", "decode_body", "parse_generation",
           "plan_output"]

_BOS = SPECIAL_TOKENS["<|begin_of_text|>"]
#: Bounds of the output length a request without ``max_tokens`` gets.
NATURAL_MIN, NATURAL_MAX = 16, 256
#: vLLM's default ``--max-logprobs``.
MAX_LOGPROBS = 20
_DEVELOPER = "ChatCompletionDeveloperMessageParam"  # the first member of vLLM's message union


@dataclass(frozen=True)
class GenerationSpec:
    """A validated generation request.

    Attributes:
        chat: Chat completion (True) or text completion (False).
        prompts: Token ids of each prompt (chat has one); each gets ``n`` choices.
        max_tokens: Requested output length, or None (then up to the context window).
        min_tokens: Minimum output length.
        stream: Server-sent events.
        include_usage: ``stream_options.include_usage``.
        priority: vLLM priority (lower first).
        seed: Request seed, if any.
        cache_salt: Prefix-cache salt, if any.
        n: Choices per prompt.
        ignore_eos: Never stop before the output budget.
        continuous_usage: ``stream_options.continuous_usage_stats`` (usage in every chunk).
        logprobs: Top log-probabilities per token (completions' ``logprobs``, chat's
            ``top_logprobs`` when ``logprobs`` is true), or None for no log-probabilities.
        role: Role of a chat answer (the last message's when ``add_generation_prompt`` is false).
        stop: Stop strings: the output ends where its text first contains one.
        continues: The answer continues the chat's final message (``continue_final_message``): its
            text goes on mid-sentence instead of starting one.
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
    n: int = 1
    ignore_eos: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None
    role: str = "assistant"
    stop: tuple[str, ...] = ()
    continues: bool = False


@dataclass(frozen=True)
class _Fields:
    """The request's fields after type validation."""

    model: str | None
    max_tokens: int | None
    max_tokens_param: str
    min_tokens: int
    n: int
    temperature: float | None
    top_p: float | None
    seed: int | None
    priority: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    ignore_eos: bool
    logprobs: int | None
    cache_salt: str | None
    stop: tuple[str, ...]


def _read_fields(body: dict[str, Any], chat: bool) -> _Fields:
    f = Fields(body)
    model = f.get_str("model")
    # Chat's logprobs is a flag with top_logprobs beside it; a completion's is the count.
    wants_logprobs = f.get_bool("logprobs") if chat else False
    top = f.get_int("top_logprobs" if chat else "logprobs")
    max_tokens = f.get_int("max_tokens")
    max_completion = f.get_int("max_completion_tokens") if chat else None
    n = f.get_int("n")
    seed = f.get_int("seed")
    stop = f.stop()
    stream = f.get_bool("stream")
    options = f.options("stream_options") or {}
    include_usage = _option(options, "include_usage")
    continuous = _option(options, "continuous_usage_stats")
    temperature = f.get_float("temperature")
    top_p = f.get_float("top_p")
    f.get_str("user")
    ignore_eos = f.get_bool("ignore_eos")
    min_tokens = f.get_int("min_tokens")
    priority = f.get_int("priority")
    if chat:
        f.get_bool("add_generation_prompt", True)
        f.get_bool("continue_final_message")

    # Request validators (vLLM's own messages, after the field types are known to be right).
    if body.get("stream_options") is not None and not stream:
        raise bad("Stream options can only be defined when `stream=True`.", "stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    logprobs = top
    if chat:
        if top is not None and not wants_logprobs:
            raise bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        logprobs = (top or 0) if wants_logprobs else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise bad(f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
                  f"{MAX_LOGPROBS}", name, logprobs)
    if not chat and body.get("prompt") in (None, ""):
        raise bad("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    return _Fields(
        model=model, max_tokens=max_completion if max_completion is not None else max_tokens,
        max_tokens_param="max_completion_tokens" if max_completion is not None else "max_tokens",
        min_tokens=min_tokens or 0, n=1 if n is None else n, temperature=temperature, top_p=top_p,
        seed=seed, priority=priority or 0, stream=stream, include_usage=include_usage,
        continuous_usage=continuous, ignore_eos=ignore_eos, logprobs=logprobs,
        cache_salt=salt if isinstance(salt, str) else None, stop=stop)


def _option(options: dict[str, Any], key: str) -> bool:
    value = options.get(key)
    return False if value is None else lax_bool(value, f"body.stream_options.{key}")


def check_messages(messages: object) -> list[Any]:
    """The type checks pydantic applies to ``messages`` (first error only)."""
    if not isinstance(messages, list):
        raise invalid("list_type", "body.messages", "Input should be a valid list", messages)
    for i, message in enumerate(messages):
        base = f"body.messages.{i}.{_DEVELOPER}"
        if not isinstance(message, dict):
            raise invalid("dict_type", base, "Input should be a valid dictionary", message)
        role = message.get("role")
        if not isinstance(role, str) and "content" not in message:
            raise invalid("missing", f"{base}.content", "Field required", message)
        if "role" not in message:
            raise invalid("missing", f"{base}.role", "Field required", message)
        if not isinstance(role, str):
            raise invalid("literal_error", f"{base}.role", "Input should be 'developer'", role,
                          {"expected": "'developer'"})
        content = message.get("content")
        if "content" in message and not isinstance(content, str | list) and not (
                content is None and role == "assistant"):
            raise invalid("string_type", f"{base}.content", "Input should be a valid string", content)
    return messages


def _int_like(value: object) -> bool:
    try:
        lax_int(value, "")
    except ApiError:
        return False
    return True


def _check_prompt_types(prompt: object) -> None:
    """The type checks pydantic applies to ``prompt``: a string, strings, token ids or lists of
    token ids; a mismatch is reported by the token-id branch of the union, as pydantic does."""
    if prompt is None or isinstance(prompt, str):
        return
    if not isinstance(prompt, list):
        raise invalid("list_type", "body.prompt", "Input should be a valid list", prompt)
    if all(isinstance(p, str) for p in prompt):
        return
    if prompt and all(isinstance(p, list) and all(_int_like(t) for t in p) for p in prompt):
        return
    for i, t in enumerate(prompt):
        if isinstance(t, list | dict) or t is None:
            raise invalid("int_type", f"body.prompt.{i}", "Input should be a valid integer", t)
        lax_int(t, f"body.prompt.{i}")


def _ids(values: list[Any]) -> list[int]:
    return [lax_int(t, "body.prompt") for t in values]


def _render_completion(prompt: object) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether they came from text."""
    if isinstance(prompt, str):
        return [[_BOS, *tokenize(prompt)]], True
    assert isinstance(prompt, list)
    if not prompt:
        raise bad("You must pass at least one prompt", None)
    if all(isinstance(p, str) for p in prompt):
        return [[_BOS, *tokenize(p)] for p in prompt], True
    if all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise bad("The decoder prompt cannot be empty", None)
        return [_ids(p) for p in prompt], False
    return [_ids(prompt)], False


def check_context(prompt_len: int, max_model_len: int, from_text: bool = False) -> None:
    """vLLM's prompt-length check: a prompt longer than the context window is refused.

    Text is tokenized with truncation one token past the window, so vLLM can only say the
    prompt has "at least" that many tokens; token ids are counted exactly.

    Raises:
        ApiError: 400 with vLLM's message and ``param`` "input_tokens".
    """
    if prompt_len <= max_model_len:
        return
    count = min(prompt_len, max_model_len + 1) if from_text else prompt_len
    qualifier = "at least " if count == max_model_len + 1 else ""
    raise bad(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
              f"contains {qualifier}{count} input tokens, which exceeds this limit even without any "
              f"output tokens. Please reduce the length of the input prompt.", "input_tokens", count)


def _check_sampling(fields: _Fields, prompt_len: int, max_model_len: int) -> None:
    """``SamplingParams`` validation, in its order, for one prompt."""
    if fields.n < 1:
        raise bad(f"n must be at least 1, got {fields.n}.", None)
    t = fields.temperature
    if t is not None:
        if t != t or t in (float("inf"), float("-inf")):
            raise bad(f"temperature must be a finite number, got {t}.", "temperature", t)
        if t < 0:
            raise bad(f"temperature must be non-negative, got {t}.", "temperature", t)
        if t > 2:
            raise bad(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    if fields.top_p is not None and not 0.0 < fields.top_p <= 1.0:
        raise bad(f"top_p must be in (0, 1], got {fields.top_p}.", "top_p", fields.top_p)
    room = max_model_len - prompt_len
    budget = room if fields.max_tokens is None else min(room, fields.max_tokens)
    if budget < 1:
        raise bad(f"max_tokens must be at least 1, got {budget}.", "max_tokens", budget)
    if fields.min_tokens < 0:
        raise bad(f"min_tokens must be greater than or equal to 0, got {fields.min_tokens}.", None)
    if fields.min_tokens > budget:
        raise bad(f"min_tokens must be less than or equal to max_tokens={budget}, "
                  f"got {fields.min_tokens}.", None)
    if any(not s for s in fields.stop):
        raise bad("stop cannot contain an empty string.", None)


def parse_generation(body: dict[str, Any], *, chat: bool, served_model: str, vocab_size: int,
                     max_model_len: int) -> GenerationSpec:
    """Validate a chat or completion request body and render its prompt(s) to token ids.

    Args:
        body: The decoded request body.
        chat: A chat completion (else a text completion).
        served_model: The only model name accepted (a request may leave ``model`` out).
        vocab_size: Token ids accepted in a prompt are ``0 <= id < vocab_size``.
        max_model_len: The context window.

    Raises:
        ApiError: 400 for a malformed request, 404 for an unknown model.
    """
    if chat:
        # vLLM's check_generation_prompt, a "before" model validator: it reads the raw values (any truthy
        # pair, before a field is validated) and runs ahead of every check but FastAPI's JSON decoding.
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise bad("Cannot set both `continue_final_message` and `add_generation_prompt` to True.", None)
        if "messages" not in body:
            raise invalid("missing", "body.messages", "Field required", body)
        messages = check_messages(body["messages"])
    else:
        _check_prompt_types(body.get("prompt"))
    fields = _read_fields(body, chat)

    if fields.model is not None and fields.model != served_model:
        raise ApiError(404, f"The model `{fields.model}` does not exist. Valid aliases: {served_model}.",
                       "model")
    if fields.max_tokens is not None and fields.max_tokens > max_model_len:
        name = fields.max_tokens_param
        raise bad(f"{name}={fields.max_tokens} cannot be greater than max_model_len={max_model_len}. "
                  f"Please request fewer output tokens.", name, fields.max_tokens)

    role = "assistant"
    continues = False
    if chat:
        if not messages:
            raise bad("Cannot apply chat template to an empty conversation. Provide at least one "
                      "message.", None)
        add_gen = body.get("add_generation_prompt")
        add_gen = True if add_gen is None else lax_bool(add_gen, "body.add_generation_prompt")
        continue_final = body.get("continue_final_message")
        continues = continue_final is not None and lax_bool(continue_final, "body.continue_final_message")
        try:
            # With add_generation_prompt left at its default, the template refuses continue_final_message
            # (vLLM answers its words as a 400).
            prompts = [render_chat(messages, body.get("tools"), body.get("response_format"), add_gen, continues)]
        except ChatFormatError as exc:
            raise bad(str(exc), None) from None
        from_text = True
        if not add_gen:
            role = messages[-1]["role"]
    else:
        prompts, from_text = _render_completion(body["prompt"])

    for prompt in prompts:
        check_context(len(prompt), max_model_len, from_text)
        _check_sampling(fields, len(prompt), max_model_len)
        for t in prompt:
            if not 0 <= t < vocab_size:
                raise bad(f"Token id {t} is out of vocabulary", None)
    return GenerationSpec(
        chat=chat, prompts=prompts, max_tokens=fields.max_tokens, min_tokens=fields.min_tokens,
        stream=fields.stream, include_usage=fields.include_usage, priority=fields.priority,
        seed=fields.seed, cache_salt=fields.cache_salt, n=fields.n, ignore_eos=fields.ignore_eos,
        continuous_usage=fields.continuous_usage, logprobs=fields.logprobs, role=role, stop=fields.stop,
        continues=continues)


def plan_output(spec: GenerationSpec, prompt: list[int], max_model_len: int, engine_seed: int,
                choice: int = 0) -> tuple[int, str, int]:
    """How many tokens one choice generates, its finish reason, and its text seed.

    With ``max_tokens`` the output is exactly that long, or as long as the context window
    allows (finish reason "length" either way): that is how a trace replays an exact output
    length. Without it, the length is a deterministic function of the seed and prompt in
    [16, 256] (finish reason "stop"), raised to ``min_tokens`` and capped by the context window
    (then "length"); with ``ignore_eos`` it runs to the end of the window, as vLLM does.
    """
    seed = (token_hash(prompt) ^ (engine_seed * 0x9E3779B1) ^ ((spec.seed or 0) << 17)
            ^ (choice * 0x85EBCA77))
    room = max_model_len - len(prompt)
    if spec.max_tokens is not None:
        return min(spec.max_tokens, room), "length", seed
    natural = max(NATURAL_MIN + seed % (NATURAL_MAX - NATURAL_MIN + 1), spec.min_tokens)
    if spec.ignore_eos or natural >= room:
        return room, "length", seed
    return natural, "stop", seed



def find_stop(seed: int, count: int, stops: tuple[str, ...], offset: int = 0) -> tuple[int, str, int] | None:
    """Where the text generated from ``seed`` (from filler position ``offset``) first contains a stop
    string, as vLLM checks it.

    After each token, the text that token could have completed is searched for each stop string
    in order. Returns the number of tokens generated (the one that completed the stop string
    included), the stop string, and the length of the visible text (which ends before it);
    None if no stop string occurs within ``count`` tokens.
    """
    longest = max(len(s) for s in stops)
    text = ""
    for k, token in enumerate(filler_ids(seed, offset, offset + count)):
        start = max(0, len(text) - longest + 1)
        text += VOCAB_TEXT[token]
        for stop in stops:
            at = text.find(stop, start)
            if at >= 0:
                return k + 1, stop, at
    return None
