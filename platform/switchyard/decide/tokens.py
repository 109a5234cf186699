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

Reading a ``tokenizer.json`` is the one piece of I/O in ``decide``: it happens when a policy is
loaded (:func:`load_token_counters`, called by whoever loads the policy, never on the request
path), through a :class:`TokenizerCache` the process keeps, which reads each file once. Nothing is
ever downloaded: only ``Tokenizer.from_file`` is used.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from switchyard.policy.errors import Loc, PolicyError, issues_at
from switchyard.policy.load import parse_yaml
from switchyard.policy.snapshot import PolicySnapshot

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


class TokenizerError(ValueError):
    """A tokenizer file cannot be used; the message names the file and why."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot load tokenizer {path}: {reason}")


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


class TokenizerCache:
    """Tokenizers by file, each read once per process (again only if the file changes).

    The process keeps one (the gateway in its lifespan) and hands it to every policy load, so
    a reload that names the same files reads none of them again. Safe to share between threads.
    """

    def __init__(self) -> None:
        self._loaded: dict[Path, tuple[tuple[int, int], Tokenizer]] = {}
        self._lock = threading.Lock()

    def get(self, path: Path) -> Tokenizer:
        """The tokenizer in the ``tokenizer.json`` at ``path``.

        Raises:
            TokenizerError: The file is missing, unreadable or not a tokenizer.
        """
        path = path.absolute()
        try:
            stat = path.stat()
        except OSError as exc:
            raise TokenizerError(path, exc.strerror or str(exc)) from None
        if not path.is_file():
            raise TokenizerError(path, "not a file")
        # Keyed by the real file: a symlink switched to a new model's folder reads the new one.
        real = path.resolve()
        stamp = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            cached = self._loaded.get(real)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            try:
                tokenizer = Tokenizer.from_file(str(real))
            except Exception as exc:  # the library raises a bare Exception for every failure
                raise TokenizerError(path, f"not a valid tokenizer.json ({exc})") from None
            # A tokenizer.json may carry truncation or padding settings; either would make counts wrong.
            tokenizer.no_truncation()
            tokenizer.no_padding()
            self._loaded[real] = (stamp, tokenizer)
            return tokenizer


def resolve_tokenizer_path(path: str, base_dir: Path) -> Path:
    """Where a policy's ``tokenizer`` points: relative paths are taken from ``base_dir``."""
    candidate = Path(path)
    return candidate if candidate.is_absolute() else base_dir / candidate


def load_token_counters(snapshot: PolicySnapshot, base_dir: Path, cache: TokenizerCache,
                        source: str = "<policy>") -> dict[str, TokenCounter]:
    """A counter for every model of ``snapshot``: its tokenizer's, or :data:`ESTIMATE`.

    Args:
        snapshot: The policy whose models name their tokenizers.
        base_dir: The folder relative ``tokenizer`` paths are relative to (the policy file's).
        cache: The process's tokenizers, so that each file is read once.
        source: How errors name the policy (its file), as :func:`~switchyard.policy.compile_policy`.

    Raises:
        PolicyError: A tokenizer cannot be loaded; each issue names the model's ``tokenizer``
            field, its YAML line and the file.
    """
    counters: dict[str, TokenCounter] = {}
    failed: list[tuple[Loc, str]] = []
    for i, model in enumerate(snapshot.document.models):
        if model.tokenizer is None:
            counters[model.name] = ESTIMATE
            continue
        try:
            counters[model.name] = TokenCounter(cache.get(resolve_tokenizer_path(model.tokenizer, base_dir)))
        except TokenizerError as exc:
            failed.append((("models", i, "tokenizer"), str(exc)))
    if failed:
        raise PolicyError(issues_at(parse_yaml(snapshot.text, source), source, failed))
    return counters
