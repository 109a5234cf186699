"""Console page: the policy.

The active document by section, its policy tests and its history (with rollback); structured
forms for the common edits (a tier's limits, a model's fallback chain, a cache rule) and a YAML
editor, all of which produce a *candidate* that is validated as it is typed and reviewed (diff
against the active version, policy tests) before it is published. Publishing and rolling back go
through the same code as the admin API (:mod:`switchyard.admin.policy_api`), as the console user.
With ``policy_source=file`` the page is read-only and every write is refused (409).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import anyio.to_thread
from litestar import get, post
from litestar.datastructures import FormMultiDict
from litestar.params import FromPath
from litestar.plugins.htmx import HTMXRequest, HTMXTemplate
from litestar.response import Redirect, Response, Template
from sqlmodel import Session

from switchyard.admin.common import in_db
from switchyard.admin.policy_api import policy_file_state, refuse_in_file_mode, write_version
from switchyard.admin.session import console_origin, current_user
from switchyard.decide.policy_tests import PolicyTestResult, compile_checked, run_policy_tests
from switchyard.gateway.errors import ApiError
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.policy import PolicyError, PolicyIssue, compile_policy
from switchyard.policy.diff import PolicyDiff, diff_documents, plain_data
from switchyard.policy.edit import set_cache_rule, set_model_fallback, set_tier_limits
from switchyard.policy.export import MergedText
from switchyard.policy.load import parse_yaml
from switchyard.policy.schema import Limits
from switchyard.store import errors as store_errors
from switchyard.store.models import PolicyVersionPublic
from switchyard.store.policy_versions import active_version, list_versions, publish, rollback

#: Versions the history lists.
HISTORY = 20
#: How validation messages name the document being edited.
CANDIDATE = "<candidate>"

PAGE = "admin/policy.html.j2"
EDITOR = "admin/policy_edit.html.j2"
REFUSED = "admin/policy_refused.html.j2"
VALIDATION = "admin/partials/_policy_validation.html.j2"
FORMS = {
    "tier-limits": "admin/partials/_policy_tier_limits_form.html.j2",
    "fallback": "admin/partials/_policy_fallback_form.html.j2",
    "cache-rule": "admin/partials/_policy_cache_rule_form.html.j2",
}
#: Blank steps offered after a model's fallback chain, to add to it.
SPARE_STEPS = 2
_LIST_SPLIT = re.compile(r"[\s,]+")


# --- checking a candidate ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Check:
    """A candidate document against the policy gate and the active version."""

    valid: bool
    issues: list[PolicyIssue]
    sha256: str | None
    tests: list[PolicyTestResult] | None  # None: the document does not compile, so no test ran
    diff: PolicyDiff | None  # None: not YAML, or no active version
    active_label: str | None

    @property
    def failed_tests(self) -> int:
        return sum(not t.passed for t in self.tests or [])


def check_candidate(session: Session, text: str) -> Check:
    """Validate ``text`` through the same gate as a publish, run its tests and diff it against the
    active version; writes nothing."""
    issues: list[PolicyIssue] = []
    try:
        snapshot = compile_checked(text, CANDIDATE)
    except PolicyError as error:
        issues = error.issues
        try:  # a failing policy test still compiles: show every test's outcome
            snapshot = compile_policy(text, CANDIDATE)
        except PolicyError:
            snapshot = None
    row = active_version(session)
    diff: PolicyDiff | None = None
    if row is not None:
        try:
            diff = diff_documents(row.yaml_text, text, f"v{row.number}", "candidate")
        except PolicyError:
            diff = None
    return Check(valid=not issues, issues=issues, sha256=snapshot.sha256 if snapshot and not issues else None,
                 tests=run_policy_tests(snapshot) if snapshot is not None else None, diff=diff,
                 active_label=f"v{row.number}" if row is not None else None)


def _text_of(form: FormMultiDict) -> str:
    """The submitted document, with the line ends browsers give a textarea (CRLF) made plain again."""
    return str(form.get("yaml", "")).replace("\r\n", "\n").replace("\r", "\n")


def _active_text(session: Session) -> str:
    row = active_version(session)
    if row is None:
        raise store_errors.NotFound("no policy version has been recorded yet")
    return row.yaml_text


# --- what the page shows -------------------------------------------------------------------------

def _can_write(request: HTMXRequest) -> bool:
    runtime: GatewayRuntime = request.app.state.runtime
    return runtime.settings.policy_source != "file" and current_user(request).may("operator")


def fmt_duration(seconds: float | None) -> str:
    """Seconds as the document would say them: ``10m``, ``1h``, ``90s``, ``250ms``."""
    if seconds is None:
        return "—"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


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


def _base_context(request: HTMXRequest) -> dict[str, Any]:
    runtime: GatewayRuntime = request.app.state.runtime
    return {"settings": runtime.settings, "snapshot": runtime.policy.snapshot,
            "file_mode": runtime.settings.policy_source == "file", "can_write": _can_write(request),
            # the candidate-check view's replay panel (pages.policy_replay): operators, drafts in file mode too
            "can_replay": current_user(request).may("operator"),
            "fmt_duration": fmt_duration, "fmt_value": fmt_value}


async def _file_state(runtime: GatewayRuntime) -> dict[str, Any] | None:
    if runtime.settings.policy_source != "file":
        return None
    file = await anyio.to_thread.run_sync(policy_file_state, runtime.settings)
    return {**file, "matches": file["sha256"] == runtime.policy.snapshot.sha256}


@get("/policy", name="admin:policy", include_in_schema=False)
async def policy_page(request: HTMXRequest) -> Template:
    """The active document by section, its tests, the edit forms and the history."""
    runtime: GatewayRuntime = request.app.state.runtime
    snapshot = runtime.policy.snapshot
    query = request.query_params

    def read(session: Session) -> dict[str, Any]:
        row = active_version(session)
        text = row.yaml_text if row is not None else snapshot.text
        return {"versions": list_versions(session, HISTORY), "tests": run_policy_tests(snapshot),
                **_forms_context(text, query)}

    context = _base_context(request) | await in_db(runtime, read)
    document = snapshot.document
    context |= {
        "file": await _file_state(runtime),
        "notes": _notes(query),
        "policy_error": runtime.policy.last_error,
        "policy_error_source": runtime.policy.error_source,
        "resilience": _flatten(document.resilience.model_dump(mode="json")),
        "priority_rows": [(name, cls, snapshot.engine_priority[name]) for name, cls in document.priorities.items()],
    }
    return Template(template_name=PAGE, context=context)


@get("/policy/forms/{kind:str}", include_in_schema=False, opt={"role": "operator"})
async def policy_form(request: HTMXRequest, kind: FromPath[str]) -> Template:
    """One edit form, for the tier, model or cache rule the query names (htmx swaps it in on a change)."""
    if kind not in FORMS:
        return _refused(request, 404, f"there is no {kind!r} form")
    runtime: GatewayRuntime = request.app.state.runtime
    query = request.query_params
    context = await in_db(runtime, lambda session: _forms_context(_active_text(session), query))
    return HTMXTemplate(template_name=FORMS[kind], context=_base_context(request) | context)


# --- the editor -----------------------------------------------------------------------------------

async def _editor(request: HTMXRequest, text: str, *, heading: str = "Edit the policy", message: str = "",
                  note: str | None = None, refused: str | None = None, status: int = 200) -> Template:
    """The editor and review view of a candidate: its text, validation, diff and tests."""
    runtime: GatewayRuntime = request.app.state.runtime
    check = await in_db(runtime, lambda session: check_candidate(session, text))
    context = _base_context(request) | {
        "text": text, "check": check, "heading": heading, "message": message, "note": note, "refused": refused,
        "file": await _file_state(runtime),
    }
    return Template(template_name=EDITOR, context=context, status_code=status)


def _refused(request: HTMXRequest, status: int, reason: str, issues: list[PolicyIssue] | None = None) -> Template:
    return Template(template_name=REFUSED, status_code=status,
                    context=_base_context(request) | {"reason": reason, "issues": issues or []})


@get("/policy/edit", include_in_schema=False)
async def policy_editor(request: HTMXRequest) -> Template:
    """The YAML editor on the active version's text."""
    runtime: GatewayRuntime = request.app.state.runtime
    text = await in_db(runtime, _active_text)
    return await _editor(request, text)


