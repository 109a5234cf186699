"""What the decisions look at in a request, extracted once from the OpenAI request body."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from switchyard.decide.tokens import TokenCounter, estimate_chat_tokens, estimate_text_tokens

# Regular expressions of routing rules only ever see this much of a message: a policy's regex
# runs on client text, and bounding the input bounds the cost of a badly written pattern.
MAX_MATCH_CHARS = 16_384


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """The request as the policy sees it."""

    model: str
    prompt_tokens: int
    messages: int = 1
    last_user_text: str = ""
    system_text: str = ""
    max_tokens: int | None = None
    has_tools: bool = False
    json_mode: bool = False
    has_images: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    #: Tokens of the longest of a completion's several prompts (each is a sequence of its own, which
    #: must fit the context window by itself); None: one prompt, ``prompt_tokens``.
    longest_prompt: int | None = None
    #: Whether ``prompt_tokens`` is exact (the prompts were token ids), not the estimate.
    prompt_exact: bool = False
    #: Choices asked for (``n``): each generates up to ``max_tokens`` of its own.
    choices: int = 1


def _choices(body: Mapping[str, Any]) -> int:
    """``n`` (checked a positive integer by ``gateway.body``), else 1."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def _content_text(content: Any) -> tuple[str, bool]:
    """Text of a message's content (string or list of parts) and whether it holds an image."""
    if isinstance(content, str):
        return content, False
    if not isinstance(content, list):
        return "", False
    texts, image = [], False
    for part in content:
        if isinstance(part, dict):
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind in ("image_url", "input_image", "image"):
                image = True
    return "\n".join(texts), image


def message_texts(messages: list[Any]) -> list[str]:
    """The text of each message (images and other parts left out)."""
    return [_content_text(m.get("content"))[0] if isinstance(m, dict) else "" for m in messages]


def chat_features(body: Mapping[str, Any], headers: Mapping[str, str]) -> RequestFeatures:
    """Features of a validated ``/v1/chat/completions`` body."""
    messages = body["messages"]
    texts: list[str] = []
    last_user, system, images = "", "", False
    for message in messages:
        text, image = _content_text(message.get("content"))
        texts.append(text)
        images = images or image
        role = message.get("role")
        if role == "user":
            last_user = text
        elif role in ("system", "developer") and not system:
            system = text
    fmt = body.get("response_format")
    return RequestFeatures(
        model=body["model"],
        prompt_tokens=estimate_chat_tokens(texts),
        messages=len(messages),
        last_user_text=last_user[-MAX_MATCH_CHARS:],
        system_text=system[:MAX_MATCH_CHARS],
        max_tokens=body.get("max_completion_tokens") or body.get("max_tokens"),
        choices=_choices(body),
        has_tools=bool(body.get("tools")),
        json_mode=isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"),
        has_images=images,
        headers=headers,
    )


def completion_features(body: Mapping[str, Any], headers: Mapping[str, str]) -> RequestFeatures:
    """Features of a validated ``/v1/completions`` body."""
    prompt = body["prompt"]
    longest: int | None = None
    if isinstance(prompt, str):
        text, tokens, exact = prompt, estimate_text_tokens(prompt), False
    elif prompt and all(isinstance(p, int) for p in prompt):
        text, tokens, exact = "", len(prompt), True
    else:
        parts = [p for p in prompt if isinstance(p, str)]
        text = parts[-1] if parts else ""
        counts = [estimate_text_tokens(p) if isinstance(p, str) else len(p) for p in prompt]
        tokens, longest, exact = sum(counts), max(counts, default=0), not parts
    return RequestFeatures(
        model=body["model"],
        prompt_tokens=tokens,
        last_user_text=text[-MAX_MATCH_CHARS:],
        max_tokens=body.get("max_tokens"),
        choices=_choices(body),
        headers=headers,
        longest_prompt=longest,
        prompt_exact=exact,
    )


def embedding_inputs(value: Any) -> list[str | list[int]]:
    """An embeddings request's inputs (checked by ``gateway.body``): each a text or token ids."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int | float) for v in value):
        return [list(value)]
    return list(value)


def embedding_features(body: Mapping[str, Any], headers: Mapping[str, str]) -> RequestFeatures:
    """Features of a validated ``/v1/embeddings`` body: its inputs' tokens, and no output."""
    inputs = embedding_inputs(body["input"])
    counts = [estimate_text_tokens(v) if isinstance(v, str) else len(v) for v in inputs]
    texts = [v for v in inputs if isinstance(v, str)]
    return RequestFeatures(
        model=body["model"],
        prompt_tokens=sum(counts),
        last_user_text=(texts[-1] if texts else "")[-MAX_MATCH_CHARS:],
        max_tokens=0,
        headers=headers,
        longest_prompt=max(counts, default=0) if len(counts) > 1 else None,
        prompt_exact=not texts,
    )


