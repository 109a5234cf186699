"""``auto``: what the ``auto`` route does with the shipped rules, on a labelled prompt set.

Real processes, as a user runs them: simulated engines for every endpoint of the shipped demo
policy (``policies.yaml``, copied into the scenario's folder with its endpoints moved to free
ports; nothing else changed) at a fast time scale, a gateway on it (SQLite in the scenario's
folder) and a key for a ``pro`` tenant. Every prompt of the labelled set shipped with the
benchmarks (``switchyard/bench/data/auto_prompts.jsonl``, written for Switchyard: easy and hard
requests, each with a realistic answer length and a train or test split) is sent to the gateway
as a chat completion for ``auto`` with ``max_tokens: 1`` (the answer's length does not change the
route), ``CONCURRENCY`` at a time, with its system prompt, its number of messages (earlier turns
empty, as in the policy's own tests), a dummy function tool when it has tools and
``response_format: json_object`` when it asks for JSON. ``--quick`` sends every
``QUICK_EVERY``-th prompt.

What the gateway did is read from its answer: the model and the rule from ``x-switchyard-route``
(the route's decision: a downgrade or fallback is counted at the model the rule chose, and
reported), the prompt's tokens from ``usage.prompt_tokens`` (the engine's own count, with the chat
template and the tool and format instructions).

Figures: how many prompts of each label went to each model, and through which rule; how well each
classifier whose rule is observable in the route header tells hard from easy (accuracy, precision
and recall for hard, on the test split, which its weights were not fitted on, and on the train
split for comparison); what 1,000 such requests cost with ``auto`` against sending them all to the
comparison model (the route's ``compare_to``, else its most expensive model: ``large``), and
against routing by the labels themselves (easy to the cheapest model, hard to the comparison
model); and the quality risk, the share of hard prompts that ``auto`` sent to the cheapest model.

Cost: each prompt's prompt tokens (the engine's count) plus its expected answer length
(``output_tokens`` of the set), at the model's prices in the policy (``models[].price``); no
caching. The policy is read as YAML here: bench drives the gateway and does not import it.
"""

from __future__ import annotations

import asyncio
import io
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from ruamel.yaml import YAML

from switchyard.bench.labelled import LabelledPrompt, Quality, default_prompts_path, load_prompts
from switchyard.bench.loadgen import Target, send_one
from switchyard.bench.procs import create_key, free_ports, start_gateway, start_sims, state_env
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result, parse_route
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.tables import goal, num, pct, ratio, table, text
from switchyard.sim.tokens import count_tokens

ROUTE = "auto"
TIER = "pro"
TENANT = "auto-bench"
#: The arm's name in the per-request summary (one arm: the gateway).
ARM = "switchyard"
#: Requests in flight at once.
CONCURRENCY = 8
#: Simulated seconds per wall-clock second: answers of one token take a few milliseconds.
TIME_SCALE = 20.0
#: ``--quick`` sends every this-many-th prompt of the set.
QUICK_EVERY = 4
CLIENT_TIMEOUT_S = 30.0
#: The tool sent with prompts that have tools (the route looks only at whether there are any).
DUMMY_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "lookup", "description": "Look something up.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
#: Goals: easy prompts should cost a fraction of what they cost on the comparison model, all prompts
#: less, and few hard prompts should land on the cheapest model.
GOAL_EASY_COST_RATIO = 0.25
GOAL_HARD_TO_CHEAPEST = 0.10
#: A traffic mix the costs are also shown for (the set itself is nearly half hard; real traffic is
#: usually mostly easy): this share of hard requests, at the set's mean cost per label.
MIX_HARD_SHARE = 0.2
#: Misrouted prompts listed in the report, at most.
MAX_LISTED = 20


def shipped_policy() -> Path:
    """The demo ``policies.yaml``: inside an installed package, else at the top of a source checkout.

    (``switchyard.resources.demo_policy`` finds it the same way; bench may not import it.)

    Raises:
        FileNotFoundError: Neither exists.
    """
    packaged = Path(str(files("switchyard"))) / "policies.yaml"
    if packaged.exists():
        return packaged
    checkout = Path(__file__).resolve().parents[4] / "policies.yaml"
    if checkout.exists():
        return checkout
    raise FileNotFoundError(f"the shipped policies.yaml is missing (looked in {packaged} and {checkout})")


