"""The ``cache`` scenario's workload: seeded Poisson arrivals over three families (``chat``, ``faq``,
``sampled``), each request's prompt or question drawn by Zipf; the repeat bounds of a workload, the
repeats a run's timing left reachable, and the exact repeats of the public Mooncake traces."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from switchyard.bench.policies import TENANT
from switchyard.bench.prompts import LiteralText, PromptText, SynthText, unique_key
from switchyard.bench.results import Result
from switchyard.bench.scenarios.cache.questions import FAQ_OUTPUT_TOKENS, QuestionSet
from switchyard.bench.scenarios.prefix import default_trace
from switchyard.bench.spec import Labels, RequestSpec, Workload

Family = Literal["chat", "faq", "sampled"]
FAMILIES: tuple[Family, ...] = ("chat", "faq", "sampled")
#: Rule (as named in the policy) by family, and its mode.
RULES: dict[Family, str] = {"chat": "exact", "faq": "faq"}
MODES = {"exact": "exact", "faq": "semantic"}
MODELS: dict[Family, str] = {"chat": "chat", "faq": "faq", "sampled": "chat"}
#: Share of each family in the workload.
SHARES: dict[Family, float] = {"chat": 0.6, "faq": 0.3, "sampled": 0.1}
STREAM_SHARE = 0.7
ZIPF_S = 1.0
CHAT_ITEMS = 400
FAQ_QUESTIONS = 60
CHAT_PROMPT_TOKENS = (200, 1000)
CHAT_OUTPUT_TOKENS = (32, 96)
PARAPHRASE_SHARE = 0.5
SAMPLED_TEMPERATURE = 0.8
#: The public Mooncake traces whose exact repeats the report quotes (beside the default trace).
TRACE_NAMES = ("mooncake_conversation.jsonl", "mooncake_synthetic.jsonl")


def zipf_weights(n: int, s: float = ZIPF_S) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Popularity of ranks 1..n under Zipf's law with exponent ``s`` (normalised to sum to 1)."""
    if n < 1:
        raise ValueError("a Zipf catalogue needs at least one item")
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    normalised: np.ndarray[Any, np.dtype[np.float64]] = weights / weights.sum()
    return normalised


@dataclass(frozen=True, slots=True)
class Item:
    """What one request of the workload is, for the analysis.

    Attributes:
        family: ``chat``, ``faq`` or ``sampled``.
        key: The request's identity: equal keys are the same request (the exact cache's key, in effect).
        group: What a semantic hit may reuse: the question for ``faq`` (any wording), the key otherwise.
        cacheable: Deterministic (``temperature: 0``), under a cache rule.
        paraphrase: A ``faq`` request in a rewording (not the canonical wording).
    """

    family: Family
    key: str
    group: str
    cacheable: bool
    paraphrase: bool = False


@dataclass(frozen=True, slots=True)
class CacheWorkload:
    """A workload with repeats and what each of its requests is.

    Attributes:
        workload: The schedule (``workload.specs[i]`` is ``items[i]``).
        items: Per request, its family and identity.
        questions: The FAQ questions it asks.
    """

    workload: Workload
    items: tuple[Item, ...]
    questions: QuestionSet


def build_workload(*, rate_per_s: float, duration_s: float, seed: int, questions: QuestionSet, salt: str = "",
                   chat_items: int = CHAT_ITEMS, shares: Mapping[Family, float] = SHARES,
                   stream_share: float = STREAM_SHARE, paraphrase_share: float = PARAPHRASE_SHARE,
                   zipf_s: float = ZIPF_S) -> CacheWorkload:
    """Seeded Poisson arrivals over the three families, each request's prompt (or question) drawn by Zipf.

    Everything but the ``chat`` prompts' texts depends on ``seed`` alone; ``salt`` changes those texts (same
    lengths, same repeats), so that a second arm does not meet the first one's engine prefix caches.
    """
    rng = np.random.default_rng(seed)
    count = int(rng.poisson(rate_per_s * duration_s)) if rate_per_s > 0 and duration_s > 0 else 0
    times = np.sort(rng.uniform(0.0, duration_s, count))
    shares_ = np.array([shares.get(f, 0.0) for f in FAMILIES], dtype=np.float64)
    families = rng.choice(len(FAMILIES), size=count, p=shares_ / shares_.sum())
    chat_pick = rng.choice(chat_items, size=count, p=zipf_weights(chat_items, zipf_s))
    faq = questions.questions
    faq_pick = rng.choice(len(faq), size=count, p=zipf_weights(len(faq), zipf_s)) if faq else np.zeros(count, int)
    reworded = rng.random(count) < paraphrase_share
    wording_draw = rng.random(count)
    streams = rng.random(count) < stream_share
    lengths = rng.integers(CHAT_PROMPT_TOKENS[0], CHAT_PROMPT_TOKENS[1], chat_items, endpoint=True)
    budgets = rng.integers(CHAT_OUTPUT_TOKENS[0], CHAT_OUTPUT_TOKENS[1], chat_items, endpoint=True)
    specs: list[RequestSpec] = []
    items: list[Item] = []
    for i in range(count):
        family = FAMILIES[int(families[i])]
        stream = bool(streams[i])
        prompt: PromptText
        if family == "faq":
            question = faq[int(faq_pick[i])]
            others = len(question.wordings) - 1
            wording = 1 + min(others - 1, int(wording_draw[i] * others)) if reworded[i] and others else 0
            prompt = LiteralText(question.wordings[wording])
            max_tokens = question.max_tokens
            extra: dict[str, Any] = {"temperature": 0}
            item = Item("faq", f"faq:{question.index}:{wording}", f"faq:{question.index}", True, wording > 0)
        else:
            index = int(chat_pick[i])
            prompt = SynthText(((unique_key("cache-bench", seed, salt, index), int(lengths[index])),), seed)
            max_tokens = int(budgets[index])
            if family == "chat":
                extra = {"temperature": 0}
                item = Item("chat", f"chat:{index}", f"chat:{index}", True)
            else:
                extra = {"temperature": SAMPLED_TEMPERATURE}
                item = Item("sampled", f"sampled:{i}", f"sampled:{i}", False)
        labels = Labels(tenant=TENANT, request_class=family, model=MODELS[family], stream=stream,
                        extra_body={**extra, "ignore_eos": True})
        specs.append(RequestSpec(i, float(times[i]), prompt, max_tokens, labels, item.group))
        items.append(item)
    source = {"source": "zipf-repeats", "seed": seed, "rate_per_s": rate_per_s, "duration_s": duration_s,
              "zipf_s": zipf_s, "chat_items": chat_items, "faq_questions": len(faq),
              "shares": {f: shares.get(f, 0.0) for f in FAMILIES}, "stream_share": stream_share,
              "paraphrase_share": paraphrase_share, "chat_prompt_tokens": list(CHAT_PROMPT_TOKENS),
              "chat_output_tokens": list(CHAT_OUTPUT_TOKENS), "faq_output_tokens": list(FAQ_OUTPUT_TOKENS),
              "sampled_temperature": SAMPLED_TEMPERATURE, "text_salt": salt}
    return CacheWorkload(Workload(tuple(specs), duration_s, source), tuple(items), questions)


