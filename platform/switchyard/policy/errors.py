"""Policy errors that name their place in the YAML: path, line and file."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Loc = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class PolicyIssue:
    """One thing wrong with a policy document."""

    path: str
    message: str
    line: int | None = None
    source: str = "<policy>"

    def __str__(self) -> str:
        where = f" ({self.source}:{self.line})" if self.line is not None else f" ({self.source})"
        return f"{self.path or '<document>'}: {self.message}{where}"

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape used by the CLI and the admin API."""
        return {"path": self.path, "message": self.message, "line": self.line, "source": self.source}


class PolicyError(Exception):
    """A policy document was rejected; ``issues`` says every reason found."""

    def __init__(self, issues: Sequence[PolicyIssue]) -> None:
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


def _is_map(node: Any) -> bool:
    return isinstance(node, dict)


def _is_seq(node: Any) -> bool:
    return isinstance(node, list)


def locate(raw: Any, loc: Loc) -> tuple[str, int | None]:
    """Render ``loc`` as a readable path over the raw YAML tree and find its line (1-based).

    List items that carry a ``name`` are shown by name (``tiers[free]``), others by index. Parts
    of ``loc`` that do not exist in the raw tree (pydantic's union tags, a missing key) end the
    walk: the line is then that of the deepest node that exists.
    """
    path = ""
    node = raw
    line: int | None = 1 if raw is not None else None
    for part in loc:
        if isinstance(part, int) and _is_seq(node) and 0 <= part < len(node):
            item = node[part]
            label = item.get("name") if _is_map(item) else None
            path += f"[{label}]" if isinstance(label, str) and label else f"[{part}]"
            line = _line_of_item(node, part, line)
            node = item
        elif isinstance(part, str) and _is_map(node):
            path += f".{part}" if path else part
            if part in node:
                line = _line_of_key(node, part, line)
                node = node[part]
            else:
                node = None
        else:
            # A pydantic tag (e.g. 'function-after[...]') or a step past a scalar.
            if isinstance(part, int):
                path += f"[{part}]"
            continue
    return path, line


def _line_of_key(mapping: Any, key: str, default: int | None) -> int | None:
    lc = getattr(mapping, "lc", None)
    if lc is None:
        return default
    try:
        return int(lc.key(key)[0]) + 1
    except (KeyError, TypeError, AttributeError):
        return default


def _line_of_item(seq: Any, index: int, default: int | None) -> int | None:
    lc = getattr(seq, "lc", None)
    if lc is None:
        return default
    try:
        return int(lc.item(index)[0]) + 1
    except (KeyError, TypeError, AttributeError, IndexError):
        return default


def issues_at(raw: Any, source: str, found: Iterable[tuple[Loc, str]]) -> list[PolicyIssue]:
    """Turn ``(loc, message)`` pairs into located issues, in document order."""
    issues = []
    for loc, message in found:
        path, line = locate(raw, loc)
        issues.append(PolicyIssue(path=path, message=message, line=line, source=source))
    return sorted(issues, key=lambda i: (i.line or 0, i.path))
