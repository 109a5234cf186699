"""Prompt synthesis: exact token counts under the simulator, shared prefixes shared exactly."""

from __future__ import annotations

import random

import pytest

from switchyard.bench.prompts import (
    LiteralText,
    SynthText,
    block_key,
    prompt_overhead_tokens,
    segment_text,
    unique_key,
)
from switchyard.simtext.chat import render_chat
from switchyard.simtext.tokens import count_tokens, tokenize


@pytest.mark.parametrize("tokens", [0, 1, 2, 3, 4, 5, 11, 16, 511, 512, 513, 4096, 70_000, 140_000])
def test_segment_has_exact_token_count(tokens: int) -> None:
    for key in (0, 2, block_key(12345), unique_key("x", 1)):
        assert count_tokens(segment_text(key, tokens, salt=3)) == tokens


def test_random_prompts_have_exact_token_counts() -> None:
    rng = random.Random(7)
    for i in range(200):
        segments = tuple(
            (rng.choice([block_key(rng.randrange(10**6)), unique_key("t", i, j)]), rng.randrange(0, 2000))
            for j in range(rng.randrange(1, 6))
        )
        prompt = SynthText(segments, salt=rng.randrange(1000))
        assert count_tokens(prompt.text()) == prompt.tokens == sum(n for _, n in segments)


def test_equal_leading_segments_share_exactly_that_prefix() -> None:
    a = SynthText(((block_key(0), 512), (block_key(1), 512), (block_key(2), 76)))
    b = SynthText(((block_key(0), 512), (block_key(1), 512), (block_key(3), 300)))
    ta, tb = tokenize(a.text()), tokenize(b.text())
    assert ta[:1024] == tb[:1024]
    assert ta[1024] != tb[1024]
    assert a.text()[:1000] == b.text()[:1000]


def test_distinct_keys_differ_early() -> None:
    # Segments of distinct keys diverge within their tags (a few tokens), for many key pairs.
    rng = random.Random(1)
    for _ in range(300):
        k1, k2 = rng.sample(range(0, 400_000, 2), 2)
        t1, t2 = tokenize(segment_text(k1, 64)), tokenize(segment_text(k2, 64))
        first_diff = next(i for i, (x, y) in enumerate(zip(t1, t2, strict=True)) if x != y)
        assert first_diff < 10


def test_text_is_deterministic_and_salt_moves_the_filler() -> None:
    assert segment_text(10, 300, salt=1) == segment_text(10, 300, salt=1)
    assert segment_text(10, 300, salt=1) != segment_text(10, 300, salt=2)
    # the tag (first words) does not depend on the salt
    assert tokenize(segment_text(10, 300, salt=1))[:4] == tokenize(segment_text(10, 300, salt=2))[:4]


def test_truncated_keeps_the_leading_segments() -> None:
    prompt = SynthText(((block_key(0), 512), (block_key(1), 512)), salt=5)
    cut = prompt.truncated(700)
    assert cut.segments == ((block_key(0), 512), (block_key(1), 188))
    assert cut.tokens == 700
    assert prompt.text().startswith(cut.text())


def test_literal_text_and_template_overhead() -> None:
    assert LiteralText("hello world").tokens == count_tokens("hello world")
    text = SynthText(((unique_key("o"), 100),)).text()
    chat = render_chat([{"role": "user", "content": text}])
    assert len(chat) == 100 + prompt_overhead_tokens("chat")
    assert prompt_overhead_tokens("completion") == 1


def test_negative_keys_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        segment_text(-1, 5)
    with pytest.raises(ValueError, match=">= 0"):
        block_key(-3)
