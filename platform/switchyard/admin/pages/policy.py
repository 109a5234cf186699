"""Console page: the policy, as read.

The active document by section, its policy tests, its history (with rollback) and the structured
forms for the common edits (a tier's limits, a model's fallback chain, a cache rule), each of which
posts to the editor (:mod:`switchyard.admin.pages.policy_edit`): the candidate is reviewed there
before it is published. With ``policy_source=file`` the page is read-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import anyio.to_thread
from litestar import get
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery
from litestar.plugins.htmx import HTMXRequest, HTMXTemplate
from litestar.response import Template
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from switchyard.admin.common import in_db
from switchyard.admin.policy_api import policy_file_state
from switchyard.admin.session import current_user
from switchyard.decide.policy_tests import run_policy_tests
from switchyard.figures import duration
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.policy import PolicyIssue
from switchyard.policy.diff import diff_documents, plain_data
from switchyard.policy.load import parse_yaml
from switchyard.policy.tiers import Limits
from switchyard.settings import Settings
from switchyard.store import canary as canary_store
from switchyard.store import errors as store_errors
from switchyard.store.models import PolicyVersion, PolicyVersionPublic
from switchyard.store.policy_versions import active_version, get_version, list_versions

#: Versions the history lists.
HISTORY = 20

PAGE = "admin/policy.html.j2"
VERSION_PAGE = "admin/policy_version.html.j2"
REFUSED = "admin/policy_refused.html.j2"
FORMS = {
    "tier-limits": "admin/partials/_policy_tier_limits_form.html.j2",
    "fallback": "admin/partials/_policy_fallback_form.html.j2",
    "cache-rule": "admin/partials/_policy_cache_rule_form.html.j2",
}
#: Blank steps offered after a model's fallback chain, to add to it.
SPARE_STEPS = 2


@dataclass(frozen=True, slots=True)
class PolicyPages:
    """What the policy pages read (injected as ``pages``, made of the console's own dependencies)."""

    settings: NamedDependency[Settings]
    policy: NamedDependency[PolicyHolder]
    db: NamedDependency[Engine]


#: The ``dependencies`` of a policy page's handler: its :class:`PolicyPages`.
PAGES_DEPENDENCY = {"pages": Provide(PolicyPages, sync_to_thread=False)}


def active_text(session: Session) -> str:
    """The active version's YAML text (what the forms and the editor start from)."""
    row = active_version(session)
    if row is None:
        raise store_errors.NotFound("no policy version has been recorded yet")
    return row.yaml_text


def running_canary(session: Session) -> dict[str, Any] | None:
    """The running policy canary in a few words (this page's banner, the editor's note); None when none runs.
    Its panel is :mod:`switchyard.admin.pages.policy_canary`."""
    row = canary_store.running(session)
    if row is None:
        return None
    rollout = canary_store.rollout_of(row)
    return {"id": row.id, "version": row.version, "base": row.base, "percent": row.percent, "step": row.step + 1,
            "steps": len(rollout.stages), "shadow": rollout.shadow, "by": rollout.by,
            "automatic": rollout.automatic}


# --- what the page shows -------------------------------------------------------------------------

def _can_write(request: HTMXRequest, settings: Settings) -> bool:
    return settings.policy_source != "file" and current_user(request).may("operator")


def fmt_duration(seconds: float | None) -> str:
    """Seconds as the document would say them (``10m``, ``1h``, ``90s``, ``250ms``); ``—`` for none."""
    return duration(seconds, missing="—")


def fmt_value(value: Any) -> str:
    """A setting's value in a table cell: lists joined, mappings as ``k=v``, booleans as YAML says them."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={fmt_value(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(fmt_value(v) for v in value) or "—"
    if isinstance(value, bool):
        return str(value).lower()
    return "—" if value is None else str(value)


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested settings as (dotted key, value) rows."""
    if isinstance(value, dict):
        rows: list[tuple[str, str]] = []
        for key, inner in value.items():
            rows += _flatten(inner, f"{prefix}.{key}" if prefix else str(key))
        return rows
    return [(prefix, fmt_value(value))]


def _shown(value: Any) -> str:
    """A raw YAML value as a form field's text."""
    if value is None:
        return ""
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def _is_integer(annotation: Any) -> bool:
    return annotation is int or any(_is_integer(arg) for arg in get_args(annotation))


def _named(raw: dict[str, Any], section: str) -> list[dict[str, Any]]:
    items = raw.get(section)
    return [i for i in items if isinstance(i, dict) and isinstance(i.get("name"), str)] if isinstance(
        items, list) else []


def _pick(names: list[str], wanted: str | None) -> str | None:
    return wanted if wanted in names else (names[0] if names else None)


def _tier_form(raw: dict[str, Any], wanted: str | None) -> dict[str, Any]:
    tiers = {t["name"]: t for t in _named(raw, "tiers")}
    tier = _pick(list(tiers), wanted)
    limits = tiers[tier].get("limits") if tier is not None else None
    limits = limits if isinstance(limits, dict) else {}
    fields = [{"name": name, "value": _shown(limits.get(name)), "integer": _is_integer(field.annotation)}
              for name, field in Limits.model_fields.items()]
    return {"tiers": list(tiers), "tier": tier, "fields": fields}


def _fallback_form(raw: dict[str, Any], wanted: str | None) -> dict[str, Any]:
    models = {m["name"]: m for m in _named(raw, "models")}
    model = _pick(list(models), wanted)
    chain = models[model].get("fallback") if model is not None else None
    steps = [str(s) for s in chain] if isinstance(chain, list) else []
    regions = [str(r) for r in raw.get("regions") or []]
    targets = [t for name in models for t in [name, *(f"{name}@{r}" for r in regions)]]
    return {"models": list(models), "model": model, "steps": [*steps, *[""] * SPARE_STEPS], "targets": targets}


def _rule_label(index: int, rule: dict[str, Any]) -> str:
    if rule.get("name"):
        return f"#{index + 1} {rule['name']}"
    match = rule.get("match") if isinstance(rule.get("match"), dict) else {}
    what = "; ".join(f"{k}: {_shown(v)}" for k, v in (match or {}).items()) or "every request"
    return f"#{index + 1} {rule.get('mode', 'exact')} · {what}"


def _cache_form(raw: dict[str, Any], wanted: str | None) -> dict[str, Any] | None:
    rules = [r for r in raw.get("cache") or [] if isinstance(r, dict)]
    if not rules:
        return None
    index = int(wanted) if wanted is not None and wanted.isdigit() and int(wanted) < len(rules) else 0
    rule = rules[index]
    match = rule.get("match") if isinstance(rule.get("match"), dict) else {}
    values = {key: _shown(rule.get(key)) for key in ("mode", "ttl", "scope", "min_similarity", "embedding_pool")}
    values |= {f"match_{key}": _shown((match or {}).get(key)) for key in ("models", "routes", "tiers")}
    values["mode"] = values["mode"] or "exact"
    values["scope"] = values["scope"] or "tenant"
    embed_pools = [p["name"] for p in _named(raw, "pools") if p.get("task") == "embed"]
    return {"rules": [(i, _rule_label(i, r)) for i, r in enumerate(rules)], "rule": index, "values": values,
            "embed_pools": embed_pools}


def _raw_document(text: str) -> dict[str, Any]:
    raw = plain_data(parse_yaml(text, "<active>"))
    return raw if isinstance(raw, dict) else {}


def _forms_context(text: str, query: Any) -> dict[str, Any]:
    raw = _raw_document(text)
    return {"tier_form": _tier_form(raw, query.get("tier")),
            "fallback_form": _fallback_form(raw, query.get("model")),
            "cache_form": _cache_form(raw, query.get("rule"))}


def _notes(query: Any) -> list[str]:
    notes = []
    for key, say in (("published", "Published v{}: it is now the active version."),
                     ("rolled_back", "Rolled back: v{} is now the active version."),
                     ("unchanged", "Nothing was published: that content is already the active version (v{}).")):
        value = query.get(key)
        if value is not None and value.isdigit():
            notes.append(say.format(value))
    return notes


def base_context(request: HTMXRequest, pages: PolicyPages) -> dict[str, Any]:
    """What every policy page's template is given: settings, the active snapshot, what the user may do."""
    settings = pages.settings
    return {"settings": settings, "snapshot": pages.policy.snapshot,
            "file_mode": settings.policy_source == "file", "can_write": _can_write(request, settings),
            # the candidate-check view's replay panel (pages.policy_replay): operators, drafts in file mode too
            "can_replay": current_user(request).may("operator"),
            "fmt_duration": fmt_duration, "fmt_value": fmt_value}


async def file_state(pages: PolicyPages) -> dict[str, Any] | None:
    """With ``policy_source=file``: the file's state and whether it matches the active version; else None."""
    if pages.settings.policy_source != "file":
        return None
    file = await anyio.to_thread.run_sync(policy_file_state, pages.settings)
    return {**file, "matches": file["sha256"] == pages.policy.snapshot.sha256}


@get("/policy", name="admin:policy", include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def policy_page(request: HTMXRequest, pages: NamedDependency[PolicyPages]) -> Template:
    """The active document by section, its tests, the edit forms and the history."""
    snapshot = pages.policy.snapshot
    query = request.query_params

    def read(session: Session) -> dict[str, Any]:
        row = active_version(session)
        text = row.yaml_text if row is not None else snapshot.text
        versions = list_versions(session, HISTORY)
        return {"versions": versions, "same_as": same_as_earlier(versions), "tests": run_policy_tests(snapshot),
                "canary": running_canary(session), **_forms_context(text, query)}

    context = base_context(request, pages) | await in_db(pages.db, read)
    document = snapshot.document
    context |= {
        "file": await file_state(pages),
        "notes": _notes(query),
        "policy_error": pages.policy.last_error,
        "policy_error_source": pages.policy.error_source,
        "resilience": _flatten(document.resilience.model_dump(mode="json")),
        "priority_rows": [(name, cls, snapshot.engine_priority[name]) for name, cls in document.priorities.items()],
    }
    return Template(template_name=PAGE, context=context)


@get("/policy/forms/{kind:str}", include_in_schema=False, opt={"role": "operator"}, dependencies=PAGES_DEPENDENCY)
async def policy_form(request: HTMXRequest, pages: NamedDependency[PolicyPages], kind: FromPath[str]) -> Template:
    """One edit form, for the tier, model or cache rule the query names (htmx swaps it in on a change)."""
    if kind not in FORMS:
        return refused_page(request, pages, 404, f"there is no {kind!r} form")
    query = request.query_params
    context = await in_db(pages.db, lambda session: _forms_context(active_text(session), query))
    return HTMXTemplate(template_name=FORMS[kind], context=base_context(request, pages) | context)


def refused_page(request: HTMXRequest, pages: PolicyPages, status: int, reason: str,
                 issues: list[PolicyIssue] | None = None) -> Template:
    """The page that says why a form or an edit was refused (and the issues, where the policy gate gave some)."""
    return Template(template_name=REFUSED, status_code=status,
                    context=base_context(request, pages) | {"reason": reason, "issues": issues or []})


def same_as_earlier(versions: list[PolicyVersionPublic]) -> dict[int, int]:
    """For each listed version whose content equals an earlier version's, the first such earlier number."""
    first: dict[str, int] = {}
    same: dict[int, int] = {}
    for v in sorted(versions, key=lambda v: v.number):
        if v.sha256 in first:
            same[v.number] = first[v.sha256]
        else:
            first[v.sha256] = v.number
    return same


@get("/policy/versions/{number:int}", name="admin:policy-version", include_in_schema=False,
     dependencies=PAGES_DEPENDENCY)
async def policy_version_page(request: HTMXRequest, pages: NamedDependency[PolicyPages],
                              number: FromPath[int], against: FromQuery[int | None] = None) -> Template:
    """One version: who made it and why, its YAML, and its changes from its parent (or from version ``against``);
    whether it equals an earlier version's content."""
    def read(session: Session) -> dict[str, Any] | None:
        try:
            row = get_version(session, number)
        except store_errors.NotFound:
            return None
        base_number = against if against is not None else row.parent
        base = None
        if base_number is not None:
            try:
                base = get_version(session, base_number)
            except store_errors.NotFound:
                base = None
        earlier = session.exec(select(PolicyVersion.number).where(PolicyVersion.sha256 == row.sha256,
                                                                   col(PolicyVersion.number) < number)
                               .order_by(col(PolicyVersion.number))).first()
        current = active_version(session)
        return {"version": PolicyVersionPublic.model_validate(row), "text": row.yaml_text, "same_as": earlier,
                "base": PolicyVersionPublic.model_validate(base) if base is not None else None,
                "diff": diff_documents(base.yaml_text, row.yaml_text, f"v{base.number}", f"v{number}")
                if base is not None else None,
                "active_number": current.number if current is not None else None}

    found = await in_db(pages.db, read)
    if found is None:
        return refused_page(request, pages, 404, f"there is no policy version {number}")
    return Template(template_name=VERSION_PAGE, context=base_context(request, pages) | found)


ROUTES: list[Any] = [policy_page, policy_form, policy_version_page]
