"""Console page: policy canaries. The live panel of the running canary (else the last one), and its Promote
and Abort buttons; the "publish as canary" form of the editor (its fields and how they become a rollout).

Starting a canary is the editor's other way to publish (:func:`switchyard.admin.pages.policy_edit.policy_canary_start`):
the candidate is stored as a version that is not active and a slice of traffic tries it (``store.canary``), as
``switchyard policy canary start`` and the admin API do. The panel (``/admin/policy/canary``) shows the slice,
the figures of the slice and of the rest side by side per class, the guardrails tested, the next move and,
in shadow mode, where the candidate decided otherwise; while the canary runs, htmx polls its live part
(``#canary-live``) every 2 seconds. Promote and Abort need the operator role; they act on the canary the
panel shows only (a form names it), and are audited as the console user.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from litestar import get, post
from litestar.datastructures import FormMultiDict
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.plugins.htmx import HTMXRequest, HTMXTemplate
from litestar.response import Redirect, Response, Template
from pydantic import ValidationError
from sqlmodel import Session

from switchyard.admin.dependencies import PolicyChanged
from switchyard.admin.pages.policy import PAGES_DEPENDENCY, PolicyPages, base_context, refused_page
from switchyard.admin.session import console_origin, current_user
from switchyard.decide.canary import ALL
from switchyard.figures import duration, fixed, millis, percent
from switchyard.policy.rollout import (
    DEFAULT_GUARDS,
    INCREASE_GUARDS,
    SLICE_BY,
    GuardName,
    Rollout,
    rollout_from_flags,
)
from switchyard.store import canary as store
from switchyard.store import errors as store_errors
from switchyard.store.db import in_transaction
from switchyard.store.models import PolicyCanary

PAGE = "admin/policy_canary.html.j2"
PANEL = "admin/partials/_policy_canary_panel.html.j2"
#: Canaries the panel's history lists.
HISTORY = 10
#: Seconds between the live panel's refreshes while a canary runs.
POLL_S = 2
#: The steps the form offers.
DEFAULT_STEPS = "1:1m 10:2m 50:5m"

_WORDS = re.compile(r"[\s,]+")
_GUARD_LINES = re.compile(r"[\n;,]+")
_STATUS = {"running": "running", "promoted": "promoted", "rolled_back": "rolled back", "aborted": "aborted"}
_GUARD_LABELS = {"ttft_p99": "TTFT p99", "cost_per_1k": "cost per 1,000", "error_rate": "error rate",
                 "shed_rate": "shed rate", "rate_limited_rate": "429 rate"}


# --- the form -------------------------------------------------------------------------------------

def guard_words(guards: Mapping[GuardName, float]) -> list[str]:
    """Guards as the form (and ``--guard``) writes them: ``ttft_p99=1.5x``, ``error_rate=+1%``."""
    return [f"{name}=+{value * 100:g}%" if name in INCREASE_GUARDS else f"{name}={value:g}x"
            for name, value in guards.items()]


def _names(text: str) -> list[str]:
    return [n for n in _WORDS.split(text.strip()) if n]


def rollout_words(exc: ValueError) -> str:
    """What is wrong with a rollout, in a sentence (pydantic's errors, each with the field it is about)."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}"
                         f"{str(e['msg']).removeprefix('Value error, ')}" for e in exc.errors())
    return str(exc)


@dataclass(slots=True)
class CanaryForm:
    """The editor's "publish as canary" fields, as typed (re-shown as they were when they are refused)."""

    steps: str = DEFAULT_STEPS
    percent: str = ""
    by: str = "tenant"
    tiers: str = ""
    regions: str = ""
    models: str = ""
    guards: str = field(default_factory=lambda: "\n".join(guard_words(DEFAULT_GUARDS)))
    window: str = field(default_factory=lambda: duration(Rollout.model_fields["window"].default))
    min_requests: str = field(default_factory=lambda: str(Rollout.model_fields["min_requests"].default))
    shadow: bool = False

    @classmethod
    def from_form(cls, form: FormMultiDict) -> CanaryForm:
        """The fields of a submitted editor form (those it lacks keep their defaults)."""
        made = cls()
        for name in ("steps", "percent", "by", "tiers", "regions", "models", "guards", "window", "min_requests"):
            value = form.get(f"canary_{name}")
            if value is not None:
                setattr(made, name, str(value).replace("\r\n", "\n").strip())
        made.shadow = form.get("canary_shadow") is not None
        return made

    def rollout(self) -> Rollout:
        """The rollout these fields describe.

        Raises:
            ValueError: a field is not right (a pydantic ValidationError for what the rollout itself refuses).
        """
        try:
            share = float(self.percent) if self.percent else None
        except ValueError:
            raise ValueError(f"percent: {self.percent!r} is not a number") from None
        if share is not None and not math.isfinite(share):
            raise ValueError(f"percent: {self.percent!r} is not a number")
        try:
            least = int(self.min_requests) if self.min_requests else None
        except ValueError:
            raise ValueError(f"min requests: {self.min_requests!r} is not a whole number") from None
        if self.by not in SLICE_BY:
            raise ValueError(f"slice by: one of {', '.join(SLICE_BY)}")
        guards = [g.strip() for g in _GUARD_LINES.split(self.guards) if g.strip()]
        return rollout_from_flags(percent=share, by=self.by, steps=_names(self.steps), guards=guards,
                                  tiers=_names(self.tiers), regions=_names(self.regions), models=_names(self.models),
                                  window=self.window or None, min_requests=least, shadow=self.shadow)


