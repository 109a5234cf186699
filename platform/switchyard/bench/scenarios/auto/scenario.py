"""The ``auto`` scenario's run: simulated engines for the shipped policy's endpoints, a gateway and a key, every
labelled prompt sent, then the figures, goals and report (what the scenario registry calls is :func:`run`)."""

from __future__ import annotations

import asyncio

from switchyard.bench.labelled import default_prompts_path, load_prompts
from switchyard.bench.procs import free_ports
from switchyard.bench.report import build_report, write_report
from switchyard.bench.scenarios.auto.client import ARM, CONCURRENCY, TENANT, TIER, send_prompts
from switchyard.bench.scenarios.auto.figures import figures, goals_of, routed_of, tables_of
from switchyard.bench.scenarios.auto.policy import (
    ROUTE,
    RoutePolicy,
    endpoint_count,
    event_port_offsets,
    shipped_policy,
    with_endpoints,
)
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.stack import create_key, start_gateway, start_sims, state_env
from switchyard.figures import fixed

#: Simulated seconds per wall-clock second: answers of one token take a few milliseconds.
TIME_SCALE = 20.0
#: ``--quick`` sends every this-many-th prompt of the set.
QUICK_EVERY = 4


def run(ctx: ScenarioContext) -> Outcome:
    """Run the auto scenario and write its report into ``ctx.out_dir``."""
    opts = ctx.options
    time_scale = opts.time_scale or TIME_SCALE
    source = shipped_policy()
    document = source.read_text(encoding="utf-8")
    policy = RoutePolicy.parse(document)
    every = QUICK_EVERY if opts.quick else 1
    prompts = load_prompts()[::every]

    ports = free_ports(endpoint_count(document), event_port_offsets(document))  # (its engines publish KV events)
    policy_file = ctx.state_dir / "policies.yaml"
    policy_file.write_text(with_endpoints(document, ports), encoding="utf-8")
    ctx.say(f"{ROUTE}: starting simulated engines for the {len(ports)} endpoints of the shipped policy and the gateway")
    sims = start_sims(ctx.procs, f"{ROUTE}-sims", policy_file, ports, time_scale=time_scale, seed=opts.seed)
    env = state_env(ctx.state_dir / "switchyard", policy_file)
    key = create_key(env, TENANT, TIER)
    gateway = start_gateway(ctx.procs, f"{ROUTE}-gateway", env)
    ctx.say(f"{ROUTE}: sending {len(prompts)} labelled prompts, {CONCURRENCY} at a time")
    results = asyncio.run(send_prompts(prompts, gateway.base_url, key))
    ctx.procs.stop(gateway.proc)
    ctx.procs.stop(sims)

    routed = [routed_of(p, r, policy) for p, r in zip(prompts, results, strict=True)]
    if not any(r.answered for r in routed):
        first = results[0] if results else None
        why = f"{first.status} {first.error_type}: {first.error_message}" if first else "no prompts"
        raise RuntimeError(f"the gateway answered none of the {len(prompts)} prompts (first: {why})")
    f = figures(routed, policy)
    tables, goals = tables_of(f), goals_of(f)
    sent = "every prompt" if every == 1 else f"every {every}th prompt (--quick)"
    notes = [f"Labelled set {default_prompts_path().name}: {len(prompts)} prompts sent ({sent}; "
             f"{sum(p.hard for p in prompts)} hard), written for this benchmark; policy {source} (endpoints moved "
             "to free ports).",
             f"A real gateway in front of simulated engines (time scale {time_scale:g}), one chat completion per "
             f"prompt with max_tokens 1 from a {TIER} tenant, {CONCURRENCY} at a time; model and rule from "
             "x-switchyard-route, prompt tokens from usage (the engine's tokenizer, with the chat template and the "
             "tool and format instructions). Earlier turns of multi-message prompts are sent empty, as in the "
             "policy's tests.",
             *f["classifiers_not_shown"]]
    if f["refused"]:
        notes.append(f"{f['refused']} prompts were not answered (status {f['refusals']}); the costs leave them out.")
    if f["served_elsewhere"]:
        notes.append(f"{f['served_elsewhere']} prompts were served by another model than the rule chose (downgrade or "
                     "fallback); they count at the model the rule chose.")
    parameters = {"scenario": ROUTE, "route": ROUTE, "tier": TIER, "policy": str(source),
                  "prompts": str(default_prompts_path()), "sent": len(prompts), "every": every,
                  "concurrency": CONCURRENCY, "time_scale": time_scale, "max_tokens": 1}
    report = build_report({ARM: results}, title=f"switchyard bench: {ROUTE} (routing cheap requests to cheap models)",
                          parameters=parameters, seeds={"engines": opts.seed}, notes=notes, tables=tables,
                          goals=goals)
    report["figures"] = f
    write_report(report, ctx.out_dir)
    whole = f["costs"][2]
    summary = (f"{ROUTE} costs {whole['auto']:.4f} USD per 1,000 requests vs {whole['all']:.4f} all on "
               f"{f['compare']} ({fixed(whole['ratio'], decimals=2, unit='x')}; easy prompts "
               f"{fixed(f['easy_cost_ratio'], decimals=2, unit='x')}); "
               f"{100 * (f['hard_to_cheapest'] or 0):.1f}% of hard prompts went to {f['cheapest']}")
    return Outcome(ROUTE, "ok", summary, goals, tables, f"{ROUTE}/report.md", notes=notes[:1])
