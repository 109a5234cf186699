"""Token estimates used before a request runs (the engine reports the exact count afterwards).

Without a tokenizer, a prompt's tokens are estimated as one per four characters (rounded up),
plus a small overhead per chat message for the chat template's role markers. Four characters
per token is the usual figure for English text with Llama-3 and GPT-4-class tokenizers.
"""

from __future__ import annotations

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4  # role markers and separators a chat template adds around each message


def estimate_text_tokens(text: str) -> int:
    """Tokens in ``text``, estimated from its length."""
    return -(-len(text) // CHARS_PER_TOKEN)


def estimate_chat_tokens(texts: list[str]) -> int:
    """Tokens of a chat prompt whose messages carry ``texts``."""
    return sum(estimate_text_tokens(t) for t in texts) + TOKENS_PER_MESSAGE * len(texts)