# --- what the panel shows -------------------------------------------------------------------------

def countdown(seconds: float) -> str:
    """``1h 05m``, ``2m 07s``, ``9s``."""
    s = max(0, math.ceil(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s}s"


def _when(iso: str | None) -> str:
    return datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M:%S UTC") if iso else "—"


def _class_label(cls: str) -> str:
    return "all classes" if cls == ALL else "no class" if cls == "-" else cls


def _figure(guard: str, value: float | None) -> str:
    if guard == "ttft_p99":
        return millis(value)
    if guard == "cost_per_1k":
        return fixed(value, decimals=4)
    return percent(value, decimals=2)


def _limit(guard: str, value: float) -> str:
    if guard in INCREASE_GUARDS:
        points = value * 100
        return f"at most {points:g} point{'' if points == 1 else 's'} above the rest's"
    return f"at most {value:g}x the rest's"


def _scope(only: dict[str, list[str]]) -> str:
    parts = [f"{what}: {', '.join(names)}" for what, names in only.items() if names]
    return "; ".join(parts) if parts else "every request"


def _next(data: dict[str, Any]) -> dict[str, Any] | None:
    found = data.get("next")
    if found is None:
        return None
    label = {"hold": "Holding", "advance": "Stepping up", "promote": "Promoting",
             "rollback": "Rolling back"}[found["action"]]
    wait = found.get("in_s")
    return {"action": found["action"], "label": label, "reason": found["reason"],
            "in": countdown(wait) if wait is not None else None}


def panel(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """A canary's status (``CanaryStatus.as_json``) as the panel shows it: formatted, rows in order."""
    if data is None:
        return None
    figures = []
    for cls, sides in data["figures"].items():
        rows = []
        for role in ("canary", "control"):
            f = sides.get(role)
            if f is None:
                rows.append({"role": role, "requests": 0, "error_rate": "—", "shed_rate": "—",
                             "rate_limited_rate": "—", "ttft": "—", "cost": "—"})
                continue
            rows.append({"role": role, "requests": f["requests"], "error_rate": percent(f["error_rate"], decimals=2),
                         "shed_rate": percent(f["shed_rate"], decimals=2),
                         "rate_limited_rate": percent(f["rate_limited_rate"], decimals=2),
                         "ttft": millis(f["ttft_p99_ms"]), "cost": fixed(f["cost_per_1k"], decimals=4)})
        figures.append({"cls": cls, "label": _class_label(cls), "rows": rows})
    guards = [{"guard": g["guard"], "label": _GUARD_LABELS.get(g["guard"], g["guard"]), "cls": _class_label(g["class"]),
               "canary": _figure(g["guard"], g["canary"]), "rest": _figure(g["guard"], g["rest"]),
               "limit": _figure(g["guard"], g["limit"]), "p_value": f"{g['p_value']:.2g}",
               "breached": g["breached"], "n": f"{g['n_canary']:,} / {g['n_rest']:,}"}
              for g in data["guards_tested"]]
    passed = {int(p["step"]): p for p in data.get("passed_steps") or ()}
    steps = [{"percent": f"{s['percent']:g}%", "hold": duration(s["hold_s"]) if s["hold_s"] is not None else None,
              "current": i + 1 == data["step"], "passed": _passed(passed.get(i + 1))}
             for i, s in enumerate(data["steps"])]
    shadow = data.get("shadow")
    return {
        "id": data["id"], "version": data["version"], "base": data["base"], "status": data["status"],
        "status_label": _STATUS.get(data["status"], data["status"]), "running": data["status"] == "running",
        "shadow": data["mode"] == "shadow", "by": data["by"], "percent": f"{data['percent']:g}%",
        "step": data["step"], "steps": steps, "automatic": data["automatic"], "scope": _scope(data["only"]),
        "guards_declared": [f"{_GUARD_LABELS.get(n, n)} {_limit(n, v)}" for n, v in data["guards"].items()],
        "window": duration(data["window_s"]), "min_requests": data["min_requests"], "alpha": f"{data['alpha']:g}",
        "started": _when(data["started_at"]), "step_started": _when(data["step_started_at"]),
        "ended": _when(data["ended_at"]) if data["ended_at"] else None, "author": data["author"],
        "reason": data["reason"], "figures": figures, "guards": guards,
        "breached": any(g["breached"] for g in guards), "slice_in_step": data["slice_in_step"],
        "warming_up": data.get("warming_up", False),
        "replicas": data["replicas"], "next": _next(data),
        "shadow_decided": shadow["decided"] if shadow else None,
        "shadow_differences": list(shadow["differences"].items()) if shadow else [],
    }


def _passed(step: dict[str, Any] | None) -> str | None:
    """What a passed step passed on, in words (None: not passed)."""
    if step is None:
        return None
    tests = step["guards_tested"]
    least = f", least p {min(t['p_value'] for t in tests):.2g}" if tests else ""
    return f"passed at {_when(step['at'])} on {len(tests)} guard test{'s' if len(tests) != 1 else ''}{least}"


def _history(rows: list[PolicyCanary]) -> list[dict[str, Any]]:
    return [{"id": r.id, "version": r.version, "base": r.base, "status": _STATUS.get(r.status, r.status),
             "percent": f"{r.percent:g}%", "mode": "shadow" if store.rollout_of(r).shadow else "canary",
             "author": r.author, "reason": r.reason, "started": r.started_at.strftime("%Y-%m-%d %H:%M:%S"),
             "ended": r.ended_at.strftime("%Y-%m-%d %H:%M:%S") if r.ended_at else "—"} for r in rows]


def _notes(query: Any) -> list[str]:
    notes = []
    for key, say in (("started", "Canary {} started: every gateway serves its slice within seconds."),
                     ("promoted", "Canary {} promoted: its version is now the active version."),
                     ("aborted", "Canary {} aborted: the active version serves every request again.")):
        value = query.get(key)
        if value is not None and value.isdigit():
            notes.append(say.format(value))
    return notes


# --- the page -------------------------------------------------------------------------------------

@get("/policy/canary", name="admin:policy-canary", include_in_schema=False, dependencies=PAGES_DEPENDENCY)
async def canary_page(request: HTMXRequest, pages: NamedDependency[PolicyPages],
                      live: FromQuery[int | None] = None) -> Template:
    """The running canary (else the last one): slice, figures side by side, guardrails, next move, Promote and
    Abort. An htmx request (the panel's poll, ``live``: the canary it showed) gets the live part only, with the
    actions too once that canary has ended."""
    polled = bool(request.htmx)

    def read(session: Session) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        found = store.status(session)
        data = found.as_json() if found is not None else None
        return data, [] if polled else _history(list(store.history(session, HISTORY)))

    data, history = await in_transaction(pages.db, read)
    context = base_context(request, pages) | {"canary": panel(data), "can_act": current_user(request).may("operator"),
                                              "poll_s": POLL_S}
    if polled:
        ended = live is not None and (data is None or data["id"] != live or data["status"] != "running")
        return HTMXTemplate(template_name=PANEL, context=context | {"oob_actions": ended})
    return Template(template_name=PAGE, context=context | {"history": history, "notes": _notes(request.query_params)})


async def _end(request: HTMXRequest, pages: PolicyPages, policy_changed: PolicyChanged, status: str) -> Response[Any]:
    """Promote or abort the running canary, if it is the one the form names."""
    form = await request.form()
    wanted = str(form.get("canary", ""))
    if not wanted.isdigit():
        return refused_page(request, pages, 400, "name the canary to end (its id)")
    reason = str(form.get("reason", "")).strip()[:1000]
    actor, origin = console_origin(request)

    def end(session: Session) -> int:
        row = store.running(session)
        if row is None or row.id != int(wanted):
            now = f"canary {row.id} of v{row.version} runs now" if row is not None else "no canary runs now"
            raise store_errors.Conflict(f"canary {wanted} is not running any more ({now}): nothing was changed")
        if status == "promoted":
            store.promote(session, actor=actor, origin=origin, reason=reason or f"promoted by {actor}")
        else:
            store.abort(session, actor=actor, origin=origin, reason=reason)
        return int(wanted)

    try:
        done = await in_transaction(pages.db, end)
    except store_errors.StoreError as error:
        code = 409 if isinstance(error, store_errors.Conflict) else 404 if isinstance(error, store_errors.NotFound) \
            else 400
        return refused_page(request, pages, code, str(error))
    await policy_changed()  # this process follows at once; the others hear it on the policy channel
    return Redirect(path=f"/admin/policy/canary?{status}={done}", status_code=303)


@post("/policy/canary/promote", include_in_schema=False, status_code=200, opt={"role": "operator"},
      dependencies=PAGES_DEPENDENCY)
async def canary_promote(request: HTMXRequest, pages: NamedDependency[PolicyPages],
                         policy_changed: NamedDependency[PolicyChanged]) -> Response[Any]:
    """Make the running canary's version active now, as the console user."""
    return await _end(request, pages, policy_changed, "promoted")


@post("/policy/canary/abort", include_in_schema=False, status_code=200, opt={"role": "operator"},
      dependencies=PAGES_DEPENDENCY)
async def canary_abort(request: HTMXRequest, pages: NamedDependency[PolicyPages],
                       policy_changed: NamedDependency[PolicyChanged]) -> Response[Any]:
    """Stop the running canary, as the console user: the active version decides every request again."""
    return await _end(request, pages, policy_changed, "aborted")


ROUTES: list[Any] = [canary_page, canary_promote, canary_abort]