# --- the policy, as far as the figures need it ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Price:
    """A model's prices per million tokens."""

    input_per_mtok: float
    output_per_mtok: float

    def of(self, prompt_tokens: int, output_tokens: int) -> float:
        """What a request of these lengths costs (no cached tokens)."""
        return (prompt_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok) / 1e6

    @property
    def rank(self) -> float:
        """How the route's models are ordered by price (input plus output, as the gateway's trace does)."""
        return self.input_per_mtok + self.output_per_mtok


@dataclass(frozen=True, slots=True)
class RouteRule:
    """One rule of the route: the name the gateway reports it by (``rule=`` in the route header)."""

    label: str
    model: str
    when: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """What the figures need of the policy document: prices, the route's rules and the classifiers."""

    prices: Mapping[str, Price]
    rules: tuple[RouteRule, ...]
    default: str
    compare_to: str | None
    classifiers: Mapping[str, Mapping[str, Any]]

    @classmethod
    def parse(cls, document: str, route: str = ROUTE) -> RoutePolicy:
        """Read ``route`` and the models' prices from a policy document (YAML).

        Raises:
            ValueError: The document has no such route, or a model it names has no price.
        """
        doc = YAML(typ="safe", pure=True).load(document) or {}
        prices = {}
        for m in doc.get("models") or []:
            price = m.get("price") or {}
            prices[str(m["name"])] = Price(float(price.get("input_per_mtok", 0)),
                                           float(price.get("output_per_mtok", 0)))
        found = [r for r in doc.get("routes") or [] if r.get("name") == route]
        if not found:
            raise ValueError(f"the policy has no route {route!r}")
        r = found[0]
        rules = tuple(RouteRule(str(rule.get("name") or f"rules[{i}]"), str(rule["model"]),
                                dict(rule.get("when") or {})) for i, rule in enumerate(r.get("rules") or []))
        policy = cls(prices, rules, str(r["default"]), r.get("compare_to"), dict(doc.get("classifiers") or {}))
        missing = [m for m in policy.targets if m not in prices]
        if missing:
            raise ValueError(f"route {route!r} names models without a price: {', '.join(missing)}")
        return policy

    @property
    def targets(self) -> list[str]:
        """The models the route can choose, rules first, then its default (no repeats)."""
        return list(dict.fromkeys([*(r.model for r in self.rules), self.default]))

    def by_price(self, models: Sequence[str]) -> list[str]:
        """``models`` cheapest first (ties by name)."""
        return sorted(models, key=lambda n: (self.prices[n].rank, n))

    def comparison(self) -> str:
        """The model the route is compared with: its ``compare_to``, else the priciest it can choose."""
        return self.compare_to or self.by_price(self.targets)[-1]

    def cheapest(self) -> str:
        """The cheapest model the route can choose."""
        return self.by_price(self.targets)[0]

    def rule_index(self, label: str) -> int:
        """The position of the rule the route header names (``default``: after every rule).

        Raises:
            ValueError: The route has no such rule.
        """
        if label == "default":
            return len(self.rules)
        for i, rule in enumerate(self.rules):
            if rule.label == label:
                return i
        raise ValueError(f"route {ROUTE!r} has no rule {label!r}")

    def classifier_rule(self, name: str) -> int | None:
        """The first rule whose only condition is ``{classifier: name}`` (None: there is none)."""
        return next((i for i, r in enumerate(self.rules) if dict(r.when) == {"classifier": name}), None)

    def predicts(self, classifier: str, rule: str) -> bool | None:
        """What ``classifier`` said about a request that matched ``rule``, as far as that shows it.

        The rule that is only ``{classifier: NAME}`` matched: it said yes. A later rule (or the
        default) matched: that rule was tried and did not match, so it said no. An earlier rule
        matched: it was never asked, as far as the header shows (None).
        """
        k = self.classifier_rule(classifier)
        if k is None:
            return None
        j = self.rule_index(rule)
        return True if j == k else False if j > k else None


