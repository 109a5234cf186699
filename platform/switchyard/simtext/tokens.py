"""A deterministic stand-in tokenizer and the filler text the simulated model "generates".

The tokenizer splits text the way byte-level BPE pre-tokenizers do (a word keeps its leading
space; digits go in groups of three; punctuation and whitespace runs are their own pieces),
then cuts long pieces into chunks: five letters for ASCII words, two characters for other
scripts. On English prose that is about four characters per token, like Llama 3's tokenizer.
Token ids are CRC-32 based, so they are the same in every process (Python's ``hash()`` of a
string is salted per process and must not be used). Special tokens such as ``<|eot_id|>``
are single tokens with fixed ids.

Generated text is drawn from a vocabulary of short words that are each exactly one token,
so a generated text tokenizes back to exactly the number of tokens generated, and a later
prompt that quotes it (a multi-turn conversation) reuses the same token ids: the prefix cache
behaves as it does on a real engine.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from array import array

import msgspec

#: Ids below this are reserved for bytes/special purposes; text tokens land above it.
_FIRST_TEXT_ID = 1000
#: Text token ids are in [_FIRST_TEXT_ID, _TEXT_ID_LIMIT); special tokens sit above.
_TEXT_ID_LIMIT = 128_000

SPECIAL_TOKENS: dict[str, int] = {
    "<|begin_of_text|>": 128_000,
    "<|end_of_text|>": 128_001,
    "<|start_header_id|>": 128_006,
    "<|end_header_id|>": 128_007,
    "<|eot_id|>": 128_009,
    "<|python_tag|>": 128_010,
}

_SPECIAL_NAMES = {i: name for name, i in SPECIAL_TOKENS.items()}
_SPECIAL = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
_PIECE = re.compile(
    r" ?[^\W\d_]+"  # a word with its leading space
    r"| ?\d{1,3}"  # numbers, three digits at a time
    r"| ?[^\s\w]+"  # punctuation runs
    r"|\s*[\r\n]+"  # line breaks, with the indentation before them
    r"|\s+(?!\S)|\s+"  # other whitespace runs (the last space joins the next word)
)
_ASCII_CHUNK = 5
_OTHER_CHUNK = 2
_SYMBOL_CHUNK = 3
_SPACE_CHUNK = 8
_CACHE_LIMIT = 200_000
_cache: dict[str, tuple[int, ...]] = {}
#: Text of each id the tokenizer has produced in this process (``token_text``), cleared with ``_cache``.
_text_of: dict[int, str] = {}


def _chunk_id(chunk: str) -> int:
    return _FIRST_TEXT_ID + zlib.crc32(chunk.encode()) % (_TEXT_ID_LIMIT - _FIRST_TEXT_ID)


def _piece_ids(piece: str) -> tuple[int, ...]:
    if piece.isspace():
        size, lead = _SPACE_CHUNK, 0
    else:
        lead = 1 if piece[0] == " " else 0
        if not piece.isascii():
            size = _OTHER_CHUNK
        elif piece[lead:].isalpha():
            size = _ASCII_CHUNK
        else:
            size = _SYMBOL_CHUNK
    # The leading space rides with the first chunk, as in byte-level BPE.
    first = lead + size
    chunks = [piece[:first], *(piece[i:i + size] for i in range(first, len(piece), size))]
    ids = tuple(_chunk_id(c) for c in chunks)
    _text_of.update(zip(ids, chunks, strict=True))
    return ids


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``; deterministic across processes, about 4 characters per token.

    Args:
        text: Any text; special tokens written as ``<|name|>`` count as one token each.

    Returns:
        The token ids.
    """
    ids: list[int] = []
    cache = _cache
    # Special tokens first (so "?<|eot_id|>" is not read as punctuation), then pieces.
    parts = _SPECIAL.split(text) if "<|" in text else [text]
    for i, part in enumerate(parts):
        if i % 2:
            ids.append(SPECIAL_TOKENS[part])
            continue
        for piece in _PIECE.findall(part):
            got = cache.get(piece)
            if got is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                    _text_of.clear()
                got = _piece_ids(piece)
                cache[piece] = got
            ids.extend(got)
    return ids


def token_text(token_id: int) -> str | None:
    """Text of a token id: a special token's name, a generated word, or the text of a chunk this process has
    tokenized (ids are hashes: others cannot be turned back into text); None for any other id."""
    known = _SPECIAL_NAMES.get(token_id) or VOCAB_TEXT.get(token_id)
    return known if known is not None else _text_of.get(token_id)


