"""Prompt text of an exact token count under the simulator's tokenizer, made on demand.

Traces give token counts, never text, so a replay has to invent text: of exactly the right
length (under ``switchyard.simtext.tokens``), equal where the trace says two prompts share a prefix,
and different where it says they do not. Holding that text for a whole trace would take
hundreds of megabytes (the Mooncake conversation trace is 145 M prompt tokens), so a request
carries a small recipe (:class:`SynthText`) and its text is built when the request is sent.

How the text is made: a prompt is a run of *segments*, each ``(key, tokens)``. A segment's text
is a *tag* followed by a window of the simulator's filler text (whose position depends on the key
and a salt), cut to ``tokens`` tokens. The tag writes the key in base 72, one filler word per
digit, least significant first (at least three digits), then a word giving the number of
digits, so distinct keys have distinct tags and their segments differ within their first few
tokens: usually the first, at most the tenth for 48-bit keys (a segment shorter than its tag is
the tag's first words).
Every filler word is one token and starts with a space, so the texts of segments concatenate
without merging tokens: a prompt's token count is the sum of its segments' counts, and two
prompts whose leading segments are equal share exactly that many leading tokens. A window is
one slice of a precomputed string, so building a 10k-token prompt costs microseconds.

Keys: a Mooncake block id ``b`` uses key ``2*b``; text meant to be unique (a request's own
prompt, a shared-prefix group) uses an odd key drawn from a 48-bit hash (:func:`unique_key`).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Literal, Protocol

from switchyard.simtext.chat import render_chat
from switchyard.simtext.tokens import VOCAB_TEXT, count_tokens, filler_ids

Kind = Literal["chat", "completion"]

#: Filler tokens in the window table (two laps of the simulator's own table).
_TABLE_TOKENS = 1 << 16
#: Fewest digits in a tag: keys below 72**3 (block ids below 186,624) need no more.
_MIN_DIGITS = 3
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class _Table:
    text: str  # the filler text of _TABLE_TOKENS tokens
    offsets: list[int]  # character offset of token i (len = tokens + 1)
    starts: list[int]  # token positions a window may start at (a word with a leading space)
    digits: tuple[str, ...]  # the tag alphabet: one-token words with a leading space


@functools.cache
def _table() -> _Table:
    ids = filler_ids(0, 1, 1 + _TABLE_TOKENS)
    words = [VOCAB_TEXT[i] for i in ids]
    offsets = [0]
    pos = 0
    for word in words:
        pos += len(word)
        offsets.append(pos)
    starts = [i for i, word in enumerate(words) if word.startswith(" ")]
    digits = tuple(sorted({w for w in VOCAB_TEXT.values() if w.startswith(" ") and w[1:].isalpha()}))
    return _Table("".join(words), offsets, starts, digits)


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a cheap, well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def block_key(block_id: int) -> int:
    """The segment key of a trace block id (even; equal ids give equal text)."""
    if block_id < 0:
        raise ValueError(f"block ids must be >= 0, got {block_id}")
    return 2 * block_id


def unique_key(*parts: object) -> int:
    """An odd 48-bit segment key from a stable hash of ``parts`` (their ``repr``).

    Collisions are possible but rare (two keys among 100,000 collide with probability ~2e-5).
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=6).digest()
    return 2 * int.from_bytes(digest, "little") + 1


def segment_text(key: int, tokens: int, salt: int = 0) -> str:
    """Text of one segment: exactly ``tokens`` tokens under ``switchyard.simtext.tokens``.

    Args:
        key: The segment key (see :func:`block_key`, :func:`unique_key`).
        tokens: Token count, >= 0.
        salt: Moves the filler window (a run's seed): same key and salt, same text.
    """
    if key < 0:
        raise ValueError(f"segment keys must be >= 0, got {key}")
    if tokens <= 0:
        return ""
    tag, tag_tokens, start = _head(key, salt)
    if tokens <= tag_tokens:
        return "".join(_tag_words(key)[:tokens])
    need = tokens - tag_tokens
    table = _table()
    offsets, text = table.offsets, table.text
    parts = [tag, text[offsets[start]:offsets[min(start + need, _TABLE_TOKENS)]]]
    need -= _TABLE_TOKENS - start
    while need > 0:  # the table ends and starts with a word, so it wraps cleanly
        parts.append(text[:offsets[min(need, _TABLE_TOKENS)]])
        need -= _TABLE_TOKENS
    return "".join(parts)


def _tag_words(key: int) -> list[str]:
    """The tag: the key's base-72 digits, least significant first, then their count."""
    alphabet = _table().digits
    digits: list[int] = []
    rest = key
    while rest or len(digits) < _MIN_DIGITS:
        rest, digit = divmod(rest, len(alphabet))
        digits.append(digit)
    return [*[alphabet[d] for d in digits], alphabet[len(digits)]]


@functools.lru_cache(maxsize=1 << 16)  # trace blocks recur (a system prompt opens most requests)
def _head(key: int, salt: int) -> tuple[str, int, int]:
    """A segment's tag text, its length in tokens, and where its filler window starts."""
    words = _tag_words(key)
    starts = _table().starts
    return "".join(words), len(words), starts[_mix64(key ^ _mix64(salt)) % len(starts)]


class PromptText(Protocol):
    """What a request's prompt is: a token count known in advance and text on demand."""

    @property
    def tokens(self) -> int:
        """Tokens of the text under the simulator's tokenizer."""
        ...

    def text(self) -> str:
        """The text (built on each call; callers that need it twice keep it)."""
        ...


@dataclass(frozen=True, slots=True)
class SynthText:
    """A synthetic prompt: segments ``(key, tokens)`` whose texts are concatenated.

    Attributes:
        segments: The segments in order.
        salt: Moves every segment's filler window (usually the workload's seed).
    """

    segments: tuple[tuple[int, int], ...]
    salt: int = 0

    @property
    def tokens(self) -> int:
        """Tokens of the text: the sum of the segments' counts."""
        return sum(n for _, n in self.segments)

    def text(self) -> str:
        """The prompt text."""
        salt = self.salt
        return "".join([segment_text(key, n, salt) for key, n in self.segments])

    def truncated(self, tokens: int) -> SynthText:
        """The first ``tokens`` tokens of this prompt (its leading segments, the last one cut)."""
        out: list[tuple[int, int]] = []
        left = tokens
        for key, n in self.segments:
            if left <= 0:
                break
            out.append((key, min(n, left)))
            left -= n
        return SynthText(tuple(out), self.salt)


@dataclass(frozen=True, slots=True)
class LiteralText:
    """A prompt given as text (its token count is measured once, with the simulator's tokenizer).

    Attributes:
        value: The text.
        tokens: Tokens of the text under the simulator's tokenizer.
    """

    value: str
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", count_tokens(self.value))

    def text(self) -> str:
        """The prompt text."""
        return self.value


@functools.cache
def prompt_overhead_tokens(kind: Kind) -> int:
    """Tokens the simulated engine adds around a prompt of one user message or one string.

    Chat: the Llama-3 chat template (header tokens, end of turn, assistant header). Completion:
    the begin-of-text token, which vLLM adds for Llama tokenizers too. A real model's template
    may differ; these are the simulator's figures.
    """
    if kind == "completion":
        return 1
    return len(render_chat([{"role": "user", "content": ""}]))
