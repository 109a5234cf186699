"""``switchyard policy canary``: start a canary rollout of a policy version, follow it, promote or abort it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from switchyard.cli.context import cli_author, cli_origin
from switchyard.cli.database import open_session


@click.group("canary")
def canary() -> None:
    """Roll a policy version out to a slice of traffic, with steps and guardrails: start, status, promote, abort."""


def _show(data: dict[str, Any] | None, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    if data is None:
        click.echo("no canary has run")
        return
    click.echo(f"canary {data['id']}: v{data['version']} against v{data['base']} ({data['mode']}, by {data['by']}) "
               f"{data['status']} at {data['percent']:g}%, step {data['step']} of {len(data['steps'])}")
    if data.get("reason"):
        click.echo(f"  reason: {data['reason']}")
    nxt = data.get("next")
    if nxt:
        when = f" in {nxt['in_s']:.0f} s" if nxt.get("in_s") is not None else ""
        click.echo(f"  next: {nxt['action']}{when} ({nxt['reason']})")
    if data.get("warming_up"):
        click.echo(f"  this step has not had {data['min_requests']} requests on each side yet: tested meanwhile over "
                   "the whole window, the steps before included")
    for passed in data.get("passed_steps") or ():
        tests = passed["guards_tested"]
        least = f", least p={min(t['p_value'] for t in tests):.2g}" if tests else ""
        click.echo(f"  step {passed['step']} ({passed['percent']:g}%) passed at {passed['at']}: "
                   f"{len(tests)} guard tests{least}")
    for cls, sides in data["figures"].items():
        for role in ("canary", "control"):
            f = sides.get(role)
            if f is None:
                continue
            def pct(v: float | None) -> str:
                return "-" if v is None else f"{v * 100:.2f}%"
            ttft = "-" if f["ttft_p99_ms"] is None else f"{f['ttft_p99_ms']:.0f} ms"
            cost = "-" if f["cost_per_1k"] is None else f"{f['cost_per_1k']:.4f}"
            click.echo(f"  {cls:<10} {role:<8} {f['requests']:>7} requests  errors {pct(f['error_rate'])}  "
                       f"shed {pct(f['shed_rate'])}  429 {pct(f['rate_limited_rate'])}  TTFT p99 {ttft}  "
                       f"cost/1k {cost}")
    for g in data["guards_tested"]:
        mark = "BREACH" if g["breached"] else "ok"
        click.echo(f"  guard {g['guard']} [{g['class']}]: {mark} (p={g['p_value']:.2g})")
    shadow = data.get("shadow")
    if shadow is not None:
        diffs = ", ".join(f"{k} {v}" for k, v in shadow["differences"].items()) or "none"
        click.echo(f"  shadow: {shadow['decided']} requests decided alongside; differences: {diffs}")


@canary.command("start")
@click.argument("candidate")
@click.option("--percent", type=float, default=None, help="Without --step: the share to serve, held until promoted "
              "or aborted.")
@click.option("--by", type=click.Choice(["tenant", "key", "session", "request"]), default="tenant",
              show_default=True, help="What a request is hashed by to fall in the slice.")
@click.option("--step", "steps", multiple=True, help="PERCENT:HOLD, repeated in order (1:1m --step 10:2m ...); "
              "passing the last promotes.")
@click.option("--guard", "guards", multiple=True, help="NAME=LIMIT, repeated: ttft_p99=1.5x, cost_per_1k=1.25x, "
              "error_rate=+1%, shed_rate=+2%, rate_limited_rate=+2% [default: all five so].")
@click.option("--tier", "tiers", multiple=True, help="Only requests of this tier (repeat for more).")
@click.option("--region", "regions", multiple=True, help="Only requests through gateways of this region.")
@click.option("--model", "models", multiple=True, help="Only requests for this model (as the client names it).")
@click.option("--window", default=None, help="The guardrails' sliding window [default: 2m].")
@click.option("--min-requests", type=int, default=None, help="Requests each side needs before a guard is tested "
              "[default: 200].")
@click.option("--alpha", type=float, default=None, help="False-breach chance per evaluation [default: 0.001].")
@click.option("--shadow", is_flag=True, help="Decide the slice with the candidate alongside, without serving it.")
@click.option("--message", "-m", default="", help="Why (kept with the version and in the audit log).")
@click.option("--author", default=None, help="Who [default: cli:<OS user>].")
@click.option("--json", "as_json", is_flag=True, help="Print the canary as JSON.")
def start_cmd(candidate: str, percent: float | None, by: str, steps: tuple[str, ...], guards: tuple[str, ...],
              tiers: tuple[str, ...], regions: tuple[str, ...], models: tuple[str, ...], window: str | None,
              min_requests: int | None, alpha: float | None, shadow: bool, message: str, author: str | None,
              as_json: bool) -> None:
    """Start a canary of CANDIDATE (a policy file, or a stored version: 7 or v7) next to the active version.

    Every gateway serves the same slice; each answer's x-switchyard-route and the request log name the version
    that decided it. A guardrail breach rolls the canary back at once (audited with why); passing every step
    promotes the version.
    """
    from pydantic import ValidationError

    from switchyard.cli.policy_cmds import _refuse_in_file_mode, _rejected, _version_number
    from switchyard.policy import PolicyError, read_policy_file
    from switchyard.policy.rollout import rollout_from_flags
    from switchyard.store import canary as store

    try:
        rollout = rollout_from_flags(percent=percent, by=by, steps=steps, guards=guards, tiers=tiers,
                                     regions=regions, models=models, window=window, min_requests=min_requests,
                                     alpha=alpha, shadow=shadow)
    except (ValidationError, ValueError) as exc:
        raise click.BadParameter(_words(exc)) from None
    number = _version_number(candidate)
    if number is None:
        _refuse_in_file_mode("rolling a new document out")
    try:
        text = None if number is not None else read_policy_file(Path(candidate))
        with open_session() as session:
            row = store.start(session, rollout, author=cli_author(author), origin=cli_origin(), text=text,
                              number=number, source="cli", message=message, document=candidate)
            found = store.status(session, row)
            assert found is not None
            data = found.as_json()
    except PolicyError as error:
        _rejected(error)
    if as_json:
        _show(data, True)
    else:
        click.echo(f"canary {data['id']} started: v{data['version']} serves {data['percent']:g}% "
                   f"({data['mode']}, by {data['by']}) next to v{data['base']}")


def _words(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'rollout'}: {e['msg']}" for e in exc.errors())
    return str(exc)


@canary.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status_cmd(as_json: bool) -> None:
    """The running canary (else the last one): its slice, figures side by side, guardrails and next move."""
    from switchyard.store import canary as store

    with open_session() as session:
        found = store.status(session)
        data = found.as_json() if found is not None else None
    _show(data, as_json)


@canary.command("promote")
@click.option("--author", default=None, help="Who [default: cli:<OS user>].")
def promote_cmd(author: str | None) -> None:
    """Make the running canary's version active now."""
    from switchyard.store import canary as store

    with open_session() as session:
        row = store.promote(session, actor=cli_author(author), origin=cli_origin())
    click.echo(f"promoted: v{row.version} is active")


@canary.command("abort")
@click.option("--reason", default="", help="Why (kept in the audit log).")
@click.option("--author", default=None, help="Who [default: cli:<OS user>].")
def abort_cmd(reason: str, author: str | None) -> None:
    """Stop the running canary: the active version decides every request again."""
    from switchyard.store import canary as store

    who = cli_author(author)
    with open_session() as session:
        row = store.abort(session, actor=who, origin=cli_origin(), reason=reason)
    click.echo(f"aborted: canary {row.id} of v{row.version}; v{row.base} serves everything")

