"""Console page: the dry-run. What the gateway would decide for a request, stage by stage, without
sending it anywhere or changing any state.

The form describes a request the way a policy test does (:class:`~switchyard.policy.policy_tests.PolicyTestRequest`),
and the answer comes from the evaluator the policy tests and ``switchyard policy test`` use
(:func:`switchyard.decide.dryrun.dry_run`, which runs the gateway's own decisions), with the features
and body built by the same helpers as a policy test's. The POST is a read (viewer role): it only
carries the CSRF token because every console POST does.

The form names the policy version to run against: the serving one by default, or a stored version (the running
canary's candidate is offered first). Only the snapshot changes: the decisions are the same evaluator's, with
that version's models' token counters and prompt renderers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread
from litestar import get, post
from litestar.datastructures import FormMultiDict
from litestar.di import NamedDependency
from litestar.plugins.htmx import HTMXRequest
from litestar.response import Template
from pydantic import ValidationError
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.admin.common import in_db
from switchyard.api.errors import ApiError
from switchyard.api.headers import PRIORITY_HEADER, REGION_HEADER
from switchyard.decide.dryrun import dry_run
from switchyard.decide.picking import PromptRenderer
from switchyard.decide.policy_tests import body_of_request, features_of_request
from switchyard.decide.tokens import TokenCounter
from switchyard.gateway.model_tokens import ModelTokens, load_model_tokens
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.gateway.tokenizers import TokenizerCache
from switchyard.policy import PolicyError, compile_policy
from switchyard.policy.policy_tests import PolicyTestRequest
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.policy.tiers import Limits
from switchyard.settings import Settings
from switchyard.store import canary as canary_store
from switchyard.store.models import TenantPublic
from switchyard.store.policy_versions import get_version, list_versions
from switchyard.store.tenants import get_tenant, list_tenants

TEMPLATE = "admin/dryrun.html.j2"

#: The form's fields and their values when the page opens.
DEFAULTS: dict[str, str] = {
    "tenant": "", "tier": "", "model": "", "prompt": "", "system": "", "messages": "1", "max_tokens": "",
    "temperature": "", "priority": "", "priority_header": "", "region_header": "", "version": "", "kind": "chat",
}
#: The APIs a request can be sent to, as the form offers them: (kind, label).
KINDS = (("chat", "/v1/chat/completions"), ("completion", "/v1/completions"), ("embedding", "/v1/embeddings"),
         ("responses", "/v1/responses"), ("tokenize", "/tokenize"), ("detokenize", "/detokenize"))
#: The form's checkboxes.
FLAGS = ("stream", "tools", "json_mode", "images")
#: Stored versions the form offers (the newest), besides the serving one and the running canary's candidate.
OFFERED_VERSIONS = 20
#: Stored versions kept compiled, with their models' tokenizers (a version never changes).
_KEPT = 4
_compiled: dict[tuple[int, str, Path], tuple[PolicySnapshot, ModelTokens]] = {}
_tokenizers = TokenizerCache()


class BadInput(ValueError):
    """The form holds something the dry-run cannot take (said in the message)."""


@dataclass(frozen=True, slots=True)
class Who:
    """Whom the request is sent as: a tenant (its tier, home region and limit override) or just a tier."""

    tenant: str | None
    tier: str
    region: str | None = None
    limits: Limits | None = None



@dataclass(frozen=True, slots=True)
class Against:
    """The policy a dry-run runs against: its snapshot, its models' token counters and prompt renderers, and
    what it is (``serving``, ``canary``: the running canary's candidate, or None: another stored version)."""

    snapshot: PolicySnapshot
    counters: Mapping[str, TokenCounter]
    renderers: Mapping[str, PromptRenderer]
    role: str | None = None


@dataclass(frozen=True, slots=True)
class Offered:
    """The versions the form offers: the running canary's (version, percent), and the newest stored ones."""

    canary: tuple[int, float] | None
    versions: list[int]


def _offered(session: Session) -> Offered:
    row = canary_store.running(session)
    return Offered(None if row is None else (row.version, row.percent),
                   [v.number for v in list_versions(session, OFFERED_VERSIONS)])


def _version_number(ref: str) -> int | None:
    """The version ``7`` or ``v7`` names (None: the serving one, as ``active`` and an empty choice name it)."""
    if ref in ("", "active"):
        return None
    digits = ref.removeprefix("v")
    if not (digits.isascii() and digits.isdigit()) or not 1 <= int(digits) < 2**31:
        raise BadInput(f"{ref!r} is not a policy version: give a number (7 or v7)")
    return int(digits)


async def _against(db: Engine, settings: Settings, policy: PolicyHolder, ref: str) -> Against:
    """The policy version ``ref`` names (the form's ``version``): the serving snapshot with the counters it serves
    with, or a stored version compiled with its own (kept: a version never changes)."""
    serving = policy.snapshot
    number = _version_number(ref)
    if number is None or number == serving.version:
        return Against(serving, policy.counters, policy.renderers, "serving")

    def read(session: Session) -> tuple[str, str, int | None]:
        row = get_version(session, number)
        running = canary_store.running(session)
        return row.yaml_text, row.sha256, running.version if running is not None else None

    try:
        text, sha, canary = await in_db(db, read)
    except ApiError:
        raise BadInput(f"there is no policy version {number}") from None
    folder = settings.policy_file.resolve().parent  # where relative tokenizer paths start, as the gateway's
    kept = _compiled.get((number, sha, folder))
    if kept is None:
        def build() -> tuple[PolicySnapshot, ModelTokens]:
            snapshot = compile_policy(text, f"policy version {number}", number)
            return snapshot, load_model_tokens(snapshot, folder, _tokenizers)

        try:
            kept = await anyio.to_thread.run_sync(build)
        except PolicyError as error:
            raise BadInput(f"v{number} cannot be run here: {error}") from None
        while len(_compiled) >= _KEPT:
            del _compiled[next(iter(_compiled))]
        _compiled[(number, sha, folder)] = kept
    snapshot, tokens = kept
    return Against(snapshot, tokens.counters, tokens.renderers, "canary" if canary == number else None)


def _choices(snapshot: PolicySnapshot, tenants: list[TenantPublic]) -> dict[str, Any]:
    return {
        "tenants": tenants,
        "tiers": list(snapshot.tiers),
        "models": list(snapshot.models),
        "routes": list(snapshot.routes),
        "classes": list(snapshot.priorities),
        "regions": list(snapshot.document.regions),
        "kinds": KINDS,
    }


async def _page(db: Engine, policy: PolicyHolder, values: dict[str, str], flags: set[str], status: int = 200,
                error: str | None = None, result: dict[str, Any] | None = None,
                snapshot: PolicySnapshot | None = None) -> Template:
    """The page; the form's choices are ``snapshot``'s (the version run against), by default the serving one's."""
    tenants = await in_db(db, list_tenants)
    offered = await in_db(db, _offered)
    serving = policy.snapshot
    context = {**_choices(snapshot or serving, tenants), "values": values, "flags": flags, "error": error,
               "result": result, "serving": serving.label, "serving_version": serving.version,
               "canary": offered.canary, "versions": offered.versions}
    return Template(template_name=TEMPLATE, status_code=status, context=context)


@get("/dry-run", name="admin:dry-run", include_in_schema=False)
async def dry_run_form(db: NamedDependency[Engine], policy: NamedDependency[PolicyHolder]) -> Template:
    """The dry-run form."""
    return await _page(db, policy, dict(DEFAULTS), set())


def _number(values: dict[str, str], name: str, label: str, kind: type[int] | type[float]) -> Any:
    """The field ``name`` as a number (None when empty)."""
    raw = values[name]
    if not raw:
        return None
    try:
        return kind(raw)
    except ValueError:
        raise BadInput(f"{label}: {raw!r} is not {'a whole number' if kind is int else 'a number'}") from None


def _request_of(snapshot: PolicySnapshot, values: dict[str, str], flags: set[str], tier: str) -> PolicyTestRequest:
    """The form as a policy test's request (every check the policy tests' schema makes applies)."""
    model = values["model"]
    if not model:
        raise BadInput("choose a model")
    if model not in snapshot.models and model not in snapshot.routes:
        raise BadInput(f"unknown model {model!r}: policy {snapshot.label} has no model or route of that name")
    kind = values["kind"] or "chat"
    if kind not in dict(KINDS):
        raise BadInput(f"unknown API {kind!r}: choose one of {', '.join(k for k, _ in KINDS)}")
    headers = {header: values[field] for header, field in ((PRIORITY_HEADER, "priority_header"),
                                                            (REGION_HEADER, "region_header")) if values[field]}
    try:
        return PolicyTestRequest(
            model=model, tier=tier, kind=kind, prompt=values["prompt"], system=values["system"] or None,
            messages=_number(values, "messages", "Messages", int) or 1,
            max_tokens=_number(values, "max_tokens", "Max tokens", int),
            temperature=_number(values, "temperature", "Temperature", float),
            priority=values["priority"] or None, headers=headers,
            tools="tools" in flags, json_mode="json_mode" in flags, images="images" in flags)
    except ValidationError as invalid:
        labels = {"messages": "Messages", "max_tokens": "Max tokens", "temperature": "Temperature",
                  "priority": "Priority class"}
        raise BadInput("; ".join(f"{labels.get(str(e['loc'][0]), e['loc'][0]) if e['loc'] else 'request'}: "
                                 f"{e['msg']}" for e in invalid.errors())) from None


async def _who(db: Engine, snapshot: PolicySnapshot, values: dict[str, str]) -> Who:
    name = values["tenant"]
    if name:
        def lookup(session: Session) -> Who:
            tenant = get_tenant(session, name)
            limits = Limits.model_validate(tenant.limits) if tenant.limits is not None else None
            return Who(tenant.name, tenant.tier, tenant.region, limits)

        try:
            who = await in_db(db, lookup)
        except ApiError:
            raise BadInput(f"unknown tenant {name!r}") from None
        if who.tier not in snapshot.tiers:
            raise BadInput(f"tenant {name!r} is in tier {who.tier!r}, which policy {snapshot.label} does not "
                           "define")
        return who
    tier = values["tier"]
    if not tier:
        raise BadInput("choose a tenant or a tier")
    if tier not in snapshot.tiers:
        raise BadInput(f"unknown tier {tier!r}")
    return Who(None, tier)


def _values(form: FormMultiDict) -> tuple[dict[str, str], set[str]]:
    values = {}
    for name, default in DEFAULTS.items():
        raw = form.get(name, default)
        text = raw if isinstance(raw, str) else default
        values[name] = text if name in ("prompt", "system") else text.strip()
    return values, {flag for flag in FLAGS if form.get(flag)}


@post("/dry-run", include_in_schema=False, status_code=200)
async def dry_run_submit(request: HTMXRequest, settings: NamedDependency[Settings], db: NamedDependency[Engine],
                         policy: NamedDependency[PolicyHolder]) -> Template:
    """Run the dry-run of the form's request against the version it names and show every decision (400 with the
    form when it is wrong)."""
    values, flags = _values(await request.form())
    try:
        against = await _against(db, settings, policy, values["version"])
    except BadInput as bad:
        return await _page(db, policy, values, flags, status=400, error=str(bad))
    snapshot = against.snapshot  # read once: the whole answer comes from one policy version
    try:
        who = await _who(db, snapshot, values)
        test_request = _request_of(snapshot, values, flags, who.tier)
    except BadInput as bad:
        return await _page(db, policy, values, flags, status=400, error=str(bad), snapshot=snapshot)
    features = features_of_request(test_request)
    body = body_of_request(test_request)
    if "stream" in flags:
        body["stream"] = True
    # The gateway's own decisions, with the tenant's limit override and the models' tokenizers.
    run = dry_run(snapshot, who.tier, features, strategy=settings.picker, priority=test_request.priority,
                  key_region=who.region, gateway_region=settings.region, body=body,
                  tenant=who.tenant or "dry-run", tenant_limits=who.limits, counters=against.counters,
                  renderers=against.renderers, kind=test_request.kind)
    prompt_tokens = run.prompt_tokens if run.prompt_tokens is not None else features.prompt_tokens
    result = {"run": run, "who": who, "policy": snapshot.label, "role": against.role,
              "prompt_tokens": prompt_tokens,
              "max_tokens": features.max_tokens, "estimated_tokens": run.estimated_tokens, "charges": run.charges,
              "stream": "stream" in flags, "cache_rules": bool(snapshot.document.cache)}
    return await _page(db, policy, values, flags, result=result, snapshot=snapshot)


ROUTES: list[Any] = [dry_run_form, dry_run_submit]
