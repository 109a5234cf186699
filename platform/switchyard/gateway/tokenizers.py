"""The models' tokenizers, read from the local ``tokenizer.json`` files a policy names, once per file.

A policy's ``models[].tokenizer`` names a local file (relative to the policy file's folder), or
``switchyard-sim``: the simulated engines' stand-in tokenizer (:mod:`switchyard.simtext`); when a
policy is loaded (at start-up and on every reload, never on the request path) each model gets a
:class:`~switchyard.decide.tokens.TokenCounter` with its tokenizer, through a :class:`TokenizerCache` the
process keeps, which reads each file once (again only if it changes). Nothing is ever downloaded:
only ``Tokenizer.from_file`` is used. A file that cannot be used is a policy error at its YAML location.
"""

from __future__ import annotations

import errno
import functools
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar, cast

from tokenizers import Tokenizer

from switchyard.decide.tokens import ESTIMATE, TokenCounter
from switchyard.policy.errors import Loc, PolicyError, issues_at
from switchyard.policy.fleet import SIM_TOKENIZER
from switchyard.policy.load import parse_yaml
from switchyard.policy.snapshot import PolicySnapshot

T = TypeVar("T")


class TokenizerError(ValueError):
    """A tokenizer file cannot be used; the message names the file and why."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot load tokenizer {path}: {reason}")


class TokenizerCache:
    """Tokenizers by file, each read once per process (again only if the file changes).

    The process keeps one (the gateway in its lifespan) and hands it to every policy load, so
    a reload that names the same files reads none of them again. Safe to share between threads.
    """

    def __init__(self) -> None:
        self._loaded: dict[Path, tuple[tuple[int, int], Tokenizer]] = {}
        self._made: dict[tuple[str, Path], tuple[tuple[int, int], object]] = {}
        self._lock = threading.Lock()

    def made_from(self, path: Path, kind: str, make: Callable[[Path], T]) -> T:
        """What ``make`` makes of the file at ``path`` (a chat template, …), made once per version of the file.

        Args:
            path: The file.
            kind: What ``make`` makes (files are cached per kind: one file may be read two ways).
            make: Reads the file; its exceptions propagate, and nothing is cached then.

        Raises:
            OSError: The file is missing or not a file (``strerror`` says which).
        """
        path = path.absolute()
        stat = path.stat()
        if not path.is_file():
            raise IsADirectoryError(errno.EISDIR, "not a file", str(path))
        real = path.resolve()
        stamp = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            cached = self._made.get((kind, real))
            if cached is not None and cached[0] == stamp:
                return cast(T, cached[1])
        made = make(real)
        with self._lock:
            self._made[(kind, real)] = (stamp, made)
        return made

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


class SimTokenCounter(TokenCounter):
    """Counts with the simulated engines' stand-in tokenizer (``tokenizer: switchyard-sim``), as they count."""

    __slots__ = ("_per_message", "_per_prompt", "_tokenize")

    def __init__(self) -> None:
        super().__init__()
        # Imported when a policy names it: the stand-in tokenizer builds its tables on import (~10 ms).
        from switchyard.simtext.chat import render_chat
        from switchyard.simtext.tokens import tokenize
        self._tokenize = tokenize
        # The simulator's template around each message (a user's) and once per prompt (BOS, assistant header).
        one, two = (len(render_chat([{"role": "user", "content": ""}] * n)) for n in (1, 2))
        self._per_message, self._per_prompt = two - one, 2 * one - two

    @property
    def exact(self) -> bool:
        return True

    def count_text(self, text: str) -> int:
        return 1 + len(self._tokenize(text))  # the begin-of-text token the simulator puts first, as vLLM does

    def count_chat(self, texts: Sequence[str]) -> int:
        content = sum(len(self._tokenize(t)) for t in texts)
        return content + self._per_message * len(texts) + self._per_prompt


@functools.cache
def sim_counter() -> SimTokenCounter:
    """The counter of a model whose tokenizer is the simulator's (one per process)."""
    return SimTokenCounter()


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
        if model.tokenizer == SIM_TOKENIZER:
            counters[model.name] = sim_counter()
            continue
        try:
            counters[model.name] = TokenCounter(cache.get(resolve_tokenizer_path(model.tokenizer, base_dir)))
        except TokenizerError as exc:
            failed.append((("models", i, "tokenizer"), str(exc)))
    if failed:
        raise PolicyError(issues_at(parse_yaml(snapshot.text, source), source, failed))
    return counters
