"""How the ``auto`` scenario sends a labelled prompt: as a chat completion for ``auto`` with ``max_tokens: 1``
(its system prompt, its number of messages, a dummy tool, JSON mode), ``CONCURRENCY`` at a time."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec

from switchyard.bench.labelled import LabelledPrompt
from switchyard.bench.results import Result
from switchyard.bench.scenarios.auto.policy import ROUTE
from switchyard.bench.sender import Target, send_one
from switchyard.simtext.tokens import count_tokens

TIER = "pro"
TENANT = "auto-bench"
#: The arm's name in the per-request summary (one arm: the gateway).
ARM = "switchyard"
#: Requests in flight at once.
CONCURRENCY = 8
CLIENT_TIMEOUT_S = 30.0
#: The tool sent with prompts that have tools (the route looks only at whether there are any).
DUMMY_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "lookup", "description": "Look something up.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def request_body(prompt: LabelledPrompt, route: str = ROUTE) -> dict[str, Any]:
    """The chat completion a labelled prompt is sent as.

    Its system prompt first; then empty earlier turns, user and assistant by turns, until the
    conversation has ``prompt.messages`` messages (as the policy's tests and the dry run count
    them); then the prompt itself as the last user message.
    """
    messages: list[dict[str, str]] = []
    if prompt.system:
        messages.append({"role": "system", "content": prompt.system})
    earlier = max(0, prompt.messages - len(messages) - 1)
    messages += [{"role": "assistant" if (earlier - i) % 2 else "user", "content": ""} for i in range(earlier)]
    messages.append({"role": "user", "content": prompt.prompt})
    body: dict[str, Any] = {"model": route, "messages": messages, "max_tokens": 1}
    if prompt.tools:
        body["tools"] = [DUMMY_TOOL]
    if prompt.json_mode:
        body["response_format"] = {"type": "json_object"}
    return body


def sent_tokens(prompt: LabelledPrompt) -> int:
    """Tokens of the text sent (system and user message), under the simulator's tokenizer."""
    return count_tokens(prompt.prompt) + (count_tokens(prompt.system) if prompt.system else 0)


async def send_prompts(prompts: Sequence[LabelledPrompt], base_url: str, key: str, *,
                       concurrency: int = CONCURRENCY, timeout_s: float = CLIENT_TIMEOUT_S) -> list[Result]:
    """Send every prompt, ``concurrency`` at a time, each when a client is free; one result per prompt, in order."""
    target = Target(base_url, ARM, default_api_key=key)
    url, headers = target.url("chat"), target.headers_for(TENANT)
    encode = msgspec.json.Encoder().encode
    queue = deque(enumerate(prompts))
    results: list[Result | None] = [None] * len(prompts)
    loop = asyncio.get_running_loop()
    now = loop.time
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = now()

        async def client() -> None:
            while queue:
                index, p = queue.popleft()
                result = Result(index, ARM, TENANT, p.label, ROUTE, "chat", False, sent_tokens(p), 1, None,
                                now() - start)
                results[index] = await send_one(session, encode(request_body(p)), url, headers, result, now, start)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return [r for r in results if r is not None]