def with_endpoints(document: str, ports: Sequence[int]) -> str:
    """``document`` with its pools' endpoints moved to ``ports`` on 127.0.0.1, in order; the rest as it was.

    Raises:
        ValueError: Not as many ports as endpoints.
    """
    yaml = YAML()
    yaml.width = 4096
    doc = yaml.load(document)
    left = list(ports)
    for pool in doc.get("pools") or []:
        count = len(pool["endpoints"])
        if count > len(left):
            raise ValueError("fewer ports than endpoints")
        pool["endpoints"] = [f"http://127.0.0.1:{p}" for p in left[:count]]
        left = left[count:]
    if left:
        raise ValueError("more ports than endpoints")
    out = io.StringIO()
    yaml.dump(doc, out)
    return out.getvalue()


def endpoint_count(document: str) -> int:
    """How many endpoints the document's pools have."""
    doc = YAML(typ="safe", pure=True).load(document) or {}
    return sum(len(p.get("endpoints") or []) for p in doc.get("pools") or [])


# --- the requests ---------------------------------------------------------------------------------


def request_body(prompt: LabelledPrompt, route: str = ROUTE) -> dict[str, Any]:
    """The chat completion a labelled prompt is sent as.

    Its system prompt first; then empty earlier turns, user and assistant by turns, until the
    conversation has ``prompt.messages`` messages (as the policy's tests and the dry run count
    them); then the prompt itself as the last user message.
    """
    messages: list[dict[str, str]] = []
    if prompt.system:
        messages.append({"role": "system", "content": prompt.system})
    earlier = max(0, prompt.messages - len(messages) - 1)
    messages += [{"role": "assistant" if (earlier - i) % 2 else "user", "content": ""} for i in range(earlier)]
    messages.append({"role": "user", "content": prompt.prompt})
    body: dict[str, Any] = {"model": route, "messages": messages, "max_tokens": 1}
    if prompt.tools:
        body["tools"] = [DUMMY_TOOL]
    if prompt.json_mode:
        body["response_format"] = {"type": "json_object"}
    return body


def sent_tokens(prompt: LabelledPrompt) -> int:
    """Tokens of the text sent (system and user message), under the simulator's tokenizer."""
    return count_tokens(prompt.prompt) + (count_tokens(prompt.system) if prompt.system else 0)


async def send_prompts(prompts: Sequence[LabelledPrompt], base_url: str, key: str, *,
                       concurrency: int = CONCURRENCY, timeout_s: float = CLIENT_TIMEOUT_S) -> list[Result]:
    """Send every prompt, ``concurrency`` at a time, each when a client is free; one result per prompt, in order."""
    target = Target(base_url, ARM, default_api_key=key)
    url, headers = target.url("chat"), target.headers_for(TENANT)
    encode = msgspec.json.Encoder().encode
    queue = deque(enumerate(prompts))
    results: list[Result | None] = [None] * len(prompts)
    loop = asyncio.get_running_loop()
    now = loop.time
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = now()

        async def client() -> None:
            while queue:
                index, p = queue.popleft()
                result = Result(index, ARM, TENANT, p.label, ROUTE, "chat", False, sent_tokens(p), 1, None,
                                now() - start)
                results[index] = await send_one(session, encode(request_body(p)), url, headers, result, now, start)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return [r for r in results if r is not None]


# --- what the gateway did -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Routed:
    """One prompt's answer from the gateway.

    Attributes:
        prompt: The labelled prompt.
        status: The HTTP status (0: no answer).
        model: The model the route chose (None: not answered); a downgrade or fallback served it
            elsewhere (``served``), but the rule chose this one.
        served: The model that answered.
        rule: The rule that matched (``default`` when none did).
        prompt_tokens: ``usage.prompt_tokens`` (the engine's count).
        cost: Its price at ``model`` (0 when not answered).
    """

    prompt: LabelledPrompt
    status: int
    model: str | None
    served: str | None
    rule: str | None
    prompt_tokens: int
    cost: float

    @property
    def answered(self) -> bool:
        """Whether the gateway answered it (and said how it routed it)."""
        return self.model is not None


