"""The ``cache`` scenario's FAQ questions: distinct questions from word lists, each with the rewordings
(case, punctuation, politeness) that a semantic cache at ``MIN_SIMILARITY`` should match, under the
simulator's embedding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from switchyard.sim.embeddings import embed_text

#: The semantic rule's ``min_similarity`` in the scenario's policy.
MIN_SIMILARITY = 0.8
#: Every pair of kept wordings of one question is at least this similar (a margin above MIN_SIMILARITY).
PARAPHRASE_FLOOR = 0.82
#: A question is kept only when each of its wordings is below this similarity to every other question's.
CROSS_LIMIT = 0.7
FAQ_OUTPUT_TOKENS = (32, 64)


_OPENERS = ("How do I", "How can I", "Where can I", "What is the way to", "Is there a way to", "Can I")
_VERBS = ("reset", "change", "update", "cancel", "renew", "transfer", "recover", "export", "delete", "share",
          "verify", "upgrade", "configure", "pause", "restore", "download", "merge", "rename", "lock", "archive")
_OBJECTS = ("password", "billing address", "subscription", "invoice", "payment card", "email address",
            "phone number", "order", "shipping label", "refund request", "gift card", "warranty", "delivery slot",
            "profile photo", "security questions", "two-factor login", "data plan", "router firmware",
            "backup codes", "loyalty points", "contact list", "calendar", "API token", "team seat",
            "storage quota", "printer driver", "parental controls", "voicemail", "tax receipt", "license key")
_PLACES = ("on my account", "in the mobile app", "from the web dashboard", "on my router", "for my family plan",
           "on the new laptop", "after moving abroad", "without the old phone", "for a business account",
           "before the trial ends", "on a shared tablet", "during checkout")


def rewordings(question: str) -> list[str]:
    """The canonical wording of ``question`` first, then its rewordings (case, punctuation, politeness)."""
    lower = question[:1].lower() + question[1:]
    return [question, question.rstrip("?").lower(), f"Please, {lower}", f"{question} Thanks!",
            f"Could you tell me: {lower}"]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors."""
    va, vb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norm = float(np.linalg.norm(va) * np.linalg.norm(vb))
    return float(va @ vb) / norm if norm else 0.0


@dataclass(frozen=True, slots=True)
class Question:
    """One FAQ question.

    Attributes:
        index: Its rank in popularity (0: the most asked).
        wordings: Its kept wordings, the canonical one first.
        max_tokens: The answer budget every wording is sent with (the semantic context includes it).
    """

    index: int
    wordings: tuple[str, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class QuestionSet:
    """The FAQ questions and how their wordings compare under the simulator's embedding.

    Attributes:
        questions: The questions, by popularity rank.
        paraphrase_min: The least cosine between two wordings of one question (1.0 with one wording each).
        cross_max: The greatest cosine between wordings of two different questions (0.0 with one question).
        dropped: Rewordings left out for falling below ``PARAPHRASE_FLOOR`` to another wording.
    """

    questions: tuple[Question, ...]
    paraphrase_min: float
    cross_max: float
    dropped: int


def _keep_wordings(candidates: Sequence[str], floor: float) -> tuple[list[str], np.ndarray[Any, Any], int]:
    """The canonical wording and every rewording at least ``floor`` similar to all kept before it."""
    kept: list[str] = []
    vectors: list[list[float]] = []
    for wording in candidates:
        vector = embed_text(wording)
        if all(cosine(vector, v) >= floor for v in vectors):
            kept.append(wording)
            vectors.append(vector)
    return kept, np.asarray(vectors, dtype=np.float64), len(candidates) - len(kept)


def faq_questions(count: int, seed: int, *, floor: float = PARAPHRASE_FLOOR, cross_limit: float = CROSS_LIMIT,
                  output_tokens: tuple[int, int] = FAQ_OUTPUT_TOKENS, max_tries: int = 20_000) -> QuestionSet:
    """``count`` distinct questions (the same for a seed), each with the wordings a semantic cache should match.

    A candidate question is drawn from the word lists; it is kept when every wording of it is below
    ``cross_limit`` cosine to every wording of the questions kept so far (so no two questions can be taken for
    each other at ``MIN_SIMILARITY``), with those of its rewordings that are at least ``floor`` similar to every
    other kept wording.

    Raises:
        ValueError: ``count`` distinct questions were not found in ``max_tries`` draws.
    """
    rng = np.random.default_rng(seed)
    questions: list[Question] = []
    matrices: list[np.ndarray[Any, Any]] = []
    dropped = tries = 0
    seen: set[str] = set()
    while len(questions) < count:
        tries += 1
        if tries > max_tries:
            raise ValueError(f"only {len(questions)} of {count} distinct questions in {max_tries} draws")
        draw = [int(rng.integers(len(words))) for words in (_OPENERS, _VERBS, _OBJECTS, _PLACES)]
        canonical = f"{_OPENERS[draw[0]]} {_VERBS[draw[1]]} the {_OBJECTS[draw[2]]} {_PLACES[draw[3]]}?"
        if canonical in seen:
            continue
        seen.add(canonical)
        kept, vectors, lost = _keep_wordings(rewordings(canonical), floor)
        if matrices and float((np.concatenate(matrices) @ vectors.T).max()) >= cross_limit:
            continue
        dropped += lost
        budget = int(rng.integers(output_tokens[0], output_tokens[1], endpoint=True))
        questions.append(Question(len(questions), tuple(kept), budget))
        matrices.append(vectors)
    within = [float((m @ m.T).min()) for m in matrices]
    cross = 0.0
    for i, m in enumerate(matrices[1:], 1):
        cross = max(cross, float((np.concatenate(matrices[:i]) @ m.T).max()))
    return QuestionSet(tuple(questions), min(within, default=1.0), cross, dropped)