@dataclass(frozen=True, slots=True)
class Bound:
    """How many requests of a family could be answered from a cache at best, in arrival order.

    Attributes:
        requests: Requests of the family.
        repeats: Requests whose ``key`` was sent before (an exact cache's bound).
        group_repeats: Requests whose ``group`` was sent before (a semantic cache's bound).
    """

    requests: int
    repeats: int
    group_repeats: int

    @property
    def exact(self) -> float | None:
        """The repeat fraction (the bound of an exact cache's hit ratio)."""
        return self.repeats / self.requests if self.requests else None

    @property
    def semantic(self) -> float | None:
        """The fraction of requests whose question was asked before (the bound of a semantic cache)."""
        return self.group_repeats / self.requests if self.requests else None


def repeat_bounds(items: Sequence[Item]) -> dict[str, Bound]:
    """Per family (and ``all``), the requests and the repeats of an earlier one (by key and by group).

    Requests that are not cacheable are never repeats. ``all`` counts every request, and as repeats the
    key repeats of ``chat`` and the group repeats of ``faq``: the bound of the whole workload's hit ratio.
    """
    keys: set[str] = set()
    groups: set[str] = set()
    counts: dict[str, list[int]] = {f: [0, 0, 0] for f in FAMILIES}
    for item in items:
        c = counts[item.family]
        c[0] += 1
        if item.cacheable:
            c[1] += item.key in keys
            c[2] += item.group in groups
        keys.add(item.key)
        groups.add(item.group)
    out = {f: Bound(*c) for f, c in counts.items()}
    total = sum(b.requests for b in out.values())
    best = out["chat"].repeats + out["faq"].group_repeats
    out["all"] = Bound(total, best, best)
    return out


def reachable(results: Sequence[Result], items: Sequence[Item], *, by: Literal["key", "group"]) -> list[bool]:
    """Per request: whether an answer to the same ``key`` (or ``group``) had completed when it was sent.

    A repeat sent while the first answer is still being generated cannot hit (nothing is stored yet): the
    requests marked here are what a cache could have answered at best, given the timing of this run.
    """
    done: dict[str, float] = {}
    for r in results:
        if r.ok:
            who = getattr(items[r.index], by)
            done[who] = min(done.get(who, r.done_s), r.done_s)
    return [items[r.index].cacheable and done.get(getattr(items[r.index], by), float("inf")) <= r.sent_s
            for r in results]


# --- the public traces' repeats ----------------------------------------------------------------------------


class _HashIds(msgspec.Struct):
    hash_ids: list[int]


def trace_repeats(path: Path) -> tuple[int, int]:
    """Rows of a Mooncake trace, and those whose whole ``hash_ids`` list (the same prompt) came before."""
    decode = msgspec.json.Decoder(_HashIds).decode
    seen: set[tuple[int, ...]] = set()
    rows = repeats = 0
    with path.open("rb") as lines:
        for line in lines:
            if not line.strip():
                continue
            ids = tuple(decode(line).hash_ids)
            rows += 1
            repeats += ids in seen
            seen.add(ids)
    return rows, repeats


def public_repeats(trace: Path | None) -> list[str]:
    """One phrase per public Mooncake trace found: its rows and exact-repeat fraction."""
    base = trace or default_trace()
    paths = [base, *[base.parent / name for name in TRACE_NAMES if (base.parent / name) != base]]
    out = []
    for path in paths:
        if not path.exists():
            continue
        try:
            rows, repeats = trace_repeats(path)
        except (OSError, msgspec.DecodeError):
            continue
        if rows:
            out.append(f"{path.name}: {repeats:,} of {rows:,} rows ({100 * repeats / rows:.1f}%)")
    return out