def responses_messages(body: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
    """A ``/v1/responses`` body's turns as (role, text, has an image): ``instructions`` as a system turn, then
    ``input`` (a string is one user turn; a list holds messages and other items, whose text counts too)."""
    turns: list[tuple[str, str, bool]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        turns.append(("system", instructions, False))
    value = body.get("input")
    if isinstance(value, str):
        turns.append(("user", value, False))
        return turns
    for item in value if isinstance(value, list) else ():
        if not isinstance(item, dict):
            continue
        if "content" in item:
            text, image = _content_text(item.get("content"))
            role = item.get("role")
            turns.append((role if isinstance(role, str) else "user", text, image))
        else:  # a function call, its output, a reasoning item...: its text is in the prompt all the same
            for key in ("output", "arguments", "text"):
                if isinstance(item.get(key), str):
                    turns.append(("tool", item[key], False))
                    break
    return turns


def responses_features(body: Mapping[str, Any], headers: Mapping[str, str]) -> RequestFeatures:
    """Features of a validated ``/v1/responses`` body (read as the chat it is rendered into)."""
    turns = responses_messages(body)
    last_user = next((text for role, text, _ in reversed(turns) if role == "user"), "")
    system = next((text for role, text, _ in turns if role in ("system", "developer")), "")
    fmt = body.get("text")
    fmt = fmt.get("format") if isinstance(fmt, dict) else None
    return RequestFeatures(
        model=body["model"],
        prompt_tokens=estimate_chat_tokens([text for _, text, _ in turns]),
        messages=len(turns),
        last_user_text=last_user[-MAX_MATCH_CHARS:],
        system_text=system[:MAX_MATCH_CHARS],
        max_tokens=body.get("max_output_tokens"),
        has_tools=bool(body.get("tools")),
        json_mode=isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"),
        has_images=any(image for _, _, image in turns),
        headers=headers,
    )


def tokenizer_features(kind: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> RequestFeatures:
    """Features of a ``/tokenize`` or ``/detokenize`` body: what routing rules read of it; nothing is charged."""
    if kind == "detokenize":
        tokens = body.get("tokens")
        return RequestFeatures(model=body["model"], prompt_tokens=len(tokens) if isinstance(tokens, list) else 0,
                               max_tokens=0, headers=headers, prompt_exact=True)
    messages = body.get("messages")
    if isinstance(messages, list):
        texts = message_texts(messages)
        return RequestFeatures(model=body["model"], prompt_tokens=estimate_chat_tokens(texts), max_tokens=0,
                               messages=len(texts), last_user_text=(texts[-1] if texts else "")[-MAX_MATCH_CHARS:],
                               headers=headers)
    prompt = body.get("prompt")
    text = prompt if isinstance(prompt, str) else ""
    return RequestFeatures(model=body["model"], prompt_tokens=estimate_text_tokens(text), max_tokens=0,
                           last_user_text=text[-MAX_MATCH_CHARS:], headers=headers)


def request_features(kind: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> RequestFeatures:
    """Features of a validated body of ``kind`` (see :data:`switchyard.decide.cache.RequestKind`)."""
    if kind == "chat":
        return chat_features(body, headers)
    if kind == "completion":
        return completion_features(body, headers)
    if kind == "embedding":
        return embedding_features(body, headers)
    if kind == "responses":
        return responses_features(body, headers)
    return tokenizer_features(kind, body, headers)


def count_prompt(counter: TokenCounter, kind: str, body: Mapping[str, Any]) -> int:
    """The prompt's tokens under the model's own tokenizer (``kind``: ``chat`` or ``completion``)."""
    return count_prompts(counter, kind, body)[0]


def count_prompts(counter: TokenCounter, kind: str, body: Mapping[str, Any]) -> tuple[int, int]:
    """The prompt's tokens under the model's own tokenizer, and those of its longest prompt (a
    completion may send several; a chat has one)."""
    if kind == "chat":
        tokens = counter.count_chat(message_texts(body["messages"]))
        return tokens, tokens
    if kind == "responses":
        tokens = counter.count_chat([text for _, text, _ in responses_messages(body)])
        return tokens, tokens
    if kind == "embedding":
        counts = [counter.count_text(v) if isinstance(v, str) else len(v) for v in embedding_inputs(body["input"])]
        return sum(counts), max(counts, default=0)
    prompt = body["prompt"]
    if isinstance(prompt, str):
        tokens = counter.count_text(prompt)
        return tokens, tokens
    if prompt and all(isinstance(p, int) for p in prompt):
        return len(prompt), len(prompt)
    counts = [counter.count_text(p) if isinstance(p, str) else len(p) for p in prompt]
    return sum(counts), max(counts, default=0)
