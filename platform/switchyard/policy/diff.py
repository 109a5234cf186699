"""What changed between two policy documents, said the way an operator thinks about them.

Documents are compared as parsed data, so a change of comments or layout alone is no semantic
change. Lists of named objects (pools, models, routes, tiers, and any list whose items all carry
a distinct ``name``) are matched by name, not by position: moving a tier is not a change of
every tier after it. The raw unified diff of the text comes alongside.
"""

from __future__ import annotations

import difflib
import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ruamel.yaml.scalarbool import ScalarBoolean

from switchyard.policy.load import parse_yaml

NO_SEMANTIC_CHANGE = "no semantic change"

#: Top-level sections whose items are named objects, and how one item is called.
_NAMED_SECTIONS = {"pools": "pool", "models": "model", "routes": "route", "tiers": "tier"}
#: Mappings whose key order is meaningful: priority classes are listed best first.
_ORDERED_MAPPINGS = frozenset({"priorities"})
_MAX_VALUE_CHARS = 100


@dataclass(frozen=True, slots=True)
class PolicyDiff:
    """The semantic changes between two documents and the unified diff of their text."""

    changes: tuple[str, ...]
    unified: str

    @property
    def semantic(self) -> bool:
        """Whether the documents differ in meaning (not only in comments or layout)."""
        return bool(self.changes)

    def lines(self) -> list[str]:
        """The change lines, or the single line ``no semantic change``."""
        return list(self.changes) or [NO_SEMANTIC_CHANGE]

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape used by the CLI and the admin API."""
        return {"semantic": self.semantic, "changes": list(self.changes), "unified": self.unified}


def plain_data(node: Any) -> Any:
    """ruamel's round-trip tree as plain ``dict``/``list``/``str``/``int``/``float``/``bool``."""
    if isinstance(node, Mapping):
        return {plain_data(k): plain_data(v) for k, v in node.items()}
    if isinstance(node, list):
        return [plain_data(v) for v in node]
    if isinstance(node, ScalarBoolean):
        return bool(node)
    for kind in (bool, int, float, str):
        if isinstance(node, kind):
            return kind(node)
    return node


def canonical(value: Any) -> str:
    """A string equal for two values exactly when they are the same data, key order included
    (``1``, ``1.0`` and ``true`` differ)."""
    return json.dumps(value, default=str)


def unified_diff(old_text: str, new_text: str, old_label: str = "vA", new_label: str = "vB") -> str:
    """The unified diff of two texts (empty when they are identical)."""
    lines = difflib.unified_diff(old_text.splitlines(), new_text.splitlines(), old_label, new_label, lineterm="")
    return "\n".join(lines)


def diff_documents(old_text: str, new_text: str, old_label: str = "vA", new_label: str = "vB") -> PolicyDiff:
    """Compare two policy documents.

    The documents need to be YAML, not valid policies: a candidate can be compared before it
    passes validation.

    Raises:
        PolicyError: a text is not YAML (located, named by its label).
    """
    old = plain_data(parse_yaml(old_text, old_label))
    new = plain_data(parse_yaml(new_text, new_label))
    return PolicyDiff(tuple(semantic_changes(old, new)), unified_diff(old_text, new_text, old_label, new_label))


def semantic_changes(old: Any, new: Any) -> list[str]:
    """The change lines from parsed document ``old`` to ``new``, in document order."""
    out: list[str] = []
    if not (isinstance(old, dict) and isinstance(new, dict)):
        _walk(old, new, "", out.append)
        return out
    for key in _union(old, new):
        o, n = old.get(key, _MISSING), new.get(key, _MISSING)
        if key == "regions" and _scalars(o) and _scalars(n):
            out += [f"regions: added {_fmt(r)}" for r in n if r not in o]
            out += [f"regions: removed {_fmt(r)}" for r in o if r not in n]
        elif key == "tests" and _list_or_missing(o) and _list_or_missing(n):
            out += _tests_line(o, n)
        elif key in _NAMED_SECTIONS and _names(o) is not None and _names(n) is not None:
            _named_items(o, n, _NAMED_SECTIONS[key], out.append)
        else:
            _walk(o, n, str(key), out.append)
    return out


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()
_Emit = Callable[[str], None]


def _union(old: dict[Any, Any], new: dict[Any, Any]) -> list[Any]:
    return list(old) + [k for k in new if k not in old]


def _scalars(value: Any) -> bool:
    return isinstance(value, list) and not any(isinstance(v, dict | list) for v in value)