@post("/policy/validate", include_in_schema=False, status_code=200)
async def policy_validate(request: HTMXRequest) -> Template:
    """Check a candidate (writes nothing): the validation partial for htmx, else the whole editor."""
    form = await request.form()
    text = _text_of(form)
    if not request.htmx:
        return await _editor(request, text, message=str(form.get("message", "")))
    runtime: GatewayRuntime = request.app.state.runtime
    check = await in_db(runtime, lambda session: check_candidate(session, text))
    return HTMXTemplate(template_name=VALIDATION, context=_base_context(request) | {"check": check})


# --- structured edits: a candidate, never a publish ------------------------------------------------

def _number(text: str) -> int | float | str | None:
    """A form field as YAML would read it: empty is ``None``, numbers are numbers, anything else stays
    text (and the validation says what is wrong with it, where)."""
    text = text.strip()
    if not text:
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def _names_list(text: str) -> list[str] | None:
    names = [n for n in _LIST_SPLIT.split(text.strip()) if n]
    return names or None


async def _edit(request: HTMXRequest, edit: Callable[[str], MergedText], heading: str, message: str) -> Template:
    runtime: GatewayRuntime = request.app.state.runtime
    try:
        refuse_in_file_mode(runtime)
        active = await in_db(runtime, _active_text)
    except ApiError as error:
        return _refused(request, error.status_code, error.message)
    try:
        merged = edit(active)
    except PolicyError as error:  # it names what is not there
        return _refused(request, 404, "the edit could not be applied to the active version", error.issues)
    note = "Not published yet: review the candidate below, then publish it."
    if not merged.kept_layout:
        note += " (The document's comments and layout could not be kept for this edit.)"
    return await _editor(request, merged.text, heading=heading, message=message, note=note)