def routed_of(prompt: LabelledPrompt, result: Result, policy: RoutePolicy) -> Routed:
    """What the answer to ``prompt`` says: the route header's model and rule, and the engine's token count."""
    fields = parse_route(result.route) if result.route else {}
    if not result.ok or "model" not in fields or "rule" not in fields or result.prompt_tokens is None:
        return Routed(prompt, result.status, None, None, None, 0, 0.0)
    served = fields["model"]
    model = fields.get("downgraded_from") or fields.get("fallback_from") or served
    tokens = result.prompt_tokens
    return Routed(prompt, result.status, model, served, fields["rule"], tokens,
                  policy.prices[model].of(tokens, prompt.output_tokens))


def cost_per_1000(routed: Sequence[Routed], prices: Mapping[str, Price], model_of: Mapping[str, str] | str | None = None
                  ) -> float:
    """What 1,000 requests like the answered ones of ``routed`` cost: at each one's chosen model, at one model
    for all (a name), or at the model a ``{label: model}`` mapping names for its label."""
    answered = [r for r in routed if r.answered]
    if not answered:
        return 0.0
    total = 0.0
    for r in answered:
        if model_of is None:
            total += r.cost
        else:
            model = model_of if isinstance(model_of, str) else model_of[r.prompt.label]
            total += prices[model].of(r.prompt_tokens, r.prompt.output_tokens)
    return 1000 * total / len(answered)


def cost_rows(routed: Sequence[Routed], prices: Mapping[str, Price], compare: str, cheapest: str
              ) -> list[dict[str, Any]]:
    """Cost per 1,000 requests with ``auto``, all on ``compare``, and by the labels: for the easy prompts,
    the hard ones, the whole set, and a mix of :data:`MIX_HARD_SHARE` hard."""
    by_labels = {"easy": cheapest, "hard": compare}
    answered = [r for r in routed if r.answered]
    parts = {"easy": [r for r in answered if not r.prompt.hard], "hard": [r for r in answered if r.prompt.hard],
             "the set": answered}
    costs: dict[str, tuple[int | None, float, float, float]] = {
        name: (len(part), cost_per_1000(part, prices), cost_per_1000(part, prices, compare),
               cost_per_1000(part, prices, by_labels))
        for name, part in parts.items()}
    share = MIX_HARD_SHARE
    mixed = [(1 - share) * e + share * h for e, h in zip(costs["easy"][1:], costs["hard"][1:], strict=True)]
    costs[f"a {100 * share:g}%-hard mix"] = (None, mixed[0], mixed[1], mixed[2])
    return [{"prompts": name, "n": n, "auto": auto, "all": all_, "labels": labels,
             "ratio": auto / all_ if all_ else None, "labels_ratio": labels / all_ if all_ else None}
            for name, (n, auto, all_, labels) in costs.items()]


def model_rows(routed: Sequence[Routed], models: Sequence[str]) -> list[dict[str, Any]]:
    """Per label (and all), for the whole set and for its test split: how many prompts went to each model."""
    rows = []
    for split, label in (("all", "easy"), ("all", "hard"), ("all", "all"), ("test", "easy"), ("test", "hard")):
        part = [r for r in routed if label in ("all", r.prompt.label) and split in ("all", r.prompt.split)]
        counts = Counter(r.model or "refused" for r in part)
        rows.append({"split": split, "label": label, "n": len(part), **{m: counts.get(m, 0) for m in models},
                     "refused": counts.get("refused", 0)})
    return rows


def rule_rows(routed: Sequence[Routed], policy: RoutePolicy) -> list[dict[str, Any]]:
    """Per rule of the route (and its default): its model and how many easy and hard prompts it took."""
    counts = Counter((r.rule, r.prompt.label) for r in routed if r.answered)
    rules = [(r.label, r.model) for r in policy.rules] + [("default", policy.default)]
    return [{"rule": label, "model": model, "easy": counts.get((label, "easy"), 0),
             "hard": counts.get((label, "hard"), 0)} for label, model in rules]


