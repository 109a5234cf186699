"""The admin JSON API of the policy: versions, diff, validation, publish, rollback and the audit log.

Reads are open, like the rest of ``/admin/api``. Writes (publish, rollback) need the admin token
until the console's sessions and roles land: ``Authorization: Bearer <SWITCHYARD_ADMIN_TOKEN>``;
with no token configured, writes are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.openapi.spec import OpenAPIType, Schema
from litestar.params import PathParameter, QueryParameter
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.admin import openapi_docs as docs
from switchyard.admin.common import in_db, json_body, origin_of
from switchyard.admin.dependencies import PolicyChanged
from switchyard.api.errors import ApiError, BadRequest
from switchyard.api.openapi import admin_operation, json_request_body, obj, ok
from switchyard.decide.policy_tests import compile_checked, policy_warnings
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.policy import PolicyError, policy_sha256, read_policy_file
from switchyard.policy.diff import diff_documents
from switchyard.settings import Settings
from switchyard.store import errors as store_errors
from switchyard.store.audit import list_events
from switchyard.store.models import PolicyVersion, PolicyVersionPublic
from switchyard.store.policy_versions import MAX_AUTHOR, active_version, get_version, list_versions, publish, rollback

Limit = Annotated[int, QueryParameter(ge=1, le=500, description="How many, newest first.")]
#: The largest id (a version number, a key's id) the database's integer columns hold: a larger one is refused
#: here, before it reaches a driver that cannot bind it.
MAX_ID = 2**31 - 1
Id = Annotated[int, PathParameter(ge=1, le=MAX_ID)]
#: Who made a change, for the audit log (whose column holds no more).
Author = Annotated[str, msgspec.Meta(max_length=MAX_AUTHOR)] | None
_VERSION_REF = r"^(active|v?[0-9]+)$"
ROLLBACK_BODY = json_request_body(obj({"version": Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=MAX_ID),
                                      "message": Schema(type=[OpenAPIType.STRING, OpenAPIType.NULL], max_length=1000),
                                      "author": docs.AUTHOR},
                                     ["version"], extra=False))


class Conflict(ApiError):
    """The request clashes with how this gateway is run (a write while the file is the truth)."""

    status_code = 409
    type = "invalid_request_error"
    code = "conflict"


class ValidateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A document to check."""

    yaml: str


class PublishRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A document to publish."""

    yaml: str
    message: str = ""
    author: Author = None


class RollbackRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A version whose content becomes active again."""

    #: A JSON number (``5`` or ``5.0``: JSON, and its schema, do not tell them apart), whole.
    version: Annotated[float, msgspec.Meta(ge=1, le=MAX_ID)]
    message: str | None = None
    author: Author = None


def _meta(row: PolicyVersion | PolicyVersionPublic) -> dict[str, Any]:
    return PolicyVersionPublic.model_validate(row).model_dump(mode="json")


def _rejected(error: PolicyError) -> Response[dict[str, Any]]:
    """422 with every issue (path, line, message): the document was not accepted."""
    count = len(error.issues)
    message = f"the policy was rejected ({count} issue{'s' if count != 1 else ''}); nothing was written"
    return Response({"error": {"message": message, "type": "invalid_request_error", "param": None,
                               "code": "invalid_policy"},
                     "issues": [i.as_dict() for i in error.issues]}, status_code=422)


def refuse_in_file_mode(settings: Settings) -> None:
    """Raise :class:`Conflict` when the policy file is the truth (``policy_source=file``)."""
    if settings.policy_source == "file":
        raise Conflict(f"policy_source is file: {settings.policy_file} is the truth, so the policy changes only "
                       "through that file", code="policy_source_is_file")


Written = tuple[PolicyVersionPublic, bool]


async def write_version(db: Engine, policy_changed: PolicyChanged, write: Callable[[Session], Written]) -> Written:
    """Publish (or roll back) through ``write``; returns the active version and whether it is new.

    This process switches over before returning (``policy_changed``); the other replicas hear of the
    version through the store (NOTIFY on PostgreSQL, and their poll).

    Raises:
        PolicyError: the document is invalid (nothing written).
    """
    row, created = await in_db(db, write)
    if created:
        await policy_changed()
    return row, created


