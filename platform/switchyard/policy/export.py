"""Write a policy version onto an operator's existing file, keeping what the operator wrote.

The new content is merged into the file's round-trip tree: mappings keep their keys, comments
and layout wherever the content did not change; changed values are replaced; removed keys and
items go; new ones take the place the new content gives them; list items with a ``name`` are
matched by name. The result is checked to parse to exactly the new content (key order
included); when it does not (say, an anchor shared by two places that now differ), the new text
is written as it is and the caller is told the layout could not be kept.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.util import load_yaml_guess_indent

from switchyard.policy.diff import canonical, item_names, plain_data
from switchyard.policy.errors import PolicyError, PolicyIssue
from switchyard.policy.load import parse_yaml

# A line holding only ``key:`` (its value is a block below it), and its indentation.
_BLOCK_KEY = re.compile(r"^( *)[^\s#\-][^#]*:\s*(#.*)?$")


@dataclass(frozen=True, slots=True)
class MergedText:
    """The text to write and whether the existing file's comments and layout were kept."""

    text: str
    kept_layout: bool


def merge_onto(existing_text: str, new_text: str, existing_name: str = "<existing>") -> MergedText:
    """The text of ``new_text``'s content laid onto ``existing_text``'s comments and key order.

    An existing file whose content is already the new one is returned unchanged.

    Raises:
        PolicyError: a text is not YAML, or the existing one is not a mapping.
    """
    new_plain = plain_data(parse_yaml(new_text, "<new>"))
    old_tree = parse_yaml(existing_text, existing_name)
    if not isinstance(old_tree, CommentedMap):
        raise PolicyError([PolicyIssue("", "the existing file is not a YAML mapping", 1, existing_name)])
    if canonical(plain_data(old_tree)) == canonical(new_plain):
        return MergedText(existing_text, kept_layout=True)
    yaml = _round_trip_yaml(existing_text)
    merged = _merge(yaml.load(existing_text), yaml.load(new_text))
    out = io.StringIO()
    yaml.dump(merged, out)
    text = out.getvalue()
    if canonical(plain_data(parse_yaml(text, "<merged>"))) != canonical(new_plain):
        return MergedText(new_text, kept_layout=False)
    return MergedText(text, kept_layout=True)


def _round_trip_yaml(text: str) -> YAML:
    """A round-trip dumper that writes with the indentation ``text`` uses."""
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap a line the operator wrote on one line
    _, sequence, offset = load_yaml_guess_indent(text)
    mapping = _mapping_indent(text)
    yaml.indent(mapping=mapping or 2, sequence=sequence or mapping or 2, offset=offset or 0)
    return yaml


def _mapping_indent(text: str) -> int | None:
    """How far a block mapping nested in a mapping is indented, from the first such pair of lines."""
    previous: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if previous is not None and not stripped.startswith("- ") and _BLOCK_KEY.match(previous):
            step = _indentation(line) - _indentation(previous)
            if step > 0:
                return step
        previous = line
    return None


def _indentation(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _merge(old: Any, new: Any) -> Any:
    """``new``'s content on ``old``'s nodes: returns the node to put where ``old`` was."""
    if isinstance(old, CommentedMap) and isinstance(new, CommentedMap):
        return _merge_mapping(old, new)
    if isinstance(old, CommentedSeq) and isinstance(new, CommentedSeq):
        return _merge_sequence(old, new)
    # Equal scalars keep the old node: its quoting and style are the operator's.
    return old if canonical(plain_data(old)) == canonical(plain_data(new)) else new


def _merge_mapping(old: CommentedMap, new: CommentedMap) -> CommentedMap:
    for key in [k for k in old if k not in new]:
        del old[key]
    for key, value in new.items():
        old[key] = _merge(old[key], value) if key in old else value
    if list(old) != list(new):
        for key in new:
            old.move_to_end(key)
    return old


def _merge_sequence(old: CommentedSeq, new: CommentedSeq) -> CommentedSeq:
    old_names, new_names = item_names(old), item_names(new)
    if old_names is None or new_names is None:
        for index, value in enumerate(new):
            if index < len(old):
                old[index] = _merge(old[index], value)
            else:
                old.append(value)
        del old[len(new):]
        return old
    # Named items: rebuild in the new order, each item carrying its old comments along.
    where = {name: index for index, name in enumerate(old_names)}
    items, comments = [], {}
    for index, (name, value) in enumerate(zip(new_names, new, strict=True)):
        if name in where:
            items.append(_merge(old[where[name]], value))
            if where[name] in old.ca.items:
                comments[index] = old.ca.items[where[name]]
        else:
            items.append(value)
    del old[:]
    old.extend(items)
    old.ca.items.clear()
    old.ca.items.update(comments)
    return old