def classifier_rows(routed: Sequence[Routed], policy: RoutePolicy) -> tuple[list[dict[str, Any]], list[str]]:
    """Accuracy, precision and recall for hard of every classifier whose verdict the route header shows on
    every answered prompt, per split; and a line for each classifier it does not show."""
    answered = [r for r in routed if r.answered]
    rows, unseen = [], []
    for name, spec in policy.classifiers.items():
        k = policy.classifier_rule(name)
        if k is None:
            unseen.append(f"classifier {name}: no rule of `{ROUTE}` is only `{{classifier: {name}}}`, so the route "
                          "header does not show its verdict; no figure.")
            continue
        said = {r.prompt.id: policy.predicts(name, r.rule or "default") for r in answered}
        hidden = [r for r in answered if said[r.prompt.id] is None]
        if hidden:
            earlier = ", ".join(sorted({r.rule or "" for r in hidden}))
            unseen.append(f"classifier {name} (rule {policy.rules[k].label}): its verdict does not show for "
                          f"{len(hidden)} of {len(answered)} prompts, which matched an earlier rule ({earlier}); "
                          "no figure.")
            continue
        threshold = float(spec.get("threshold", 0.5))
        for split in ("test", "train"):
            part = [r for r in answered if r.prompt.split == split]
            q = Quality.of([bool(said[r.prompt.id]) for r in part], [r.prompt.hard for r in part])
            rows.append({"classifier": name, "rule": policy.rules[k].label, "threshold": threshold, "split": split,
                         "n": q.n, "accuracy": q.accuracy, "precision": q.precision, "recall": q.recall})
    return rows, unseen


def figures(routed: Sequence[Routed], policy: RoutePolicy) -> dict[str, Any]:
    """Every figure of the scenario as plain data."""
    compare, cheapest = policy.comparison(), policy.cheapest()
    models = policy.by_price(list({m for r in routed if (m := r.model)} | {compare, cheapest}))
    costs = cost_rows(routed, policy.prices, compare, cheapest)
    answered = [r for r in routed if r.answered]
    hard = [r for r in answered if r.prompt.hard]
    easy = [r for r in answered if not r.prompt.hard]
    hard_cheap = [r for r in hard if r.model == cheapest]
    easy_top = [r for r in easy if r.model == compare]
    classifiers, unseen = classifier_rows(routed, policy)
    return {
        "prompts": len(routed), "compare": compare, "cheapest": cheapest, "models": models,
        "by_label": model_rows(routed, models), "by_rule": rule_rows(routed, policy),
        "classifiers": classifiers, "classifiers_not_shown": unseen,
        "costs": costs, "cost_ratio": costs[2]["ratio"], "easy_cost_ratio": costs[0]["ratio"],
        "hard_to_cheapest": len(hard_cheap) / len(hard) if hard else None,
        "easy_to_compare": len(easy_top) / len(easy) if easy else None,
        "misrouted": [{"id": r.prompt.id, "split": r.prompt.split, "model": r.model, "rule": r.rule,
                       "prompt": _excerpt(r.prompt.prompt)} for r in (*hard_cheap, *easy_top)][:MAX_LISTED],
        "refused": len(routed) - len(answered),
        "refusals": dict(Counter(str(r.status) for r in routed if not r.answered)),
        "served_elsewhere": sum(1 for r in answered if r.served != r.model),
        "prompt_tokens": sum(r.prompt_tokens for r in answered),
    }


def _below(value: float | None, limit: float, *, inclusive: bool = False) -> bool | None:
    if value is None:
        return None
    return value <= limit if inclusive else value < limit


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _excerpt(prompt: str, limit: int = 90) -> str:
    one_line = " ".join(prompt.split())
    return one_line if len(one_line) <= limit else one_line[: limit - 1] + "…"