async def _write_version(db: Engine, policy_changed: PolicyChanged,
                         write: Callable[[Session], tuple[PolicyVersionPublic, bool]]) -> Response[dict[str, Any]]:
    """Publish (or roll back) through ``write``: 201 with the new version, 200 when its content was
    already active, 422 with every issue when it is invalid (nothing written)."""
    try:
        row, created = await write_version(db, policy_changed, write)
    except PolicyError as error:
        return _rejected(error)
    return Response({"created": created, "version": _meta(row)}, status_code=201 if created else 200)


def _version_ref(session: Session, ref: str) -> tuple[str, str]:
    """The label and text of ``active`` or a version number (``7`` or ``v7``)."""
    if ref == "active":
        row = active_version(session)
        if row is None:
            raise store_errors.NotFound("no policy version has been recorded yet")
    else:
        digits = ref.removeprefix("v")
        if not (digits.isascii() and digits.isdigit()):  # (str.isdigit alone takes '²', which int() refuses)
            raise store_errors.StoreError(f"{ref!r} is not a version: give a number (7 or v7) or 'active'")
        number = int(digits)
        if not 1 <= number <= MAX_ID:
            raise store_errors.NotFound(f"no policy version {number}")
        row = get_version(session, number)
    return f"v{row.number}", row.yaml_text


@get("/policy", operation_id="adminPolicy",
     operation_class=admin_operation(ok("The active version, and what this process serves.", docs.POLICY),
                                     404))
async def policy_overview(settings: NamedDependency[Settings], db: NamedDependency[Engine],
                          policy: NamedDependency[PolicyHolder]) -> dict[str, Any]:
    """The active version (metadata and text), what this process serves, and drift from the file."""

    def read(session: Session) -> dict[str, Any]:
        row = active_version(session)
        if row is None:
            raise store_errors.NotFound("no policy version has been recorded yet")
        file = policy_file_state(settings) if settings.policy_source == "file" else None
        return {"active": _meta(row), "text": row.yaml_text, "file": file}

    found = await in_db(db, read)
    snapshot = policy.snapshot
    file = found["file"]
    return {
        "policy_source": settings.policy_source,
        "version": found["active"],
        "text": found["text"],
        "serving": {"version": snapshot.label, "sha256": snapshot.sha256},
        "file": file,
        "matches_file": None if file is None else file["sha256"] == found["active"]["sha256"],
        "rejected": _rejected_state(policy),
    }


def policy_file_state(settings: Settings) -> dict[str, Any]:
    """The policy file: its path, and its sha256 or why it cannot be read (blocking: call off the loop)."""
    file: dict[str, Any] = {"path": str(settings.policy_file), "sha256": None, "error": None}
    try:
        file["sha256"] = policy_sha256(read_policy_file(settings.policy_file))
    except PolicyError as error:
        file["error"] = str(error)
    return file


def _rejected_state(holder: PolicyHolder) -> dict[str, Any] | None:
    """The document this process last rejected (where from, every issue), if one is outstanding."""
    if holder.last_error is None:
        return None
    return {"source": holder.error_source, "issues": [i.as_dict() for i in holder.last_error.issues]}


@get("/policy/versions", operation_id="adminPolicyVersions",
     operation_class=admin_operation(ok("Versions, newest first.", docs.VERSIONS), 400))
async def versions(db: NamedDependency[Engine], limit: Limit = 50) -> dict[str, Any]:
    """Versions, newest first."""
    rows = await in_db(db, lambda s: list_versions(s, limit))
    return {"versions": [_meta(r) for r in rows]}


@get("/policy/versions/{number:int}", operation_id="adminPolicyVersion",
     operation_class=admin_operation(ok("The version and its text.", docs.VERSION_WITH_TEXT), 400, 404))
async def version(db: NamedDependency[Engine], number: Id) -> dict[str, Any]:
    """One version: metadata and its YAML text."""
    def read(session: Session) -> dict[str, Any]:
        row = get_version(session, number)
        return {**_meta(row), "text": row.yaml_text}

    return await in_db(db, read)


@get("/policy/diff", operation_id="adminPolicyDiff",
     operation_class=admin_operation(ok("What changes.", docs.DIFF), 400, 404))
async def diff(db: NamedDependency[Engine],
               from_: Annotated[str, QueryParameter(name="from", schema_extra={"pattern": _VERSION_REF})],
               to: Annotated[str, QueryParameter(name="to", schema_extra={"pattern": _VERSION_REF})] = "active",
               ) -> dict[str, Any]:
    """What changes from version ``from`` to version ``to`` (numbers, or ``active``)."""
    def compare(session: Session) -> dict[str, Any]:
        (old_label, old_text), (new_label, new_text) = _version_ref(session, from_), _version_ref(session, to)
        return {"from": old_label, "to": new_label,
                **diff_documents(old_text, new_text, old_label, new_label).as_dict()}

    return await in_db(db, compare)