def _list_or_missing(value: Any) -> bool:
    return value is _MISSING or isinstance(value, list)


def _names(value: Any) -> list[str] | None:
    """The item names of a list whose items are all mappings with a distinct string ``name``."""
    if value is _MISSING:
        return []
    return item_names(value) if isinstance(value, list) else None


def item_names(items: list[Any]) -> list[str] | None:
    """Each item's ``name`` when every item is a mapping with a distinct string ``name``, else None."""
    names: list[str] = []
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or name in names:
            return None
        names.append(name)
    return names


def _tests_line(old: Any, new: Any) -> list[str]:
    before = Counter(canonical(t) for t in ([] if old is _MISSING else old))
    after = Counter(canonical(t) for t in ([] if new is _MISSING else new))
    added, removed = sum((after - before).values()), sum((before - after).values())
    parts = [f"{n} {what}" for n, what in ((added, "added"), (removed, "removed")) if n]
    return [f"tests: {', '.join(parts)}"] if parts else []


def _named_items(old: Any, new: Any, kind: str, emit: _Emit) -> None:
    """Changes of a top-level section of named objects: ``tier free: limits.tokens_per_day 1 → 2``."""
    old_items = {} if old is _MISSING else {item["name"]: item for item in old}
    new_items = {} if new is _MISSING else {item["name"]: item for item in new}
    for name in _union(old_items, new_items):
        subject = f"{kind} {name}"
        if name not in new_items:
            emit(f"{subject}: removed")
        elif name not in old_items:
            emit(f"{subject}: added")
        else:
            _walk(old_items[name], new_items[name], "", _prefixed(emit, subject))


def _prefixed(emit: _Emit, subject: str) -> _Emit:
    return lambda line: emit(f"{subject}: {line}")


def _walk(old: Any, new: Any, path: str, emit: _Emit) -> None:
    """Emit the changes under ``path`` (dotted keys, ``[name]`` or ``[index]`` for list items)."""
    where = path or "value"
    if old is _MISSING:
        emit(f"{where}: added" + ("" if isinstance(new, dict) else f" {_fmt(new)}"))
    elif new is _MISSING:
        emit(f"{where}: removed" + ("" if isinstance(old, dict | list) else f" (was {_fmt(old)})"))
    elif isinstance(old, dict) and isinstance(new, dict):
        for key in _union(old, new):
            _walk(old.get(key, _MISSING), new.get(key, _MISSING), f"{path}.{key}" if path else str(key), emit)
        shared_old = [k for k in old if k in new]
        shared_new = [k for k in new if k in old]
        if path in _ORDERED_MAPPINGS and shared_old != shared_new:
            emit(f"{where}: order {_fmt(shared_old)} → {_fmt(shared_new)}")
    elif isinstance(old, list) and isinstance(new, list) and not (_scalars(old) and _scalars(new)):
        _list_items(old, new, path, emit)
    elif canonical(old) != canonical(new):
        emit(f"{where} {_fmt(old)} → {_fmt(new)}")


def _list_items(old: list[Any], new: list[Any], path: str, emit: _Emit) -> None:
    old_names, new_names = _names(old), _names(new)
    if old_names is not None and new_names is not None:
        old_items = dict(zip(old_names, old, strict=True))
        new_items = dict(zip(new_names, new, strict=True))
        for name in _union(old_items, new_items):
            _walk(old_items.get(name, _MISSING), new_items.get(name, _MISSING), f"{path}[{name}]", emit)
        shared_old = [n for n in old_names if n in new_items]
        shared_new = [n for n in new_names if n in old_items]
        if shared_old != shared_new:
            emit(f"{path}: order {_fmt(shared_old)} → {_fmt(shared_new)}")
        return
    for index in range(max(len(old), len(new))):
        o = old[index] if index < len(old) else _MISSING
        n = new[index] if index < len(new) else _MISSING
        _walk(o, n, f"{path}[{index}]", emit)


def _fmt(value: Any) -> str:
    """A value as a reader of YAML expects it: ``[a, b]``, ``{k: v}``, ``true``, ``null``."""
    if isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    elif isinstance(value, list):
        text = "[" + ", ".join(_fmt(v) for v in value) + "]"
    elif isinstance(value, str):
        text = json.dumps(value) if _needs_quotes(value) else value
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 1] + "…"


def _needs_quotes(text: str) -> bool:
    """Whether a string would read as something else unquoted (``"200000"``, ``"true"``, ``""``)."""
    if not text or text != text.strip() or text.lower() in {"true", "false", "null", "~", "yes", "no"}:
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True
