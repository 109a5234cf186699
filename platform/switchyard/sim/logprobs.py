"""Log-probabilities for generated tokens: made up, deterministic, and in vLLM's shapes.

The simulated model has no distribution to sample from, so a token's log-probability and its
most likely alternatives are a function of the text seed and the token's position: the same
request always reports the same numbers, the sampled token is the most likely one, and the
alternatives are other words of the filler vocabulary.
"""

from __future__ import annotations

import hashlib
from typing import Any

from switchyard.simtext.tokens import VOCAB_TEXT

_ALTERNATIVES = tuple(sorted(VOCAB_TEXT))


def top_logprobs(seed: int, position: int, token: int, k: int) -> list[tuple[str, float]]:
    """The ``max(k, 1)`` most likely tokens at ``position``, best first; the first is ``token``.

    Args:
        seed: The output's text seed.
        position: Index of the token in the output.
        token: The generated token id.
        k: How many top tokens were asked for.
    """
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little")
    best = -0.01 - (h % 3000) / 1000.0
    out = [(VOCAB_TEXT[token], best)]
    step = 0.25 + (h >> 20) % 100 / 100.0
    start = (h >> 40) % len(_ALTERNATIVES)
    i = 0
    while len(out) < k:
        alt = _ALTERNATIVES[(start + i) % len(_ALTERNATIVES)]
        i += 1
        if alt != token:
            out.append((VOCAB_TEXT[alt], best - step * len(out)))
    return out


def chat_logprobs(seed: int, start: int, ids: list[int], k: int) -> dict[str, Any]:
    """A chat choice's ``logprobs`` for tokens ``start…`` of an output (``top_logprobs`` = k)."""
    content = []
    for offset, token in enumerate(ids):
        top = top_logprobs(seed, start + offset, token, k)
        text, logprob = top[0]
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                         for t, lp in top[:k]]})
    return {"content": content}


def completion_logprobs(seed: int, start: int, ids: list[int], k: int, text_offset: int) -> dict[str, Any]:
    """A text completion choice's ``logprobs`` (``logprobs`` = k) for tokens ``start…``.

    Args:
        seed: The output's text seed.
        start: Position of ``ids[0]`` in the output.
        ids: Token ids.
        k: Top log-probabilities per token.
        text_offset: Character offset of the first token's text in the output.
    """
    offsets, logprobs, tokens, tops = [], [], [], []
    for offset, token in enumerate(ids):
        top = top_logprobs(seed, start + offset, token, k)
        text, logprob = top[0]
        offsets.append(text_offset)
        text_offset += len(text)
        logprobs.append(logprob)
        tokens.append(text)
        tops.append(dict(top))
    return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens, "top_logprobs": tops}
