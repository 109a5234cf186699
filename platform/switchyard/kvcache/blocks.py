"""Names of token blocks that mean the same on every gateway replica and in every tool.

An engine names its cached blocks by hashes only it can reproduce (vLLM hashes with a per-process seed
unless ``PYTHONHASHSEED`` is set). The gateway names a block instead by the *chain of token blocks* it
ends: the key of a block is a digest of its parent's key and its own token ids, so a key stands for the
whole prefix up to and including that block, as an engine's hash does, and two processes that see the
same tokens compute the same keys. The index of an engine's cache (:mod:`switchyard.state.kvindex`)
translates the engine's hashes into these keys as its events arrive; a request's prompt is cut into the
same keys to look it up.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

#: The parent key of a sequence's first block.
ROOT = b""
#: Bytes of a key: 128 bits, so that collisions among billions of blocks stay improbable.
KEY_BYTES = 16


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of the block holding ``tokens`` after the prefix named ``parent``."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=KEY_BYTES).digest()


def iter_keys(tokens: Sequence[int], block_size: int) -> Iterator[bytes]:
    """The keys of the full blocks of ``tokens`` in order, made as they are asked for (a lookup that stops
    at the first block nobody holds hashes no further). A partial last block is never cached."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    raw = array("q", tokens).tobytes()
    step = block_size * 8
    blake2b = hashlib.blake2b
    parent = ROOT
    for start in range(0, len(tokens) // block_size * step, step):
        parent = blake2b(parent + raw[start:start + step], digest_size=KEY_BYTES).digest()
        yield parent


def chain_keys(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """The keys of the full blocks of ``tokens``, at most ``limit``."""
    keys = iter_keys(tokens, block_size)
    return list(keys) if limit is None else [k for _, k in zip(range(limit), keys, strict=False)]