def tables_of(f: dict[str, Any]) -> list[dict[str, Any]]:
    """The scenario's tables from :func:`figures`."""
    models = f["models"]
    by_label = table(f"Where `{ROUTE}` sent each prompt ({TIER} tier)",
                     [text("split", "split"), text("label", "label"), num("n", "prompts", 0),
                      *[num(m, m, 0) for m in models], num("refused", "refused", 0)],
                     f["by_label"], f"{f['prompts']} prompts of the labelled set sent to the gateway; the shipped "
                     "`policies.yaml`. The rules and the classifier's weights were chosen on the train split; the "
                     "test rows are the unseen part.")
    by_rule = table(f"Rules of `{ROUTE}` that matched",
                    [text("rule", "rule"), text("model", "model"), num("easy", "easy", 0), num("hard", "hard", 0)],
                    f["by_rule"], "First matching rule wins; `default` when none matched (from `x-switchyard-route`).")
    quality = table("Difficulty classifier: hard vs easy",
                    [text("classifier", "classifier"), text("rule", "rule"), num("threshold", "threshold", 2),
                     text("split", "split"), num("n", "prompts", 0), pct("accuracy", "accuracy %"),
                     pct("precision", "hard precision %"), pct("recall", "hard recall %")],
                    f["classifiers"], "Predicted hard: the rule that is only `{classifier: NAME}` matched. The "
                    "weights were fitted on the train split only; the test split is the honest figure.")
    cost = table("Cost per 1,000 requests (USD)",
                 [text("prompts", "prompts"), num("n", "n", 0), num("auto", ROUTE, 4),
                  num("all", f"all on {f['compare']}", 4), ratio("ratio", f"{ROUTE} ÷ all-{f['compare']}"),
                  num("labels", f"by the labels ({f['cheapest']} / {f['compare']})", 4),
                  ratio("labels_ratio", f"labels ÷ all-{f['compare']}")],
                 f["costs"],
                 "Each prompt's prompt tokens (the engine's `usage.prompt_tokens`) plus its expected answer length, "
                 "at the model's prices (`models[].price`), averaged and scaled to 1,000 requests. *By the labels*: "
                 f"easy prompts on {f['cheapest']}, hard ones on {f['compare']} (what a perfect classifier with these "
                 f"two models would cost). The {100 * MIX_HARD_SHARE:g}%-hard mix weighs the easy and hard rows.")
    risk = table("Quality risk and overspend",
                 [text("what", "what"), pct("share", "share %")],
                 [{"what": f"hard prompts sent to {f['cheapest']}", "share": f["hard_to_cheapest"]},
                  {"what": f"easy prompts sent to {f['compare']}", "share": f["easy_to_compare"]}])
    out = [by_label, by_rule, quality, cost, risk]
    if f["misrouted"]:
        out.append(table(f"Hard prompts on {f['cheapest']} and easy ones on {f['compare']}",
                         [text("id", "id"), text("split", "split"), text("model", "model"), text("rule", "rule"),
                          text("prompt", "prompt")], f["misrouted"]))
    return out


def goals_of(f: dict[str, Any]) -> list[dict[str, Any]]:
    """The scenario's goals from :func:`figures`."""
    return [
        goal(f"cost of easy prompts, {ROUTE} vs all on {f['compare']}", f"< {GOAL_EASY_COST_RATIO:g}x",
             f["easy_cost_ratio"], _below(f["easy_cost_ratio"], GOAL_EASY_COST_RATIO), unit="x"),
        goal(f"cost of the whole set, {ROUTE} vs all on {f['compare']}", "< 1x", f["cost_ratio"],
             _below(f["cost_ratio"], 1.0), unit="x",
             note=f"{f['costs'][3]['ratio']:.2f}x at a {100 * MIX_HARD_SHARE:g}%-hard mix"
             if f["costs"][3]["ratio"] is not None else ""),
        goal(f"hard prompts sent to {f['cheapest']}", f"≤ {100 * GOAL_HARD_TO_CHEAPEST:g}%", f["hard_to_cheapest"],
             _below(f["hard_to_cheapest"], GOAL_HARD_TO_CHEAPEST, inclusive=True), unit="%", multiplier=100,
             decimals=1),
    ]


# --- the run --------------------------------------------------------------------------------------


def run(ctx: ScenarioContext) -> Outcome:
    """Run the auto scenario and write its report into ``ctx.out_dir``."""
    opts = ctx.options
    time_scale = opts.time_scale or TIME_SCALE
    source = shipped_policy()
    document = source.read_text(encoding="utf-8")
    policy = RoutePolicy.parse(document)
    every = QUICK_EVERY if opts.quick else 1
    prompts = load_prompts()[::every]

    ports = free_ports(endpoint_count(document))
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
               f"{f['compare']} ({_times(whole['ratio'])}; easy prompts {_times(f['easy_cost_ratio'])}); "
               f"{100 * (f['hard_to_cheapest'] or 0):.1f}% of hard prompts went to {f['cheapest']}")
    return Outcome(ROUTE, "ok", summary, goals, tables, f"{ROUTE}/report.md", notes=notes[:1])
