"""Console page: the policy editor, and the writes.

The YAML editor and the structured edits (a tier's limits, a model's fallback chain, a cache rule)
produce a *candidate* that is validated as it is typed and reviewed (diff against the active
version, policy tests) before it is published; nothing here publishes but ``/policy/publish`` and
``/policy/canary/start`` (publish as canary: a slice of traffic tries the candidate first, see
:mod:`switchyard.admin.pages.policy_canary`). Publishing and rolling back go through the same code
as the admin API (:mod:`switchyard.admin.policy_api`), as the console user. With
``policy_source=file`` every write is refused (409).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from litestar import get, post
from litestar.datastructures import FormMultiDict
from litestar.di import NamedDependency
from litestar.plugins.htmx import HTMXRequest, HTMXTemplate
from litestar.response import Redirect, Response, Template
from sqlmodel import Session

from switchyard.admin.common import in_db
from switchyard.admin.dependencies import PolicyChanged
from switchyard.admin.pages.policy import (
    PAGES_DEPENDENCY,
    PolicyPages,
    active_text,
    base_context,
    file_state,
    refused_page,
    running_canary,
)
from switchyard.admin.pages.policy_canary import CanaryForm, rollout_words
from switchyard.admin.policy_api import refuse_in_file_mode, write_version
from switchyard.admin.session import console_origin
from switchyard.api.errors import ApiError
from switchyard.decide.policy_tests import PolicyTestResult, compile_checked, policy_warnings, run_policy_tests
from switchyard.policy import PolicyError, PolicyIssue, compile_policy
from switchyard.policy.diff import PolicyDiff, diff_documents
from switchyard.policy.edit import set_cache_rule, set_model_fallback, set_tier_limits
from switchyard.policy.export import MergedText
from switchyard.policy.tiers import Limits
from switchyard.store import canary as canary_store
from switchyard.store import errors as store_errors
from switchyard.store.db import in_transaction
from switchyard.store.models import PolicyVersionPublic
from switchyard.store.policy_versions import active_version, publish, rollback

#: How validation messages name the document being edited.
CANDIDATE = "<candidate>"

EDITOR = "admin/policy_edit.html.j2"
VALIDATION = "admin/partials/_policy_validation.html.j2"
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
    warnings: list[PolicyIssue] = field(default_factory=list)  # of a valid candidate: rules a tier can never take

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
                 active_label=f"v{row.number}" if row is not None else None,
                 warnings=policy_warnings(snapshot, CANDIDATE) if snapshot is not None and not issues else [])


def text_of(form: FormMultiDict) -> str:
    """The submitted document, with the line ends browsers give a textarea (CRLF) made plain again."""
    return str(form.get("yaml", "")).replace("\r\n", "\n").replace("\r", "\n")


# --- the editor -----------------------------------------------------------------------------------

async def _editor(request: HTMXRequest, pages: PolicyPages, text: str, *, heading: str = "Edit the policy",
                  message: str = "", note: str | None = None, refused: str | None = None,
                  status: int = 200, canary: CanaryForm | None = None, canary_error: str | None = None,
                  canary_open: bool = False) -> Template:
    """The editor and review view of a candidate: its text, validation, diff and tests; and the "publish as
    canary" fields (``canary``: as submitted, else the defaults; open when ``canary_open``)."""
    check, running = await in_db(pages.db, lambda session: (check_candidate(session, text), running_canary(session)))
    context = base_context(request, pages) | {
        "text": text, "check": check, "heading": heading, "message": message, "note": note, "refused": refused,
        "file": await file_state(pages), "canary_form": canary or CanaryForm(), "canary_error": canary_error,
        "canary_open": canary_open or canary_error is not None, "canary_running": running,
    }
    return Template(template_name=EDITOR, context=context, status_code=status)