def count_tokens(text: str) -> int:
    """Number of tokens in ``text``."""
    return len(tokenize(text))


def token_hash(ids: list[int]) -> int:
    """A stable 64-bit digest of a token sequence (same in every process)."""
    return int.from_bytes(hashlib.blake2b(array("q", ids).tobytes(), digest_size=8).digest(),
                          "little")


# --- generated text -----------------------------------------------------------------------

_WORDS = (
    " the", " a", " of", " to", " and", " in", " is", " it", " that", " for", " on", " with",
    " as", " this", " be", " at", " by", " from", " or", " an", " we", " can", " will", " each",
    " model", " data", " time", " value", " state", " cache", " token", " batch", " queue",
    " load", " node", " path", " rule", " limit", " cost", " route", " pool", " block",
    " shows", " keeps", " uses", " makes", " runs", " holds", " gives", " finds", " moves",
    " first", " next", " small", " large", " fast", " same", " other", " new", " old", " more",
    " less", " every", " which",
)
_STARTS = (" The", " This", " Each", " A", " We", " It", " Every", " Then")
_FIRST = ("The", "This", "Each", "A", "We", "It", "Every", "Then")
_PUNCT = (".", ",")


def _single_id(word: str) -> int:
    ids = tokenize(word)
    if len(ids) != 1:  # pragma: no cover - guarded by a unit test
        raise AssertionError(f"filler word {word!r} is not a single token")
    return ids[0]


#: Token id -> its text, for every id the simulated model can generate.
VOCAB_TEXT: dict[int, str] = {_single_id(w): w for w in _WORDS + _STARTS + _FIRST + _PUNCT}
#: Token id -> its text as a JSON string literal (the bytes streamed in SSE chunks).
VOCAB_JSON: dict[int, bytes] = {i: msgspec.json.encode(t) for i, t in VOCAB_TEXT.items()}

_WORD_IDS = tuple(_single_id(w) for w in _WORDS)
_START_IDS = tuple(_single_id(w) for w in _STARTS)
_FIRST_IDS = tuple(_single_id(w) for w in _FIRST)
_PERIOD, _COMMA = _single_id("."), _single_id(",")
_TABLE_SIZE = 1 << 15


def _build_table(size: int) -> list[int]:
    """A long deterministic run of filler tokens: words with a leading space, sentences that
    start capitalised, an occasional comma or period (never two punctuation marks in a row,
    and words at both ends, so any slice and the wrap-around tokenize back unchanged)."""
    state = 0x2545F4914F6CDD1D
    out: list[int] = []
    prev = _PERIOD
    for _ in range(size):
        state = (state * 6364136223846793005 + 1442695040888963407) & ((1 << 64) - 1)
        r = state >> 33
        if prev == _PERIOD:
            tok = _START_IDS[r % len(_START_IDS)]
        elif prev != _COMMA and prev not in _START_IDS and r % 11 == 0:
            tok = _PERIOD if r & 0x100 else _COMMA
        else:
            tok = _WORD_IDS[r % len(_WORD_IDS)]
        out.append(tok)
        prev = tok
    out[0] = out[-1] = _WORD_IDS[0]
    return out


_TABLE = _build_table(_TABLE_SIZE)


def filler_ids(seed: int, start: int, stop: int) -> list[int]:
    """Generated tokens ``[start, stop)`` of the output seeded by ``seed``.

    Token 0 is a capitalised word (the text starts without a space); the rest is a slice of
    a fixed table at a seed-dependent offset, so generating many tokens is one C-level slice
    and the same seed always gives the same text.
    """
    out: list[int] = []
    if start == 0 and stop > 0:
        out.append(_FIRST_IDS[seed % len(_FIRST_IDS)])
        start = 1
    if stop <= start:
        return out
    size = _TABLE_SIZE
    a = ((seed >> 8) + start - 1) % size
    n = stop - start
    while n > 0:
        take = min(n, size - a)
        out.extend(_TABLE[a:a + take])
        n -= take
        a = 0
    return out


def detokenize(ids: list[int]) -> str:
    """Text of generated token ids (only ids the simulated model generates are known)."""
    text = VOCAB_TEXT
    return "".join(text[i] for i in ids)
