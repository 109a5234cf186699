"""Prefix affinity's view of a prompt: its leading blocks, each named by a chained hash.

The rendered prompt is cut into fixed blocks of characters; each block's hash chains the previous
one's, so a hash names the whole prefix up to its block (as vLLM's block hashes do). An endpoint's
affinity for a prompt is the fraction of the prompt's blocks, counted from the start, that it
served before: the part of the prompt its KV cache is likely to still hold. Which endpoints served
which blocks is the executor's memory (:class:`switchyard.state.prefix.PrefixIndex` in the
gateway), read and written by the prefix-affinity scorer (:mod:`switchyard.decide.plugins`).

Blocks are measured in characters, not tokens, so the gateway never tokenizes to route: 256
characters are about 64 tokens of English, below the engines' KV block (16 tokens on GPUs, 128 on
CPUs) times a few, so a shared prefix of one engine block is seen.
"""

from __future__ import annotations

import hashlib
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