async def _document(request: Request[Any, Any, Any]) -> str:
    """The YAML a request carries: the body itself, or ``{"yaml": ...}`` as JSON."""
    if request.content_type[0] == "application/json":
        return (await json_body(request, ValidateRequest)).yaml
    try:
        return (await request.body()).decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the policy document is not UTF-8 text") from None


@post("/policy/validate", operation_id="adminPolicyValidate", status_code=200,
      operation_class=admin_operation(ok("Whether the document is valid, and why not.", docs.VALIDATION),
                                      400, 413, body=docs.VALIDATE_BODY))
async def validate(request: Request[Any, Any, Any], db: NamedDependency[Engine]) -> dict[str, Any]:
    """Check a document (schema, references, policy tests) without writing anything.

    The body is the YAML itself or ``{"yaml": ...}``. A valid document comes back with what
    publishing it would change from the active version.
    """
    text = await _document(request)

    def check(session: Session) -> dict[str, Any]:
        snapshot = compile_checked(text, "<request>")
        row = active_version(session)
        changes = None
        if row is not None:
            changes = list(diff_documents(row.yaml_text, text, f"v{row.number}", "<request>").changes)
        return {"valid": True, "issues": [], "sha256": snapshot.sha256, "changes_from_active": changes,
                "warnings": [w.as_dict() for w in policy_warnings(snapshot, "<request>")]}

    try:
        return await in_db(db, check)
    except PolicyError as error:
        return {"valid": False, "issues": [i.as_dict() for i in error.issues]}


@post("/policy/versions", operation_id="adminPolicyPublish",
      operation_class=admin_operation(docs.WRITTEN_RESPONSES, 400, 409, 413, 422, body=docs.PUBLISH_BODY))
async def publish_version(request: Request[Any, Any, Any], settings: NamedDependency[Settings],
                          db: NamedDependency[Engine],
                          policy_changed: NamedDependency[PolicyChanged]) -> Response[dict[str, Any]]:
    """Validate a document and make it the active version (201; 200 when it is the active content).

    The body: ``{"yaml": "<the document>", "message": "why", "author": "who"}``. An invalid
    document is answered 422 with every issue (path, line, message), and nothing is written.
    """
    refuse_in_file_mode(settings)
    data = await json_body(request, PublishRequest)
    origin = origin_of(request)

    def write(session: Session) -> tuple[PolicyVersionPublic, bool]:
        return publish(session, data.yaml, source="api", author=data.author or "api", message=data.message,
                       origin=origin, document="<request>")

    return await _write_version(db, policy_changed, write)


@post("/policy/rollback", operation_id="adminPolicyRollback",
      operation_class=admin_operation(docs.WRITTEN_RESPONSES, 400, 404, 409, 413, 422, body=ROLLBACK_BODY))
async def rollback_version(request: Request[Any, Any, Any], settings: NamedDependency[Settings],
                           db: NamedDependency[Engine],
                           policy_changed: NamedDependency[PolicyChanged]) -> Response[dict[str, Any]]:
    """Make an earlier version's content active again, as a new version (201; 200 when it already is).

    The body: ``{"version": 5, "message": "why", "author": "who"}``.
    """
    refuse_in_file_mode(settings)
    data = await json_body(request, RollbackRequest)
    if not data.version.is_integer():
        raise BadRequest(f"version must be a whole number, got {data.version}", param="version")
    number = int(data.version)
    origin = origin_of(request)

    def write(session: Session) -> tuple[PolicyVersionPublic, bool]:
        return rollback(session, number, author=data.author or "api", message=data.message, origin=origin)

    return await _write_version(db, policy_changed, write)


@get("/policy/audit", operation_id="adminPolicyAudit",
     operation_class=admin_operation(ok("The policy's audit entries, newest first.", docs.EVENTS), 400))
async def audit(db: NamedDependency[Engine], limit: Limit = 50) -> dict[str, Any]:
    """The policy's entries in the audit log, newest first."""
    rows = await in_db(db, lambda s: list_events(s, limit, action="policy."))
    return {"events": [r.model_dump(mode="json") for r in rows]}


ROUTES = [policy_overview, versions, version, diff, validate, publish_version, rollback_version, audit]
