"""The stand-in tokenizer and generated text."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from switchyard.simtext.chat import IMAGE_TOKENS, render_chat
from switchyard.simtext.tokens import SPECIAL_TOKENS, detokenize, filler_ids, tokenize

ENGLISH = (
    "Switchyard sits in front of the model. The inference engine is an off-the-shelf box "
    "that already does continuous batching, paged KV cache, tensor parallelism and quantised "
    "weights; we configure it, we do not rebuild it. Switchyard decides, for every request, "
    "which model handles it, whether it runs at all, where it runs, and what happens when it "
    "cannot. Operators declare all of that in one versioned policy document that can also "
    "be edited through the admin console; every gateway replica hot-reloads it."
)


def test_tokenize_is_deterministic_across_processes() -> None:
    code = ("from switchyard.simtext.tokens import tokenize; "
            f"print(tokenize({ENGLISH!r}))")
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout
        outputs.add(out)
    assert len(outputs) == 1
    assert outputs.pop().strip() == str(tokenize(ENGLISH))


def test_about_four_characters_per_token_on_english() -> None:
    ratio = len(ENGLISH) / len(tokenize(ENGLISH))
    assert 3.5 <= ratio <= 4.8


def test_long_words_and_other_scripts_take_more_tokens() -> None:
    assert len(tokenize(" the")) == 1
    assert len(tokenize(" internationalisation")) > 2
    assert len(tokenize("日本語のテキスト")) >= 4


def test_special_tokens_are_single_tokens() -> None:
    ids = tokenize("<|begin_of_text|>hi<|eot_id|>")
    assert ids[0] == SPECIAL_TOKENS["<|begin_of_text|>"]
    assert ids[-1] == SPECIAL_TOKENS["<|eot_id|>"]
    assert len(ids) == 3


def test_concatenation_at_word_boundary_keeps_ids() -> None:
    a, b = "The cache holds", " every prefix."
    assert tokenize(a + b) == tokenize(a) + tokenize(b)


@pytest.mark.parametrize("seed", [0, 1, 2, 255, 256, 12345, 2**40 + 7, 2**63 - 1])
def test_generated_text_tokenizes_back_to_the_generated_ids(seed: int) -> None:
    ids = filler_ids(seed, 0, 40_000)  # longer than the table: crosses its wrap-around
    text = detokenize(ids)
    assert tokenize(text) == ids
    assert not text.startswith(" ")
    assert 3 < len(text) / len(ids) < 6


def test_generated_text_is_deterministic_and_depends_on_the_seed() -> None:
    assert filler_ids(7, 0, 50) == filler_ids(7, 0, 50)
    assert filler_ids(7, 0, 50) != filler_ids(8 << 8, 0, 50)
    # Generating in pieces gives the same tokens as generating at once.
    pieces = filler_ids(7, 0, 1) + filler_ids(7, 1, 20) + filler_ids(7, 20, 50)
    assert pieces == filler_ids(7, 0, 50)


def test_chat_template_tokens_count() -> None:
    messages = [{"role": "user", "content": "hello"}]
    bare = render_chat(messages)
    assert len(bare) > len(tokenize("hello")) + 4  # headers and end-of-turn markers count
    with_system = render_chat([{"role": "system", "content": "Be brief."}, *messages])
    assert len(with_system) > len(bare)


def test_tools_and_response_format_count_into_the_prompt() -> None:
    messages = [{"role": "user", "content": "weather in Paris?"}]
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object",
                                              "properties": {"city": {"type": "string"}}}}}]
    assert len(render_chat(messages, tools=tools)) > len(render_chat(messages)) + 10
    fmt = {"type": "json_object"}
    assert len(render_chat(messages, response_format=fmt)) > len(render_chat(messages))


def test_image_parts_cost_a_fixed_number_of_tokens() -> None:
    text_only = render_chat([{"role": "user", "content": [{"type": "text", "text": "what?"}]}])
    one_image = render_chat([{"role": "user", "content": [
        {"type": "text", "text": "what?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    other_image = render_chat([{"role": "user", "content": [
        {"type": "text", "text": "what?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}}]}])
    assert len(one_image) - len(text_only) == IMAGE_TOKENS
    assert one_image != other_image  # different images never share a cached prefix
