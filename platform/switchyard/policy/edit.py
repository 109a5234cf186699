"""Structured edits of a policy document's text (a tier's limits, a model's fallback chain, a cache
rule) that keep what the operator wrote: comments, key order and layout.

An edit changes the document as plain data and lays the result back onto the original text with
:func:`switchyard.policy.export.merge_onto`, so only the edited values change in the text. The
result is a *candidate*: it is not validated here (an edit may well make the document invalid,
and the caller shows why).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic_core import PydanticUndefined
from ruamel.yaml import YAML

from switchyard.policy.cache_rules import CacheRule
from switchyard.policy.diff import plain_data
from switchyard.policy.errors import PolicyError, PolicyIssue
from switchyard.policy.export import MergedText, merge_onto
from switchyard.policy.load import parse_yaml

#: Top-level sections of named items, and how one item is called in messages.
_KINDS = {"tiers": "tier", "models": "model"}

Document = dict[str, Any]
_NO_DEFAULT = object()
#: A cache rule's plain default values (a form that shows them sends them back: they are not written).
_CACHE_RULE_DEFAULTS = {name: field.default for name, field in CacheRule.model_fields.items()
                        if field.default_factory is None and field.default is not PydanticUndefined}


def edit_text(text: str, change: Callable[[Document], None], source: str = "<policy>") -> MergedText:
    """``text`` with ``change`` applied to its parsed content, laid onto the original text.

    Raises:
        PolicyError: the text is not a YAML mapping, or ``change`` refers to what is not there.
    """
    data = plain_data(parse_yaml(text, source))
    if not isinstance(data, dict):
        raise PolicyError([PolicyIssue("", "the document is not a YAML mapping", 1, source)])
    change(data)
    return merge_onto(text, dump_yaml(data), source)


def dump_yaml(data: Any) -> str:
    """Plain data as block-style YAML, keys in their order."""
    yaml = YAML(typ="rt")
    yaml.default_flow_style = False
    yaml.width = 4096
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


def named_item(data: Document, section: str, name: str) -> dict[str, Any]:
    """The item called ``name`` of the top-level list ``section`` (``tiers``, ``models``).

    Raises:
        PolicyError: there is no such item.
    """
    items = data.get(section)
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and item.get("name") == name:
            return item
    kind = _KINDS.get(section, section)
    raise PolicyError([PolicyIssue(section, f"there is no {kind} {name!r}")])


def update_mapping(target: dict[str, Any], changes: Mapping[str, Any],
                   defaults: Mapping[str, Any] | None = None) -> None:
    """Set each key of ``changes`` on ``target``; a ``None`` value removes the key (the default applies).

    A key absent from ``target`` whose new value is its default (``defaults``) stays absent. Keys
    already there keep their place; new ones go last, in the order of ``changes``.
    """
    for key, value in changes.items():
        if value is None:
            target.pop(key, None)
        elif key in target or (defaults or {}).get(key, _NO_DEFAULT) != value:
            target[key] = value


def _set_or_drop(item: dict[str, Any], key: str, value: dict[str, Any] | list[Any]) -> None:
    if value:
        item[key] = value
    else:
        item.pop(key, None)


def set_tier_limits(text: str, tier: str, limits: Mapping[str, Any]) -> MergedText:
    """Change fields of tier ``tier``'s ``limits`` (``None``: remove the field, i.e. unlimited)."""
    def change(data: Document) -> None:
        item = named_item(data, "tiers", tier)
        current = item.get("limits")
        merged = dict(current) if isinstance(current, dict) else {}
        update_mapping(merged, limits)
        _set_or_drop(item, "limits", merged)

    return edit_text(text, change)


def set_model_fallback(text: str, model: str, fallback: Sequence[str]) -> MergedText:
    """Replace model ``model``'s fallback chain (in order; empty removes it)."""
    def change(data: Document) -> None:
        _set_or_drop(named_item(data, "models", model), "fallback", list(fallback))

    return edit_text(text, change)


def set_cache_rule(text: str, index: int, fields: Mapping[str, Any], match: Mapping[str, Any]) -> MergedText:
    """Change fields of cache rule ``index`` (0-based) and of its ``match`` (``None`` removes a field).

    Raises:
        PolicyError: there is no such cache rule.
    """
    def change(data: Document) -> None:
        rules = data.get("cache")
        if not isinstance(rules, list) or not 0 <= index < len(rules) or not isinstance(rules[index], dict):
            raise PolicyError([PolicyIssue("cache", f"there is no cache rule #{index + 1}")])
        rule: dict[str, Any] = rules[index]
        update_mapping(rule, fields, _CACHE_RULE_DEFAULTS)
        current = rule.get("match")
        merged = dict(current) if isinstance(current, dict) else {}
        update_mapping(merged, match)
        if merged:
            rule["match"] = merged
        else:
            rule.pop("match", None)

    return edit_text(text, change)
