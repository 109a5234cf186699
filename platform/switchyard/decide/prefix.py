"""Prefix affinity: which endpoint recently served the leading blocks of a prompt.

The rendered prompt is cut into fixed blocks of characters; each block's hash chains the previous
one's, so a hash names the whole prefix up to its block (as vLLM's block hashes do). A bounded
index (LRU with a TTL) remembers which endpoints served which block hashes. An endpoint's
affinity for a prompt is the fraction of the prompt's blocks, counted from the start, that it
served before: the part of the prompt its KV cache is likely to still hold.

Blocks are measured in characters, not tokens, so the gateway never tokenizes to route: 256
characters are about 64 tokens of English, below the engines' KV block (16 tokens on GPUs, 128 on
CPUs) times a few, so a shared prefix of one engine block is seen.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

BLOCK_CHARS = 256
#: Prompts are hashed up to this many blocks (64 kB of text); longer tails do not change routing.
MAX_BLOCKS = 256


def block_hashes(text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> list[bytes]:
    """Chained hashes of the full blocks of ``text`` (a partial last block is not cached by engines)."""
    hashes: list[bytes] = []
    previous = b""
    end = min(len(text) // block_chars, max_blocks) * block_chars
    for start in range(0, end, block_chars):
        digest = hashlib.blake2b(previous + text[start:start + block_chars].encode("utf-8", "surrogatepass"),
                                 digest_size=12).digest()
        hashes.append(digest)
        previous = digest
    return hashes


class PrefixIndex:
    """Block hash → the endpoints that served it and when; bounded in entries and age (a block no endpoint
    has served within ``ttl_s`` is dropped at the next :meth:`record`)."""

    __slots__ = ("_blocks", "capacity", "ttl_s")

    def __init__(self, capacity: int = 200_000, ttl_s: float = 600.0) -> None:
        self._blocks: OrderedDict[bytes, dict[str, float]] = OrderedDict()
        self.capacity = capacity
        self.ttl_s = ttl_s

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, hashes: list[bytes], url: str, now: float | None = None) -> None:
        """Remember that ``url`` now holds every block of ``hashes``."""
        now = time.monotonic() if now is None else now
        blocks = self._blocks
        for h in hashes:
            holders = blocks.get(h)
            if holders is None:
                blocks[h] = {url: now}
            else:
                holders[url] = now
                blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        # Blocks are kept in the order they were last recorded, so the ones no endpoint has served within
        # the TTL are at the front: dropping them keeps the index as small as the traffic of one TTL (the
        # soak showed the capacity alone let it grow for over half an hour at 30 requests/s).
        oldest = now - self.ttl_s
        while blocks:
            first = next(iter(blocks.values()))
            if max(first.values()) >= oldest:
                break
            blocks.popitem(last=False)

    def affinity(self, hashes: list[bytes], urls: list[str], now: float | None = None) -> dict[str, float]:
        """For each of ``urls``, the fraction of ``hashes`` it holds as an unbroken leading run."""
        result = dict.fromkeys(urls, 0.0)
        if not hashes:
            return result
        now = time.monotonic() if now is None else now
        oldest = now - self.ttl_s
        alive = set(urls)
        for depth, h in enumerate(hashes, start=1):
            holders = self._blocks.get(h)
            if holders is None:
                break
            alive = {u for u in alive if holders.get(u, -math.inf) >= oldest}
            if not alive:
                break
            for u in alive:
                result[u] = depth / len(hashes)
        return result


def _content(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return ""


def prompt_text(body: Mapping[str, Any], limit: int = BLOCK_CHARS * MAX_BLOCKS) -> str:
    """The prompt as the engine will see it, roughly: chat messages rendered as role and text.

    Only the order and content matter (equal prompts give equal text, and a prompt that extends
    another starts with its text); the engine's real chat template is not needed for that.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for message in messages:
            if not isinstance(message, dict):
                continue
            piece = f"<{message.get('role')}>{_content(message.get('content'))}\n"
            parts.append(piece)
            size += len(piece)
            if size >= limit:
                break
        return "".join(parts)[:limit]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:limit]
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first[:limit]
        if isinstance(first, int):  # token ids: four characters a token, like the text estimate
            return ",".join(f"{t:03d}" for t in prompt[: limit // 4])[:limit]
    return ""
