"""A request's priority class: its tier's class, optionally lowered by the request itself.

A request's class is its tenant's tier's class, optionally *lowered* (never raised) by the
``x-switchyard-priority`` header (a class name) or the body's ``priority`` (a class name, or an
integer in vLLM's sense: the request takes the last class whose engine priority is at most that
number, and the engine gets the number itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.api.headers import PRIORITY_HEADER
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.policy.tiers import PriorityClass


class BadPriority(ValueError):
    """The request asks for a priority that is not a class of the policy (or not a number)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class ClassDecision:
    """The class a request is served in, and why.

    Attributes:
        name: The class's name.
        cls: The class as the policy declares it.
        rank: Its position in ``priorities`` (0 is the best).
        engine_priority: The vLLM ``priority`` the request carries to pools that honour it.
        tier_class: The tier's class (``name`` differs when the request lowered itself).
        trace: One sentence for the decision trace.
    """

    name: str
    cls: PriorityClass
    rank: int
    engine_priority: int
    tier_class: str
    trace: str


def _named_class(snapshot: PolicySnapshot, value: str, where: str, param: str) -> str:
    if value not in snapshot.priorities:
        known = ", ".join(snapshot.priorities)
        raise BadPriority(f"Unknown priority class {value!r} in {where}; the policy's classes are: {known}.", param)
    return value


def classify(snapshot: PolicySnapshot, tier_name: str, header: str | None, asked: object) -> ClassDecision:
    """The class of a request from a tenant of ``tier_name`` (the tier must exist in ``snapshot``).

    Raises:
        BadPriority: the header or body names an unknown class, or the body's ``priority`` is
            neither a class name nor an integer.
    """
    base = snapshot.tiers[tier_name].priority
    ranks = snapshot.class_rank
    chosen, by, engine = base, None, snapshot.engine_priority[base]
    wanted: list[tuple[str, str, int | None]] = []
    if header is not None:
        where = f"the {PRIORITY_HEADER} header"
        wanted.append((_named_class(snapshot, header.strip(), where, PRIORITY_HEADER), where, None))
    if isinstance(asked, str):
        wanted.append((_named_class(snapshot, asked, "priority", "priority"), "the body's priority", None))
    elif isinstance(asked, int) and not isinstance(asked, bool):
        # vLLM's sense: a larger number is served later. The last class at or below it.
        by_number = base
        for name in snapshot.priorities:
            if snapshot.engine_priority[name] <= asked and ranks[name] > ranks[by_number]:
                by_number = name
        wanted.append((by_number, "the body's priority", asked))
    elif asked is not None:
        raise BadPriority("priority must be an integer (vLLM's request priority) or the name of a priority "
                          "class.", "priority")
    notes = []
    for name, source, number in wanted:
        if ranks[name] > ranks[chosen]:
            chosen, by = name, source
        elif ranks[name] < ranks[base]:
            notes.append(f"{source} asked for {name}, which is above the tier's class (a request may only "
                         f"lower its class)")
        if number is not None and number > engine:
            engine = number
    engine = max(engine, snapshot.engine_priority[chosen])
    if by is None:
        trace = f"class {chosen} (tier {tier_name})"
    else:
        trace = f"class {chosen} (tier {tier_name}'s class {base}, lowered by {by})"
    if notes:
        trace += "; " + "; ".join(notes)
    return ClassDecision(chosen, snapshot.priorities[chosen], ranks[chosen], engine, base, trace)