@post("/policy/edit/tier-limits", include_in_schema=False, status_code=200, opt={"role": "operator"})
async def edit_tier_limits(request: HTMXRequest) -> Template:
    """A candidate with one tier's ``limits`` changed (an empty field removes that limit)."""
    form = await request.form()
    tier = str(form.get("tier", ""))
    limits = {name: _number(str(form.get(name, ""))) for name in Limits.model_fields}
    return await _edit(request, lambda text: set_tier_limits(text, tier, limits),
                       f"Review: limits of tier {tier}", f"tier {tier}: limits")


@post("/policy/edit/fallback", include_in_schema=False, status_code=200, opt={"role": "operator"})
async def edit_fallback(request: HTMXRequest) -> Template:
    """A candidate with one model's fallback chain replaced (in the order given; blank steps dropped)."""
    form = await request.form()
    model = str(form.get("model", ""))
    chain = [s for s in (str(v).strip() for v in form.getall("fallback", [])) if s]
    return await _edit(request, lambda text: set_model_fallback(text, model, chain),
                       f"Review: fallback chain of model {model}", f"model {model}: fallback")


@post("/policy/edit/cache-rule", include_in_schema=False, status_code=200, opt={"role": "operator"})
async def edit_cache_rule(request: HTMXRequest) -> Template:
    """A candidate with one cache rule's main fields changed (an empty field takes the default)."""
    form = await request.form()
    rule = str(form.get("rule", ""))
    if not rule.isdigit():
        return _refused(request, 400, "choose a cache rule")
    index = int(rule)
    fields = {"mode": str(form.get("mode", "")).strip() or None, "ttl": _number(str(form.get("ttl", ""))),
              "scope": str(form.get("scope", "")).strip() or None,
              "min_similarity": _number(str(form.get("min_similarity", ""))),
              "embedding_pool": str(form.get("embedding_pool", "")).strip() or None}
    match = {key: _names_list(str(form.get(f"match_{key}", ""))) for key in ("models", "routes", "tiers")}
    return await _edit(request, lambda text: set_cache_rule(text, index, fields, match),
                       f"Review: cache rule #{index + 1}", f"cache rule #{index + 1}")


# --- writes -----------------------------------------------------------------------------------------

def _done(row: PolicyVersionPublic, created: bool, what: str) -> Redirect:
    key = what if created else "unchanged"
    return Redirect(path=f"/admin/policy?{key}={row.number}", status_code=303)


@post("/policy/publish", include_in_schema=False, status_code=200, opt={"role": "operator"})
async def policy_publish(request: HTMXRequest) -> Response[Any]:
    """Publish a candidate as the console user; an invalid one is refused (422) and nothing is written."""
    runtime: GatewayRuntime = request.app.state.runtime
    form = await request.form()
    text, message = _text_of(form), str(form.get("message", "")).strip()
    actor, origin = console_origin(request)

    def write(session: Session) -> tuple[PolicyVersionPublic, bool]:
        return publish(session, text, source="console", author=actor, message=message, origin=origin,
                       document=CANDIDATE)

    try:
        refuse_in_file_mode(runtime)
        row, created = await write_version(runtime, write)
    except ApiError as error:
        if error.status_code == 409:
            return _refused(request, error.status_code, error.message)
        return await _editor(request, text, message=message, refused=error.message, status=error.status_code)
    except PolicyError as error:
        count = len(error.issues)
        return await _editor(request, text, message=message, status=422,
                             refused=f"Not published: the candidate has {count} issue{'s' if count != 1 else ''}; "
                                     "nothing was written.")
    return _done(row, created, "published")


@post("/policy/rollback", include_in_schema=False, status_code=200, opt={"role": "operator"})
async def policy_rollback(request: HTMXRequest) -> Response[Any]:
    """Make an earlier version's content active again, as a new version by the console user."""
    runtime: GatewayRuntime = request.app.state.runtime
    form = await request.form()
    version = str(form.get("version", ""))
    message = str(form.get("message", "")).strip() or None
    if not version.isdigit():
        return _refused(request, 400, "choose a version to roll back to")
    actor, origin = console_origin(request)

    def write(session: Session) -> tuple[PolicyVersionPublic, bool]:
        return rollback(session, int(version), author=actor, message=message, origin=origin)

    try:
        refuse_in_file_mode(runtime)
        row, created = await write_version(runtime, write)
    except ApiError as error:
        return _refused(request, error.status_code, error.message)
    except PolicyError as error:
        return _refused(request, 422, f"v{version} no longer passes the policy gate; nothing was written",
                        error.issues)
    return _done(row, created, "rolled_back")


ROUTES: list[Any] = [policy_page, policy_form, policy_editor, policy_validate, edit_tier_limits, edit_fallback,
                     edit_cache_rule, policy_publish, policy_rollback]
