"""The admin JSON API of policy canaries: start one, read its status, promote it, abort it.

The same operations as ``switchyard policy canary`` (``store.canary`` carries them out). Starting a canary of a
new document stores that document as a version that is not active; in file mode (the policy file is the
truth) only a stored version can be rolled out here, since a new document must come through the file (its
``rollout:`` stanza).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.openapi.spec import OpenAPIType, Schema
from pydantic import ValidationError
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.admin import openapi_docs as docs
from switchyard.admin.common import in_db, json_body, origin_of
from switchyard.admin.dependencies import PolicyChanged
from switchyard.admin.policy_api import MAX_ID, Author, Conflict, _rejected
from switchyard.api.errors import BadRequest, NotFound
from switchyard.api.openapi import admin_operation, json_request_body, json_response, obj, ok
from switchyard.policy import PolicyError
from switchyard.policy.rollout import BODY_FIELDS, rollout_from_body
from switchyard.settings import Settings
from switchyard.store import canary as store
from switchyard.store import errors as store_errors
from switchyard.store.models import PolicyCanary

_ANY = Schema(type=OpenAPIType.OBJECT, additional_properties=True)
STATUS = obj({"id": Schema(type=OpenAPIType.INTEGER), "version": Schema(type=OpenAPIType.INTEGER),
              "status": Schema(type=OpenAPIType.STRING, enum=["running", "promoted", "rolled_back", "aborted"]),
              "percent": Schema(type=OpenAPIType.NUMBER), "figures": _ANY},
             ["id", "version", "status", "percent", "figures"], description="A canary, its figures side by side, "
             "the guardrails tested over its window and its next move.")
_NUMBER_OR_WORDS = Schema(one_of=[Schema(type=OpenAPIType.NUMBER), Schema(type=OpenAPIType.STRING)])
#: A rollout's fields, nested under ``rollout`` or at the top of the body.
_ROLLOUT_FIELDS: dict[str, Schema] = {
    "by": Schema(type=OpenAPIType.STRING, enum=["tenant", "key", "session", "request"]),
    "percent": Schema(type=OpenAPIType.NUMBER, description="Without steps: the share held until promoted or "
                      "aborted."),
    "steps": Schema(type=OpenAPIType.ARRAY, items=Schema(one_of=[
        Schema(type=OpenAPIType.OBJECT, additional_properties=True, description="{percent, hold}"),
        Schema(type=OpenAPIType.STRING, description="PERCENT:HOLD, e.g. 10:2m")])),
    "only": Schema(type=OpenAPIType.OBJECT, additional_properties=True, description="{tiers, regions, models}"),
    "guards": Schema(type=OpenAPIType.OBJECT, additional_properties=_NUMBER_OR_WORDS, description="ttft_p99, "
                     "cost_per_1k: a ratio (1.5 or '1.5x'); error_rate, shed_rate, rate_limited_rate: an increase "
                     "(0.01 or '+1%')."),
    "window": _NUMBER_OR_WORDS, "min_requests": Schema(type=OpenAPIType.INTEGER),
    "alpha": Schema(type=OpenAPIType.NUMBER), "shadow": Schema(type=OpenAPIType.BOOLEAN),
    "mode": Schema(type=OpenAPIType.STRING, enum=["canary", "shadow"]),
}
START_BODY = json_request_body(obj({
    "yaml": Schema(type=OpenAPIType.STRING, description="A new document to roll out (or give version)."),
    "version": Schema(type=OpenAPIType.INTEGER, minimum=1, maximum=MAX_ID, description="A stored version to roll "
                      "out."),
    "rollout": Schema(type=OpenAPIType.OBJECT, additional_properties=True, description="The policy document's "
                      "`rollout:` stanza: by, percent or steps [{percent, hold}], only {tiers, regions, models}, "
                      "guards, window, min_requests, alpha, shadow (or its fields at the top of the body)."),
    **_ROLLOUT_FIELDS,
    "message": docs.MESSAGE, "author": docs.AUTHOR}, extra=False))
ABORT_BODY = json_request_body(obj({"reason": Schema(type=OpenAPIType.STRING, max_length=1000),
                                    "author": docs.AUTHOR}, extra=False))


def _unprocessable(message: str, code: str, issues: list[tuple[str, str]]) -> Response[dict[str, Any]]:
    """422: a well-formed body whose rollout or candidate cannot be carried out (nothing was written); each
    issue with the path of the field in the body."""
    return Response({"error": {"message": message, "type": "invalid_request_error", "param": issues[0][0],
                               "code": code},
                     "issues": [{"path": path, "message": words, "line": None, "source": "<request>"}
                                for path, words in issues]}, status_code=422)


class StartRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A canary to start: the candidate, and its rollout nested (``rollout``) or as fields of the body."""

    rollout: dict[str, Any] | None = None
    yaml: str | None = None
    #: JSON numbers (``5`` or ``5.0``: JSON, and its schema, do not tell them apart), whole.
    version: Annotated[float, msgspec.Meta(ge=1, le=MAX_ID)] | None = None
    message: Annotated[str, msgspec.Meta(max_length=1000)] = ""
    author: Author = None
    by: str | None = None
    percent: float | None = None
    steps: list[Any] | None = None
    only: dict[str, Any] | None = None
    guards: dict[str, Any] | None = None
    window: float | str | None = None
    min_requests: float | None = None
    alpha: float | None = None
    shadow: bool | None = None
    mode: str | None = None

    def rollout_fields(self) -> dict[str, Any] | None:
        """The rollout as given (None: given both nested and flat)."""
        flat = {name: getattr(self, name) for name in BODY_FIELDS if getattr(self, name) is not None}
        if isinstance(flat.get("min_requests"), float) and flat["min_requests"].is_integer():
            flat["min_requests"] = int(flat["min_requests"])
        if self.rollout is not None:
            return None if flat else self.rollout
        return flat


class EndRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Who ends a canary, and why."""

    reason: Annotated[str, msgspec.Meta(max_length=1000)] = ""
    author: Author = None


async def _changed(db: Engine, policy_changed: PolicyChanged, work: Callable[[Session], dict[str, Any]]
                   ) -> dict[str, Any]:
    def conflicts_as_409(session: Session) -> dict[str, Any]:
        try:
            return work(session)
        except store_errors.Conflict as exc:
            raise Conflict(str(exc), code="canary_conflict") from None

    data = await in_db(db, conflicts_as_409)
    await policy_changed()  # this process follows at once; the others hear it on the policy channel
    return data


@get("/policy/canary", operation_id="adminPolicyCanary",
     operation_class=admin_operation(ok("The running canary, else the last one.", STATUS), 404))
async def canary_status(db: NamedDependency[Engine]) -> dict[str, Any]:
    """The running canary (else the last that ran): slice, figures side by side, guardrails, next move."""
    def read(session: Session) -> dict[str, Any] | None:
        found = store.status(session)
        return found.as_json() if found is not None else None

    data = await in_db(db, read)
    if data is None:
        raise NotFound("no canary has run")
    return data


@post("/policy/canary", operation_id="adminPolicyCanaryStart",
      operation_class=admin_operation({201: json_response("The canary runs (this process serves it already).",
                                                          STATUS)}, 400, 404, 409, 413, 422, body=START_BODY))
async def canary_start(request: Request[Any, Any, Any], settings: NamedDependency[Settings],
                       db: NamedDependency[Engine],
                       policy_changed: NamedDependency[PolicyChanged]) -> Response[dict[str, Any]]:
    """Start a canary of a new document (``yaml``) or a stored ``version`` next to the active version.

    The body: ``{"yaml": "...", "rollout": {"steps": [{"percent": 1, "hold": "1m"}, {"percent": 10,
    "hold": "2m"}], "guards": {"ttft_p99": 1.5, "error_rate": 0.01}}, "message": "why"}``, or the rollout's
    fields at the top (``{"version": 7, "percent": 5, "by": "key", "guards": {"error_rate": "+1%"}}``). 409
    while another canary runs; 422 when the rollout is invalid (``invalid_rollout``, what is wrong in the
    message), when both or neither of yaml and version are given (``invalid_candidate``), or with every issue
    when the document is invalid (``invalid_policy``).
    """
    data = await json_body(request, StartRequest)
    if data.version is not None and not data.version.is_integer():
        raise BadRequest(f"version must be a whole number, got {data.version}", param="version")
    if (data.yaml is None) == (data.version is None):
        return _unprocessable("give the candidate as yaml or as a stored version, one of them",
                              "invalid_candidate", [("yaml", "give yaml or version, one of them")])
    if data.yaml is not None and settings.policy_source == "file":
        raise Conflict(f"policy_source is file: a new document goes live through {settings.policy_file} (with a "
                       "rollout: stanza); here only a stored version can be rolled out", code="policy_source_is_file")
    fields = data.rollout_fields()
    if fields is None:
        return _unprocessable("give the rollout nested (rollout) or as fields of the body, not both",
                              "invalid_rollout", [("rollout", "given twice")])
    try:
        rollout = rollout_from_body(fields)
    except ValidationError as exc:
        issues = [(".".join(["rollout", *map(str, e["loc"])]), e["msg"]) for e in exc.errors()]
        return _unprocessable("invalid rollout: " + "; ".join(f"{p}: {m}" for p, m in issues), "invalid_rollout",
                              issues)
    except ValueError as exc:
        return _unprocessable(f"invalid rollout: {exc}", "invalid_rollout", [("rollout", str(exc))])
    origin = origin_of(request)

    def start(session: Session) -> dict[str, Any]:
        row = store.start(session, rollout, author=data.author or "api", origin=origin, text=data.yaml,
                          number=int(data.version) if data.version is not None else None, source="api",
                          message=data.message, document="<request>")
        found = store.status(session, row)
        assert found is not None
        return found.as_json()

    try:
        return Response(await _changed(db, policy_changed, start), status_code=201)
    except PolicyError as error:
        return _rejected(error)


async def _end(request: Request[Any, Any, Any], db: Engine, policy_changed: PolicyChanged,
               end: Callable[..., PolicyCanary], default_reason: str) -> dict[str, Any]:
    """End the running canary through ``end`` (``store.promote`` or ``store.abort``); its status after."""
    data = await json_body(request, EndRequest) if await request.body() else EndRequest()
    origin = origin_of(request)

    def ending(session: Session) -> dict[str, Any]:
        row = end(session, actor=data.author or "api", origin=origin, reason=data.reason or default_reason)
        found = store.status(session, row)
        assert found is not None
        return found.as_json()

    return await _changed(db, policy_changed, ending)


@post("/policy/canary/promote", operation_id="adminPolicyCanaryPromote", status_code=200,
      operation_class=admin_operation(ok("Promoted: its version is active.", STATUS), 400, 404, 413,
                                      body=ABORT_BODY))
async def canary_promote(request: Request[Any, Any, Any], db: NamedDependency[Engine],
                         policy_changed: NamedDependency[PolicyChanged]) -> dict[str, Any]:
    """Make the running canary's version active now."""
    return await _end(request, db, policy_changed, store.promote, "promoted by hand")


@post("/policy/canary/abort", operation_id="adminPolicyCanaryAbort", status_code=200,
      operation_class=admin_operation(ok("Aborted: the active version serves everything.", STATUS), 400, 404, 413,
                                      body=ABORT_BODY))
async def canary_abort(request: Request[Any, Any, Any], db: NamedDependency[Engine],
                       policy_changed: NamedDependency[PolicyChanged]) -> dict[str, Any]:
    """Stop the running canary: the active version decides every request again."""
    return await _end(request, db, policy_changed, store.abort, "")


ROUTES = [canary_status, canary_start, canary_promote, canary_abort]
