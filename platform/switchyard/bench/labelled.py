"""The labelled prompt set shipped with the benchmarks (``bench/data/auto_prompts.jsonl``), read for ``bench``.

Each line is one request written for Switchyard: its last user message, an optional system prompt,
how many messages the conversation has, whether it carries tools or asks for JSON, a realistic
answer length, a label (``easy``, or ``hard`` when it needs a strong model) and a split (``train``:
what the difficulty classifier's weights were fitted on; ``test``: never used in fitting).

The offline fitting tool (``switchyard.whatif.difficulty_fit``) reads the set through this module too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Literal

Label = Literal["easy", "hard"]
Split = Literal["train", "test"]


@dataclass(frozen=True, slots=True)
class LabelledPrompt:
    """One line of the labelled prompt set.

    Attributes:
        id: Unique, ``<label>-<category>-<n>``.
        label: ``hard`` when it needs a strong model.
        split: ``train`` (fitting) or ``test`` (reported only).
        prompt: The last user message.
        system: The system prompt, if any.
        messages: Messages in the conversation (the system prompt counts as one).
        tools: Whether the request carries tools.
        json_mode: Whether it asks for a JSON response.
        output_tokens: A realistic length of the answer.
    """

    id: str
    label: Label
    split: Split
    prompt: str
    system: str | None = None
    messages: int = 1
    tools: bool = False
    json_mode: bool = False
    output_tokens: int = 100

    @property
    def hard(self) -> bool:
        """Whether it is labelled hard."""
        return self.label == "hard"


def default_prompts_path() -> Path:
    """The labelled set shipped inside the package."""
    return Path(str(files("switchyard"))) / "bench" / "data" / "auto_prompts.jsonl"


def load_prompts(path: Path | None = None) -> list[LabelledPrompt]:
    """The labelled prompt set at ``path`` (default: :func:`default_prompts_path`).

    Raises:
        ValueError: A line is not a valid entry (the message names the line).
    """
    path = path or default_prompts_path()
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            entry = LabelledPrompt(
                id=str(row["id"]), label=row["label"], split=row["split"], prompt=str(row["prompt"]),
                system=row.get("system"), messages=int(row.get("messages", 1)), tools=bool(row.get("tools", False)),
                json_mode=bool(row.get("json_mode", False)), output_tokens=int(row["output_tokens"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a labelled prompt ({exc})") from exc
        if entry.label not in ("easy", "hard") or entry.split not in ("train", "test"):
            raise ValueError(f"{path}:{number}: label must be easy or hard and split train or test")
        out.append(entry)
    return out


@dataclass(frozen=True, slots=True)
class Quality:
    """How a classifier does on a set of prompts (NaN where a figure has no denominator)."""

    n: int
    accuracy: float
    precision: float
    recall: float

    @classmethod
    def of(cls, predicted_hard: Sequence[bool], hard: Sequence[bool]) -> Quality:
        """Accuracy, and precision and recall for ``hard``."""
        pairs = list(zip(predicted_hard, hard, strict=True))
        tp = sum(p and h for p, h in pairs)
        fp = sum(p and not h for p, h in pairs)
        fn = sum(h and not p for p, h in pairs)
        right = sum(p == h for p, h in pairs)
        n = len(pairs)
        return cls(n, right / n if n else math.nan, tp / (tp + fp) if tp + fp else math.nan,
                   tp / (tp + fn) if tp + fn else math.nan)
