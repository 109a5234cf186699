"""Token counts used before a request runs (the engine reports the exact count afterwards).

A :class:`TokenCounter` counts with the served model's own tokenizer when the policy names one
(``models[].tokenizer``: a local ``tokenizer.json``), else it estimates.

The estimate: one token per four characters (rounded up), plus a small overhead per chat message
for the chat template's role markers. Four characters per token is the usual figure for English
text with Llama-3 and GPT-4-class tokenizers.

With a tokenizer, a text's tokens are counted exactly; a chat prompt adds what a Llama-3 chat
template wraps around the messages (see :data:`TEMPLATE_TOKENS_PER_MESSAGE`). The template itself
lives beside the weights (``tokenizer_config.json``) and is not rendered here, so that part stays
an estimate: exact for Llama-3's template, one or two tokens high for ChatML (Qwen).

The tokenizers are read from their files when a policy is loaded, by whoever loads it (the gateway:
:mod:`switchyard.gateway.tokenizers`), never here and never on the request path.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4  # the estimate's allowance for role markers and separators around each message

#: Tokens Llama-3's chat template adds around each message:
#: ``<|start_header_id|>`` role ``<|end_header_id|>`` ``\n\n`` … ``<|eot_id|>``.
TEMPLATE_TOKENS_PER_MESSAGE = 5
#: Tokens it adds once per prompt: ``<|begin_of_text|>`` and the assistant header the prompt ends
#: with (``add_generation_prompt``, vLLM's default): ``<|start_header_id|>assistant<|end_header_id|>\n\n``.
TEMPLATE_TOKENS_PER_PROMPT = 5


def estimate_text_tokens(text: str) -> int:
    """Tokens in ``text``, estimated from its length."""
    return -(-len(text) // CHARS_PER_TOKEN)


def estimate_chat_tokens(texts: list[str]) -> int:
    """Tokens of a chat prompt whose messages carry ``texts``."""
    return sum(estimate_text_tokens(t) for t in texts) + TOKENS_PER_MESSAGE * len(texts)


class TokenCounter:
    """Counts a prompt's tokens: exactly with a tokenizer, by the estimate without one.

    Args:
        tokenizer: The served model's tokenizer; ``None`` counts by the estimate.
    """

    __slots__ = ("_tokenizer",)

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self._tokenizer = tokenizer

    @property
    def exact(self) -> bool:
        """Whether text is counted with a real tokenizer (chat prompts still estimate the template)."""
        return self._tokenizer is not None

    def count_text(self, text: str) -> int:
        """Tokens of a completion prompt, with the special tokens the tokenizer adds (BOS), as vLLM counts it."""
        if self._tokenizer is None:
            return estimate_text_tokens(text)
        return len(self._tokenizer.encode(text))

    def count_chat(self, texts: Sequence[str]) -> int:
        """Tokens of a chat prompt whose messages carry ``texts``, the chat template's included."""
        if self._tokenizer is None:
            return estimate_chat_tokens(list(texts))
        content = sum(len(self._tokenizer.encode(t, add_special_tokens=False)) for t in texts)
        return content + TEMPLATE_TOKENS_PER_MESSAGE * len(texts) + TEMPLATE_TOKENS_PER_PROMPT


#: The counter of a model with no tokenizer configured.
ESTIMATE = TokenCounter()