@get("/policy/edit", include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def policy_editor(request: HTMXRequest, pages: NamedDependency[PolicyPages]) -> Template:
    """The YAML editor on the active version's text."""
    text = await in_db(pages.db, active_text)
    return await _editor(request, pages, text)


@post("/policy/validate", include_in_schema=False, status_code=200, dependencies=PAGES_DEPENDENCY)
async def policy_validate(request: HTMXRequest, pages: NamedDependency[PolicyPages]) -> Template:
    """Check a candidate (writes nothing): the validation partial for htmx, else the whole editor."""
    form = await request.form()
    text = text_of(form)
    if not request.htmx:
        return await _editor(request, pages, text, message=str(form.get("message", "")),
                             canary=CanaryForm.from_form(form))
    check = await in_db(pages.db, lambda session: check_candidate(session, text))
    return HTMXTemplate(template_name=VALIDATION, context=base_context(request, pages) | {"check": check})


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


async def _edit(request: HTMXRequest, pages: PolicyPages, edit: Callable[[str], MergedText], heading: str,
                message: str) -> Template:
    try:
        refuse_in_file_mode(pages.settings)
        active = await in_db(pages.db, active_text)
    except ApiError as error:
        return refused_page(request, pages, error.status_code, error.message)
    try:
        merged = edit(active)
    except PolicyError as error:  # it names what is not there
        return refused_page(request, pages, 404, "the edit could not be applied to the active version",
                            error.issues)
    note = "Not published yet: review the candidate below, then publish it."
    if not merged.kept_layout:
        note += " (The document's comments and layout could not be kept for this edit.)"
    return await _editor(request, pages, merged.text, heading=heading, message=message, note=note)


@post("/policy/edit/tier-limits", include_in_schema=False, status_code=200, opt={"role": "operator"},
      dependencies=PAGES_DEPENDENCY)
async def edit_tier_limits(request: HTMXRequest, pages: NamedDependency[PolicyPages]) -> Template:
    """A candidate with one tier's ``limits`` changed (an empty field removes that limit)."""
    form = await request.form()
    tier = str(form.get("tier", ""))
    limits = {name: _number(str(form.get(name, ""))) for name in Limits.model_fields}
    return await _edit(request, pages, lambda text: set_tier_limits(text, tier, limits),
                       f"Review: limits of tier {tier}", f"tier {tier}: limits")


@post("/policy/edit/fallback", include_in_schema=False, status_code=200, opt={"role": "operator"},
      dependencies=PAGES_DEPENDENCY)
async def edit_fallback(request: HTMXRequest, pages: NamedDependency[PolicyPages]) -> Template:
    """A candidate with one model's fallback chain replaced (in the order given; blank steps dropped)."""
    form = await request.form()
    model = str(form.get("model", ""))
    chain = [s for s in (str(v).strip() for v in form.getall("fallback", [])) if s]
    return await _edit(request, pages, lambda text: set_model_fallback(text, model, chain),
                       f"Review: fallback chain of model {model}", f"model {model}: fallback")


@post("/policy/edit/cache-rule", include_in_schema=False, status_code=200, opt={"role": "operator"},
      dependencies=PAGES_DEPENDENCY)
async def edit_cache_rule(request: HTMXRequest, pages: NamedDependency[PolicyPages]) -> Template:
    """A candidate with one cache rule's main fields changed (an empty field takes the default)."""
    form = await request.form()
    rule = str(form.get("rule", ""))
    if not rule.isdigit():
        return refused_page(request, pages, 400, "choose a cache rule")
    index = int(rule)
    fields = {"mode": str(form.get("mode", "")).strip() or None, "ttl": _number(str(form.get("ttl", ""))),
              "scope": str(form.get("scope", "")).strip() or None,
              "min_similarity": _number(str(form.get("min_similarity", ""))),
              "embedding_pool": str(form.get("embedding_pool", "")).strip() or None}
    match = {key: _names_list(str(form.get(f"match_{key}", ""))) for key in ("models", "routes", "tiers")}
    return await _edit(request, pages, lambda text: set_cache_rule(text, index, fields, match),
                       f"Review: cache rule #{index + 1}", f"cache rule #{index + 1}")


# --- writes -----------------------------------------------------------------------------------------

def _done(row: PolicyVersionPublic, created: bool, what: str) -> Redirect:
    key = what if created else "unchanged"
    return Redirect(path=f"/admin/policy?{key}={row.number}", status_code=303)


@post("/policy/publish", include_in_schema=False, status_code=200, opt={"role": "operator"},
      dependencies=PAGES_DEPENDENCY)
async def policy_publish(request: HTMXRequest, pages: NamedDependency[PolicyPages],
                         policy_changed: NamedDependency[PolicyChanged]) -> Response[Any]:
    """Publish a candidate as the console user; an invalid one is refused (422) and nothing is written."""
    form = await request.form()
    text, message = text_of(form), str(form.get("message", "")).strip()
    actor, origin = console_origin(request)

    def write(session: Session) -> tuple[PolicyVersionPublic, bool]:
        return publish(session, text, source="console", author=actor, message=message, origin=origin,
                       document=CANDIDATE)

    try:
        refuse_in_file_mode(pages.settings)
        row, created = await write_version(pages.db, policy_changed, write)
    except ApiError as error:
        if error.status_code == 409:
            return refused_page(request, pages, error.status_code, error.message)
        return await _editor(request, pages, text, message=message, refused=error.message,
                             status=error.status_code)
    except PolicyError as error:
        count = len(error.issues)
        return await _editor(request, pages, text, message=message, status=422,
                             refused=f"Not published: the candidate has {count} issue{'s' if count != 1 else ''}; "
                                     "nothing was written.")
    return _done(row, created, "published")


@post("/policy/rollback", include_in_schema=False, status_code=200, opt={"role": "operator"},
      dependencies=PAGES_DEPENDENCY)
async def policy_rollback(request: HTMXRequest, pages: NamedDependency[PolicyPages],
                          policy_changed: NamedDependency[PolicyChanged]) -> Response[Any]:
    """Make an earlier version's content active again, as a new version by the console user."""
    form = await request.form()
    version = str(form.get("version", ""))
    message = str(form.get("message", "")).strip() or None
    if not version.isdigit():
        return refused_page(request, pages, 400, "choose a version to roll back to")
    actor, origin = console_origin(request)

    def write(session: Session) -> tuple[PolicyVersionPublic, bool]:
        return rollback(session, int(version), author=actor, message=message, origin=origin)

    try:
        refuse_in_file_mode(pages.settings)
        row, created = await write_version(pages.db, policy_changed, write)
    except ApiError as error:
        return refused_page(request, pages, error.status_code, error.message)
    except PolicyError as error:
        return refused_page(request, pages, 422,
                            f"v{version} no longer passes the policy gate; nothing was written", error.issues)
    return _done(row, created, "rolled_back")


@post("/policy/canary/start", include_in_schema=False, status_code=200, opt={"role": "operator"},
      dependencies=PAGES_DEPENDENCY)
async def policy_canary_start(request: HTMXRequest, pages: NamedDependency[PolicyPages],
                              policy_changed: NamedDependency[PolicyChanged]) -> Response[Any]:
    """Publish a candidate as a canary, as the console user: stored as a version that is not active, served to
    the slice the form describes next to the active version (``store.canary.start``). An invalid rollout or
    candidate, or a canary running already, re-shows the editor saying why; nothing is written then."""
    form = await request.form()
    text, message = text_of(form), str(form.get("message", "")).strip()
    fields = CanaryForm.from_form(form)
    try:
        refuse_in_file_mode(pages.settings)
    except ApiError as error:
        return refused_page(request, pages, error.status_code, error.message)
    try:
        rollout = fields.rollout()
    except ValueError as error:  # pydantic's ValidationError too
        return await _editor(request, pages, text, message=message, canary=fields, status=400,
                             canary_error=f"The rollout is not valid: {rollout_words(error)}.",
                             refused="Not started: the canary's rollout is not valid (see below); nothing was written.")
    actor, origin = console_origin(request)

    def start(session: Session) -> int:
        row = canary_store.start(session, rollout, author=actor, origin=origin, text=text, source="console",
                                 message=message, document=CANDIDATE)
        assert row.id is not None
        return row.id

    try:
        canary_id = await in_transaction(pages.db, start)
    except PolicyError as error:
        count = len(error.issues)
        return await _editor(request, pages, text, message=message, canary=fields, canary_open=True, status=422,
                             refused=f"Not started: the candidate has {count} issue{'s' if count != 1 else ''}; "
                                     "nothing was written.")
    except store_errors.StoreError as error:
        conflict = isinstance(error, store_errors.Conflict)  # a canary runs, or this is the active content
        return await _editor(request, pages, text, message=message, canary=fields, canary_open=True,
                             status=409 if conflict else 400, refused=f"Not started: {error}. Nothing was written.")
    await policy_changed()  # this process follows at once; the others hear it on the policy channel
    return Redirect(path=f"/admin/policy/canary?started={canary_id}", status_code=303)


ROUTES: list[Any] = [policy_editor, policy_validate, edit_tier_limits, edit_fallback,
                     edit_cache_rule, policy_publish, policy_rollback, policy_canary_start]
