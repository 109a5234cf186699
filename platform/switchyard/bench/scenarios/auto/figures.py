"""The ``auto`` scenario's figures: what the gateway did with each prompt (from the route header and the usage),
where each label went and through which rule, the classifiers' quality, the cost per 1,000 requests against
the comparison model and the labels, and the report's tables and goals."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from switchyard.bench.labelled import LabelledPrompt, Quality
from switchyard.bench.results import Result, parse_route
from switchyard.bench.scenarios.auto.client import TIER
from switchyard.bench.scenarios.auto.policy import ROUTE, Price, RoutePolicy
from switchyard.bench.tables import goal, num, pct, ratio, table, text

#: Goals: easy prompts should cost a fraction of what they cost on the comparison model, all prompts
#: less, and few hard prompts should land on the cheapest model.
GOAL_EASY_COST_RATIO = 0.25
GOAL_HARD_TO_CHEAPEST = 0.10
#: A traffic mix the costs are also shown for (the set itself is nearly half hard; real traffic is
#: usually mostly easy): this share of hard requests, at the set's mean cost per label.
MIX_HARD_SHARE = 0.2
#: Misrouted prompts listed in the report, at most.
MAX_LISTED = 20


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
