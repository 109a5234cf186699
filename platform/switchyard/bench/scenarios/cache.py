"""``cache``: the response caches on a workload with repeats: hit ratio, and how fast a hit is served.

**Workload.** The public traces carry too few repeats to measure a response cache in a run of
minutes (Mooncake's ``hash_ids``: requests whose whole block-hash lists are equal are the same
prompt; that is 1.0% of the conversation trace over its hour, 5.3% of the synthetic one; the
report recomputes both where the traces are found), so the load is a synthetic one with repeats:
seeded Poisson arrivals over three families of requests, each request's item drawn from a Zipf
distribution (popularity of rank ``r`` proportional to ``1 / r**ZIPF_S``):

- ``chat`` (``SHARES``): one of ``CHAT_ITEMS`` distinct prompts (200-1,000 tokens of synthetic
  text, a fixed ``max_tokens`` per prompt), ``temperature: 0``: the ``exact`` rule. A request is a
  *repeat* when the same prompt was sent before; the repeat fraction is the exact rule's bound.
- ``faq``: one of ``FAQ_QUESTIONS`` short questions (generated from word lists, kept only when their
  every wording is below ``CROSS_LIMIT`` cosine to every other question's under the simulator's
  embedding, ``switchyard.sim.embeddings.embed_text``), asked in its canonical wording or, for
  ``PARAPHRASE_SHARE`` of them, in a rewording (lower case without punctuation, "Please, ...",
  "... Thanks!", "Could you tell me: ..."; a rewording is kept only when its cosine to every other
  kept wording is at least ``PARAPHRASE_FLOOR``), ``temperature: 0``: the ``faq`` rule (semantic,
  ``min_similarity`` ``MIN_SIMILARITY``). Its bound: the fraction of requests whose *question* was
  asked before, in any wording; the fraction whose exact wording was is what an exact cache gets.
- ``sampled``: a ``chat`` prompt at ``temperature`` ``SAMPLED_TEMPERATURE``: never cached (the
  gateway caches deterministic requests only), a check that none is answered from the cache.

``STREAM_SHARE`` of the requests stream (TTFT matters there), the rest ask for the whole answer;
both share cache entries (``stream`` is not part of the key).

**Arms.** One gateway on one set of engines (``REPLICAS`` simulated ``PROFILE`` replicas serving
both models, plus an embeddings engine for the semantic rule), the policy's two cache rules
(``bench.policies.cache_policy``, the in-process cache). ``cache``: the workload as it is.
``no-cache``: the same schedule and repeat structure right after, every request sending
``x-switchyard-cache-control: no-cache, no-store`` (no lookup, no store: the gateway as it is
without the cache). The ``chat`` prompts of the second arm are other texts of the same lengths, so
that it does not inherit the first arm's engine prefix caches; the ``faq`` questions are the same.
A few warm-up requests (``no-store``, texts of their own) precede the arms. Each arm lasts
``DURATION_S`` (``QUICK_DURATION_S`` with ``--quick``; ``--duration-s`` sets it) at ``RATE``
requests/s (times ``--rate-multiplier``); the engines run at ``--time-scale`` (default 1: real time).

**Figures.** From the ``x-switchyard-cache`` response header of every request: hits per rule,
hit ratio against the repeat bound and against the *reachable* bound (repeats sent after an answer
to the same prompt, or question, had completed: a repeat sent while the first is still being
generated cannot hit), paraphrase hits (hits an exact cache would have missed) and their
similarity; cross-checked with the gateway's ``switchyard_cache_lookups_total`` deltas. Latency
(TTFT and end-to-end, from the scheduled time) of hits p50/p99 against misses and against the
same requests without the cache, streamed and whole; what a miss pays for the lookup (against the
same requests without the cache; a semantic lookup embeds the request first). Engine requests per arm
(``vllm:request_success_total`` deltas): those saved should equal the hits. Cache entries and bytes
at the end (``switchyard_cache_entries``, ``switchyard_cache_bytes``; the gateway refreshes them
every 5 s). Goals: hits ``GOAL_SPEEDUP`` times faster than misses end to end at p50; exact and
semantic hit ratios at least ``GOAL_OF_BOUND`` of their repeat bounds; engine requests saved
equal to hits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import msgspec
import numpy as np

from switchyard.bench.loadgen import Target, connection_limit, send_one
from switchyard.bench.policies import TENANT, TIER, cache_policy
from switchyard.bench.procs import create_key, free_ports, start_gateway, start_sims, state_env
from switchyard.bench.prompts import LiteralText, PromptText, SynthText, unique_key
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.sampler import MetricsSampler, scrape_text, sum_series
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.scenarios.overload import samples
from switchyard.bench.scenarios.prefix import default_trace
from switchyard.bench.spec import Labels, RequestSpec, Workload
from switchyard.bench.stats import percentiles
from switchyard.bench.tables import goal, ms, num, pct, ratio, table, text
from switchyard.figures import fixed, percent
from switchyard.sim.embeddings import embed_text

Family = Literal["chat", "faq", "sampled"]
FAMILIES: tuple[Family, ...] = ("chat", "faq", "sampled")
#: The arms, in the order they run: the cache first, then the same gateway told to skip it.
ARMS = ("cache", "no-cache")
BASELINE = "no-cache"
#: Rule (as named in the policy) by family, and its mode.
RULES: dict[Family, str] = {"chat": "exact", "faq": "faq"}
MODES = {"exact": "exact", "faq": "semantic"}
MODELS: dict[Family, str] = {"chat": "chat", "faq": "faq", "sampled": "chat"}
REPLICAS = 2
PROFILE = "h100-8b"
SERVED = "sim-8b"
EMBED_SERVED = "sim-emb"
KV_TOKENS = 100_000
CONTEXT = 8192
TIME_SCALE = 1.0
RATE = 12.0
DURATION_S = 60.0
QUICK_DURATION_S = 6.0
#: Share of each family in the workload.
SHARES: dict[Family, float] = {"chat": 0.6, "faq": 0.3, "sampled": 0.1}
STREAM_SHARE = 0.7
ZIPF_S = 1.0
CHAT_ITEMS = 400
FAQ_QUESTIONS = 60
CHAT_PROMPT_TOKENS = (200, 1000)
CHAT_OUTPUT_TOKENS = (32, 96)
FAQ_OUTPUT_TOKENS = (32, 64)
PARAPHRASE_SHARE = 0.5
MIN_SIMILARITY = 0.8
#: Every pair of kept wordings of one question is at least this similar (a margin above MIN_SIMILARITY).
PARAPHRASE_FLOOR = 0.82
#: A question is kept only when each of its wordings is below this similarity to every other question's.
CROSS_LIMIT = 0.7
SAMPLED_TEMPERATURE = 0.8
CLIENT_TIMEOUT_S = 60.0
SCRAPE_TIMEOUT_S = 5.0
#: Wait after an arm's last answer before reading the counters (a miss is stored just after it is sent).
SETTLE_S = 0.5
#: The gateway copies the cache's entry and byte counts into its gauges this often (``CACHE_GAUGES_INTERVAL_S``).
GAUGE_REFRESH_S = 5.0
GOAL_SPEEDUP = 10.0
GOAL_OF_BOUND = 0.9

CACHE_HEADER = "x-switchyard-cache"
CONTROL_HEADER = "x-switchyard-cache-control"
BASELINE_CONTROL = "no-cache, no-store"
LOOKUPS = "switchyard_cache_lookups_total"
STORES = "switchyard_cache_stores_total"
ENTRIES = "switchyard_cache_entries"
BYTES = "switchyard_cache_bytes"
FINISHED = "vllm:request_success_total"
RUNNING = "vllm:num_requests_running"
#: The public Mooncake traces whose exact repeats the report quotes (beside the default trace).
TRACE_NAMES = ("mooncake_conversation.jsonl", "mooncake_synthetic.jsonl")


# --- the FAQ questions and their wordings -----------------------------------------------------------------

_OPENERS = ("How do I", "How can I", "Where can I", "What is the way to", "Is there a way to", "Can I")
_VERBS = ("reset", "change", "update", "cancel", "renew", "transfer", "recover", "export", "delete", "share",
          "verify", "upgrade", "configure", "pause", "restore", "download", "merge", "rename", "lock", "archive")
_OBJECTS = ("password", "billing address", "subscription", "invoice", "payment card", "email address",
            "phone number", "order", "shipping label", "refund request", "gift card", "warranty", "delivery slot",
            "profile photo", "security questions", "two-factor login", "data plan", "router firmware",
            "backup codes", "loyalty points", "contact list", "calendar", "API token", "team seat",
            "storage quota", "printer driver", "parental controls", "voicemail", "tax receipt", "license key")
_PLACES = ("on my account", "in the mobile app", "from the web dashboard", "on my router", "for my family plan",
           "on the new laptop", "after moving abroad", "without the old phone", "for a business account",
           "before the trial ends", "on a shared tablet", "during checkout")


def rewordings(question: str) -> list[str]:
    """The canonical wording of ``question`` first, then its rewordings (case, punctuation, politeness)."""
    lower = question[:1].lower() + question[1:]
    return [question, question.rstrip("?").lower(), f"Please, {lower}", f"{question} Thanks!",
            f"Could you tell me: {lower}"]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors."""
    va, vb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norm = float(np.linalg.norm(va) * np.linalg.norm(vb))
    return float(va @ vb) / norm if norm else 0.0


@dataclass(frozen=True, slots=True)
class Question:
    """One FAQ question.

    Attributes:
        index: Its rank in popularity (0: the most asked).
        wordings: Its kept wordings, the canonical one first.
        max_tokens: The answer budget every wording is sent with (the semantic context includes it).
    """

    index: int
    wordings: tuple[str, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class QuestionSet:
    """The FAQ questions and how their wordings compare under the simulator's embedding.

    Attributes:
        questions: The questions, by popularity rank.
        paraphrase_min: The least cosine between two wordings of one question (1.0 with one wording each).
        cross_max: The greatest cosine between wordings of two different questions (0.0 with one question).
        dropped: Rewordings left out for falling below ``PARAPHRASE_FLOOR`` to another wording.
    """

    questions: tuple[Question, ...]
    paraphrase_min: float
    cross_max: float
    dropped: int


def _keep_wordings(candidates: Sequence[str], floor: float) -> tuple[list[str], np.ndarray[Any, Any], int]:
    """The canonical wording and every rewording at least ``floor`` similar to all kept before it."""
    kept: list[str] = []
    vectors: list[list[float]] = []
    for wording in candidates:
        vector = embed_text(wording)
        if all(cosine(vector, v) >= floor for v in vectors):
            kept.append(wording)
            vectors.append(vector)
    return kept, np.asarray(vectors, dtype=np.float64), len(candidates) - len(kept)


def faq_questions(count: int, seed: int, *, floor: float = PARAPHRASE_FLOOR, cross_limit: float = CROSS_LIMIT,
                  output_tokens: tuple[int, int] = FAQ_OUTPUT_TOKENS, max_tries: int = 20_000) -> QuestionSet:
    """``count`` distinct questions (the same for a seed), each with the wordings a semantic cache should match.

    A candidate question is drawn from the word lists; it is kept when every wording of it is below
    ``cross_limit`` cosine to every wording of the questions kept so far (so no two questions can be taken for
    each other at ``MIN_SIMILARITY``), with those of its rewordings that are at least ``floor`` similar to every
    other kept wording.

    Raises:
        ValueError: ``count`` distinct questions were not found in ``max_tries`` draws.
    """
    rng = np.random.default_rng(seed)
    questions: list[Question] = []
    matrices: list[np.ndarray[Any, Any]] = []
    dropped = tries = 0
    seen: set[str] = set()
    while len(questions) < count:
        tries += 1
        if tries > max_tries:
            raise ValueError(f"only {len(questions)} of {count} distinct questions in {max_tries} draws")
        draw = [int(rng.integers(len(words))) for words in (_OPENERS, _VERBS, _OBJECTS, _PLACES)]
        canonical = f"{_OPENERS[draw[0]]} {_VERBS[draw[1]]} the {_OBJECTS[draw[2]]} {_PLACES[draw[3]]}?"
        if canonical in seen:
            continue
        seen.add(canonical)
        kept, vectors, lost = _keep_wordings(rewordings(canonical), floor)
        if matrices and float((np.concatenate(matrices) @ vectors.T).max()) >= cross_limit:
            continue
        dropped += lost
        budget = int(rng.integers(output_tokens[0], output_tokens[1], endpoint=True))
        questions.append(Question(len(questions), tuple(kept), budget))
        matrices.append(vectors)
    within = [float((m @ m.T).min()) for m in matrices]
    cross = 0.0
    for i, m in enumerate(matrices[1:], 1):
        cross = max(cross, float((np.concatenate(matrices[:i]) @ m.T).max()))
    return QuestionSet(tuple(questions), min(within, default=1.0), cross, dropped)


# --- the workload --------------------------------------------------------------------------------------------


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


# --- what the cache said -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Seen:
    """The ``x-switchyard-cache`` header of one response.

    Attributes:
        result: ``hit``, ``miss``, ``error`` (the cache or the embedding failed: served as a miss),
            ``bypass`` (the client did not let it read), or ``none`` (no header: no rule applied).
        rule: The rule's name ('' without a header).
        mode: ``exact`` or ``semantic`` ('' without a header).
        similarity: A semantic hit's similarity.
    """

    result: str = "none"
    rule: str = ""
    mode: str = ""
    similarity: float | None = None

    @property
    def hit(self) -> bool:
        """Answered from the cache."""
        return self.result == "hit"


def parse_cache_header(value: str | None) -> Seen:
    """A :class:`Seen` from ``hit; rule=faq; mode=semantic; similarity=0.930`` (None: no header)."""
    if not value:
        return Seen()
    head, *parts = [p.strip() for p in value.split(";")]
    fields = dict(p.partition("=")[::2] for p in parts if "=" in p)
    try:
        similarity = float(fields["similarity"]) if "similarity" in fields else None
    except ValueError:
        similarity = None
    return Seen(head or "none", fields.get("rule", ""), fields.get("mode", ""), similarity)


# --- the gateway's and the engines' counters ---------------------------------------------------------------


@dataclass
class Counters:
    """The cache's counters on the gateway's ``/metrics``, and the engines' finished requests, at one time.

    Attributes:
        lookups: ``(rule, mode, result)`` -> lookups.
        stores: ``(rule, mode, result)`` -> answers offered to the cache.
        entries: Entries in the cache (the gateway's gauge).
        bytes: Bytes of the entries.
        engine_finished: ``vllm:request_success_total`` summed over the generating engines (None: not read).
    """

    lookups: dict[tuple[str, str, str], float] = field(default_factory=dict)
    stores: dict[tuple[str, str, str], float] = field(default_factory=dict)
    entries: float | None = None
    bytes: float | None = None
    engine_finished: float | None = None


def _by_labels(text_: str, name: str) -> dict[tuple[str, str, str], float]:
    out: dict[tuple[str, str, str], float] = {}
    for labels, value in samples(text_, name):
        key = (labels.get("rule", "-"), labels.get("mode", "-"), labels.get("result", "-"))
        out[key] = out.get(key, 0.0) + value
    return out


def read_counters(gateway: str | None, engines: Sequence[str | None]) -> Counters:
    """:class:`Counters` from the gateway's ``/metrics`` text and the engines' (None: not read)."""
    out = Counters()
    if gateway is not None:
        out.lookups = _by_labels(gateway, LOOKUPS)
        out.stores = _by_labels(gateway, STORES)
        if f"# TYPE {ENTRIES} " in gateway:
            out.entries = sum_series(gateway, ENTRIES)
            out.bytes = sum_series(gateway, BYTES)
    if engines and all(t is not None for t in engines):
        out.engine_finished = sum(sum_series(t, FINISHED) for t in engines if t is not None)
    return out


def grown(lo: Mapping[tuple[str, str, str], float], hi: Mapping[tuple[str, str, str], float]) -> dict[
        tuple[str, str, str], float]:
    """What each labelled counter grew by from ``lo`` to ``hi`` (only those that grew)."""
    return {k: v - lo.get(k, 0.0) for k, v in hi.items() if v - lo.get(k, 0.0)}


def count(deltas: Mapping[tuple[str, str, str], float], *, rule: str | None = None,
          result: str | None = None) -> float:
    """The sum of ``deltas`` for one rule (None: all) and one result (None: all)."""
    return sum(v for (r, _, res), v in deltas.items() if (rule is None or r == rule)
               and (result is None or res == result))


@dataclass
class ArmRun:
    """What one arm measured.

    Attributes:
        name: ``cache`` or ``no-cache``.
        plan: The workload it ran.
        results: One result per request, in the workload's order.
        seen: Per request (by index), its ``x-switchyard-cache`` header.
        before: Counters just before its load.
        after: Counters once every request had ended.
        series: Engine series sampled during it.
    """

    name: str
    plan: CacheWorkload
    results: list[Result] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    before: Counters = field(default_factory=Counters)
    after: Counters = field(default_factory=Counters)
    series: dict[str, list[float]] = field(default_factory=dict)

    @property
    def lookups(self) -> dict[tuple[str, str, str], float]:
        """The gateway's cache lookups during the arm."""
        return grown(self.before.lookups, self.after.lookups)

    @property
    def stores(self) -> dict[tuple[str, str, str], float]:
        """The gateway's cache stores during the arm."""
        return grown(self.before.stores, self.after.stores)

    @property
    def engine_requests(self) -> float | None:
        """Requests the generating engines finished during the arm."""
        lo, hi = self.before.engine_finished, self.after.engine_finished
        return None if lo is None or hi is None else hi - lo


# --- the analysis --------------------------------------------------------------------------------------------


def _share(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def hit_rows(arm: ArmRun) -> list[dict[str, Any]]:
    """Per rule (and for the sampled requests and the whole workload): hits from the headers against the
    repeat bounds and the gateway's counters."""
    items, results, seen = arm.plan.items, arm.results, arm.seen
    bounds = repeat_bounds(items)
    lookups = arm.lookups
    rows: list[dict[str, Any]] = []
    total_hits = 0
    by: Literal["key", "group"]
    family: Family
    for family, by in (("chat", "key"), ("faq", "group")):
        rule = RULES[family]
        reach = reachable(results, items, by=by)
        mine = [r for r in results if items[r.index].family == family]
        hits = [r for r in mine if seen[r.index].hit]
        total_hits += len(hits)
        bound = bounds[family]
        best = bound.exact if family == "chat" else bound.semantic
        reach_n = sum(1 for r, ok in zip(results, reach, strict=True) if ok and items[r.index].family == family)
        sims = [s for s in (seen[r.index].similarity for r in hits) if s is not None]
        keys_before: set[str] = set()
        paraphrase_hits = 0
        for r in sorted(results, key=lambda r: r.index):
            item = items[r.index]
            if item.family == family and seen[r.index].hit and item.key not in keys_before:
                paraphrase_hits += 1
            keys_before.add(item.key)
        ratio_ = len(hits) / len(mine) if mine else None
        rows.append({
            "rule": rule, "mode": MODES[rule], "family": family, "requests": len(mine), "hits": len(hits),
            "hit_ratio": ratio_, "bound": best, "of_bound": _share(ratio_, best),
            "reachable": reach_n / len(mine) if mine else None,
            "of_reachable": _share(len(hits), reach_n) if reach_n else None,
            "exact_bound": bound.exact, "paraphrase_hits": paraphrase_hits if family == "faq" else None,
            "similarity_min": min(sims) if sims else None,
            "similarity_p50": percentiles(sims, (50,))["p50"] if sims else None,
            "misses": sum(seen[r.index].result == "miss" for r in mine), "full_hits": full_answers(hits),
            "errors": sum(seen[r.index].result == "error" for r in mine),
            "metrics_hits": count(lookups, rule=rule, result="hit"),
            "metrics_lookups": count(lookups, rule=rule)})
    sampled = [r for r in results if items[r.index].family == "sampled"]
    sampled_hits = sum(seen[r.index].hit for r in sampled)
    rows.append({"rule": "(none)", "mode": "-", "family": "sampled", "requests": len(sampled), "hits": sampled_hits,
                 "hit_ratio": sampled_hits / len(sampled) if sampled else None, "bound": 0.0 if sampled else None,
                 "with_header": sum(seen[r.index].result != "none" for r in sampled)})
    everything = bounds["all"]
    overall = total_hits / len(results) if results else None
    rows.append({"rule": "all", "mode": "-", "family": "all", "requests": len(results), "hits": total_hits,
                 "hit_ratio": overall, "bound": everything.exact, "of_bound": _share(overall, everything.exact),
                 "metrics_hits": count(lookups, result="hit"), "metrics_lookups": count(lookups)})
    return rows


def _latency(rs: Sequence[Result]) -> dict[str, Any]:
    ok = [r for r in rs if r.ok]
    ttft = percentiles([r.ttft_s for r in ok if r.ttft_s is not None], (50, 99))
    e2e = percentiles([r.e2e_s for r in ok], (50, 99))
    return {"n": len(ok), "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"], "e2e_p50_s": e2e["p50"],
            "e2e_p99_s": e2e["p99"]}


STREAM_MODES: tuple[tuple[str, bool | None], ...] = (("streamed", True), ("whole", False), ("all", None))


def _mode(rs: Iterable[Result], stream: bool | None) -> list[Result]:
    return [r for r in rs if stream is None or r.stream == stream]


def latency_groups(cache: ArmRun, base: ArmRun) -> dict[str, tuple[str, list[Result]]]:
    """The requests each latency row is over, by name: (arm, results). Cacheable requests only."""
    items, seen = cache.plan.items, cache.seen
    cacheable = [r for r in cache.results if items[r.index].cacheable]
    hit_index = {r.index for r in cacheable if seen[r.index].hit}
    return {
        "hits (exact)": ("cache", [r for r in cacheable if seen[r.index].hit and seen[r.index].mode == "exact"]),
        "hits (semantic)": ("cache", [r for r in cacheable if seen[r.index].hit and seen[r.index].mode == "semantic"]),
        "hits (all)": ("cache", [r for r in cacheable if r.index in hit_index]),
        "misses": ("cache", [r for r in cacheable if not seen[r.index].hit]),
        "the same requests as the hits": (BASELINE, [r for r in base.results if r.index in hit_index]),
        "all cacheable": (BASELINE, [r for r in base.results if base.plan.items[r.index].cacheable]),
    }


def latency_rows(cache: ArmRun, base: ArmRun) -> list[dict[str, Any]]:
    """TTFT and end-to-end p50/p99 of hits, misses and the no-cache arm, streamed and whole."""
    rows = []
    for name, (arm, rs) in latency_groups(cache, base).items():
        for mode, stream in STREAM_MODES:
            rows.append({"arm": arm, "requests": name, "stream": mode, **_latency(_mode(rs, stream))})
    return rows


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def speedup_rows(latency: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per stream mode: how many times faster hits were than misses, and than the same requests without
    the cache (p50 and p99 of TTFT and end-to-end)."""
    by = {(r["requests"], r["stream"]): r for r in latency}
    rows = []
    for mode, _ in STREAM_MODES:
        hit = by[("hits (all)", mode)]
        for against in ("misses", "the same requests as the hits"):
            other = by[(against, mode)]
            rows.append({"stream": mode, "against": against, "hits": hit["n"], "others": other["n"],
                         **{k: _div(other[k], hit[k]) for k in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s",
                                                                "e2e_p99_s")}})
    return rows


def miss_cost_rows(cache: ArmRun, base: ArmRun) -> list[dict[str, Any]]:
    """Per rule and stream mode: a miss's latency against the same requests without the cache (what the lookup,
    and for a semantic rule the embedding, adds to a request the cache cannot answer)."""
    items, seen = cache.plan.items, cache.seen
    base_by = {r.index: r for r in base.results}
    rows = []
    for family in ("chat", "faq"):
        rule = RULES[family]
        misses = [r for r in cache.results if items[r.index].family == family and not seen[r.index].hit]
        for mode, stream in STREAM_MODES[:2]:
            ours = _latency(_mode(misses, stream))
            theirs = _latency([base_by[r.index] for r in _mode(misses, stream) if r.index in base_by])
            rows.append({"rule": rule, "mode": MODES[rule], "stream": mode, "n": ours["n"],
                         "ttft_p50_s": ours["ttft_p50_s"], "base_ttft_p50_s": theirs["ttft_p50_s"],
                         "added_ttft_p50_s": _minus(ours["ttft_p50_s"], theirs["ttft_p50_s"]),
                         "e2e_p50_s": ours["e2e_p50_s"], "base_e2e_p50_s": theirs["e2e_p50_s"],
                         "added_e2e_p50_s": _minus(ours["e2e_p50_s"], theirs["e2e_p50_s"])})
    return rows


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def full_answers(results: Iterable[Result]) -> int:
    """Successful answers whose usage reports ``max_tokens`` completion tokens (every request sends
    ``ignore_eos``, so an engine's answer has exactly that many, and so must a cached copy of it)."""
    return sum(1 for r in results if r.ok and r.completion_tokens == r.max_tokens)


def distinct_stored(arm: ArmRun) -> int:
    """Distinct cache keys among the arm's successful cacheable misses: the entries the cache should hold."""
    items = arm.plan.items
    return len({items[r.index].key for r in arm.results
                if r.ok and items[r.index].cacheable and arm.seen[r.index].result == "miss"})


def engine_rows(cache: ArmRun, base: ArmRun) -> list[dict[str, Any]]:
    """Per arm: client requests, the engines' requests, those saved against the no-cache arm, hits, the
    gateway's lookups and stores, and (cache arm) the entries and bytes at the end."""
    saved_base = base.engine_requests
    rows = []
    for arm in (cache, base):
        stores = arm.stores
        engine = arm.engine_requests
        rows.append({
            "arm": arm.name, "requests": len(arm.results), "ok": sum(r.ok for r in arm.results),
            "engine_requests": engine, "per_request": _div(engine, float(len(arm.results))),
            "saved": saved_base - engine if saved_base is not None and engine is not None else None,
            "hits": sum(s.hit for s in arm.seen), "metrics_hits": count(arm.lookups, result="hit"),
            "metrics_lookups": count(arm.lookups), "stored": count(stores, result="stored"),
            "not_stored": count(stores) - count(stores, result="stored"),
            "distinct": distinct_stored(arm) if arm is cache else None,
            "entries": arm.after.entries if arm is cache else None,
            "bytes": arm.after.bytes if arm is cache else None,
            "bytes_per_entry": _div(arm.after.bytes, arm.after.entries) if arm is cache else None})
    return rows


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


# --- the run ---------------------------------------------------------------------------------------------


async def drive(workload: Workload, target: Target, *, timeout_s: float = CLIENT_TIMEOUT_S,
                on_start: Callable[[float], None] | None = None) -> tuple[list[Result], list[Seen]]:
    """Send every request of ``workload`` at its time (open loop, like ``bench.loadgen``), keeping each
    response's ``x-switchyard-cache`` header (read when the response's head arrives)."""
    specs = workload.specs
    heads: dict[int, str | None] = {}
    prefix = f"bench-{target.name}-"

    async def ended(_session: aiohttp.ClientSession, _ctx: Any, params: aiohttp.TraceRequestEndParams) -> None:
        rid = params.headers.get("x-request-id", "")
        if rid.startswith(prefix) and rid[len(prefix):].isdigit():
            heads[int(rid[len(prefix):])] = params.response.headers.get(CACHE_HEADER)

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(ended)
    connector = aiohttp.TCPConnector(limit=connection_limit(specs, timeout_s), limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10.0)
    loop = asyncio.get_running_loop()
    now = loop.time
    results: list[Result] = []
    tasks: list[asyncio.Task[Result]] = []
    headers = {t: target.headers_for(t) for t in {s.tenant for s in specs}}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trace_configs=[trace]) as session:
        start = now()
        if on_start is not None:
            on_start(start)
        try:
            for spec in specs:
                body = spec.encode()
                result = Result(spec.index, target.name, spec.tenant, spec.request_class, spec.model, spec.kind,
                                spec.stream, spec.prompt_tokens, spec.max_tokens, spec.prefix_group, spec.arrival_s)
                results.append(result)
                delay = start + spec.arrival_s - now()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent = {**headers[spec.tenant], "x-request-id": f"{prefix}{spec.index}"}
                tasks.append(loop.create_task(send_one(session, body, target.url(spec.kind), sent, result, now,
                                                       start)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return results, [parse_cache_header(heads.get(spec.index)) for spec in specs]


class CacheBench:
    """The cache scenario's run: engines, one gateway, a warm-up, then both arms one after the other."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.duration_s = opts.duration_s or (QUICK_DURATION_S if opts.quick else DURATION_S)
        self.time_scale = opts.time_scale or TIME_SCALE
        self.rate = RATE * (opts.rate_multiplier or 1.0)
        self.questions = faq_questions(FAQ_QUESTIONS, opts.seed)
        self.arms: list[ArmRun] = []
        self.gateway_metrics = ""
        self.engine_metrics: list[str] = []

    def plan(self, salt: str) -> CacheWorkload:
        """The workload of an arm (same schedule for every ``salt``; ``chat`` texts differ)."""
        return build_workload(rate_per_s=self.rate, duration_s=self.duration_s, seed=self.ctx.options.seed,
                              questions=self.questions, salt=salt)

    async def counters(self, session: aiohttp.ClientSession) -> Counters:
        """The gateway's cache counters and the engines' finished requests, now."""
        texts = await asyncio.gather(scrape_text(session, self.gateway_metrics, SCRAPE_TIMEOUT_S),
                                     *(scrape_text(session, u, SCRAPE_TIMEOUT_S) for u in self.engine_metrics))
        return read_counters(texts[0], texts[1:])

    async def run_arm(self, arm: ArmRun, target: Target) -> None:
        """Drive one arm's load and read the counters around it."""
        sampler = MetricsSampler(self.engine_metrics, (RUNNING,))
        async with aiohttp.ClientSession() as session:
            arm.before = await self.counters(session)
            try:
                arm.results, arm.seen = await drive(arm.plan.workload, target, on_start=sampler.start)
            finally:
                await sampler.stop()
            await asyncio.sleep(SETTLE_S)  # the last answers' stores run just after they were sent
            arm.after = await self.counters(session)
        arm.series = {"engines running": sampler.series[RUNNING]}

    def warm_up(self, base_url: str, key: str) -> None:
        """A few requests of every kind (texts of their own, ``no-store``) before the measured load."""
        questions = faq_questions(2, self.ctx.options.seed + 1)
        specs = []
        kinds: tuple[tuple[Family, bool], ...] = (("chat", True), ("chat", False), ("faq", True), ("faq", False))
        for i, (family, stream) in enumerate(kinds):
            prompt: PromptText = (SynthText(((unique_key("cache-warmup", i), 300),), 0) if family == "chat"
                                  else LiteralText(questions.questions[i % 2].wordings[0]))
            labels = Labels(tenant=TENANT, request_class=family, model=MODELS[family], stream=stream,
                            extra_body={"temperature": 0, "ignore_eos": True})
            specs.append(RequestSpec(i, 0.2 * i, prompt, 8, labels))
        target = Target(base_url, "warmup", default_api_key=key, headers={CONTROL_HEADER: "no-store"})
        results, _ = asyncio.run(drive(Workload(tuple(specs), 1.0, {"source": "warm-up"}), target))
        failed = [f"{r.status} {r.error_type}: {r.error_message}" for r in results if not r.ok]
        if failed:
            raise RuntimeError("the warm-up requests failed: " + "; ".join(failed))

    def run(self) -> None:
        """Start the engines and the gateway, warm up, run both arms, read the cache's gauges at the end."""
        ctx = self.ctx
        procs = ctx.procs
        *gen, emb = free_ports(REPLICAS + 1)
        policy = ctx.state_dir / "policies.yaml"
        policy.write_text(cache_policy(gen, emb, served_model=SERVED, embed_model=EMBED_SERVED, profile=PROFILE,
                                       kv_cache_tokens=KV_TOKENS, context_window=CONTEXT,
                                       min_similarity=MIN_SIMILARITY))
        ctx.say(f"cache: starting {REPLICAS} simulated replicas, an embeddings engine and the gateway")
        start_sims(procs, "cache-sims", policy, [*gen, emb], time_scale=self.time_scale, seed=ctx.options.seed)
        env = state_env(ctx.state_dir / "switchyard", policy)
        key = create_key(env, TENANT, TIER)
        gateway = start_gateway(procs, "cache-gateway", env)
        self.gateway_metrics = f"{gateway.base_url}/metrics"
        self.engine_metrics = [f"http://127.0.0.1:{p}/metrics" for p in gen]
        self.warm_up(gateway.base_url, key)
        cache_ended = time.monotonic()
        for name in ARMS:
            arm = ArmRun(name, self.plan("" if name == "cache" else name))
            headers = {} if name == "cache" else {CONTROL_HEADER: BASELINE_CONTROL}
            ctx.say(f"cache: {name}: {len(arm.plan.workload)} requests over {self.duration_s:g} s")
            asyncio.run(self.run_arm(arm, Target(gateway.base_url, name, default_api_key=key, headers=headers)))
            self.arms.append(arm)
            if name == "cache":
                cache_ended = time.monotonic()
        # The entry and byte gauges are refreshed every few seconds: read them once a refresh has seen every store.
        time.sleep(max(0.0, cache_ended + GAUGE_REFRESH_S + 0.5 - time.monotonic()))

        async def gauges() -> Counters:
            async with aiohttp.ClientSession() as session:
                return await self.counters(session)

        end = asyncio.run(gauges())
        self.arms[0].after.entries, self.arms[0].after.bytes = end.entries, end.bytes
        procs.stop_all()


# --- the report ------------------------------------------------------------------------------------------


def _hit_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "Hit ratio against the repeat bound (cache arm)",
        [text("rule", "rule"), text("mode", "mode"), text("family", "requests of"), num("requests", "requests", 0),
         num("hits", "hits", 0), pct("hit_ratio", "hit %"), pct("bound", "repeat bound %"),
         pct("of_bound", "of the bound %"), pct("reachable", "reachable bound %"),
         pct("of_reachable", "of reachable %"), pct("exact_bound", "same wording before %"),
         num("paraphrase_hits", "paraphrase hits", 0), num("similarity_min", "similarity min", 3),
         num("similarity_p50", "similarity p50", 3), num("full_hits", "hits with full usage", 0),
         num("misses", "misses", 0), num("errors", "errors", 0),
         num("metrics_hits", "/metrics hits", 0), num("metrics_lookups", "/metrics lookups", 0),
         num("with_header", "with a cache header", 0)],
        rows,
        "Hits from each response's `x-switchyard-cache` header; `/metrics`: the gateway's "
        f"`{LOOKUPS}` deltas over the arm. *Repeat bound*: requests whose prompt (exact rule) or question in any "
        "wording (semantic rule) was sent before, in arrival order; *reachable*: those sent after an answer to it "
        "had completed (a repeat sent while the first answer is still being generated cannot hit); *same wording "
        "before*: the repeat fraction by exact text, what an exact cache could reach; *paraphrase hits*: hits whose "
        "wording had not been sent before; *hits with full usage*: hits whose usage reports the `max_tokens` every "
        "answer has (`ignore_eos`). The sampled requests (temperature > 0) must get no cache header at all.")


def _latency_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "Latency: hits, misses and no cache",
        [text("arm", "arm"), text("requests", "requests"), text("stream", "stream"), num("n", "n", 0),
         ms("ttft_p50_s", "TTFT p50 ms", 1), ms("ttft_p99_s", "TTFT p99 ms", 1), ms("e2e_p50_s", "E2E p50 ms", 1),
         ms("e2e_p99_s", "E2E p99 ms", 1)],
        rows,
        "Cacheable (temperature 0) requests that succeeded; times from the scheduled send time. A whole (not "
        "streamed) answer's TTFT is its end-to-end time. *The same requests as the hits*: the no-cache arm's "
        "requests at the indices that hit in the cache arm (same schedule, same prompts' lengths).")


def _speedup_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "How many times faster a hit is",
        [text("stream", "stream"), text("against", "against"), num("hits", "hits", 0), num("others", "n", 0),
         ratio("ttft_p50_s", "TTFT p50 ÷"), ratio("ttft_p99_s", "TTFT p99 ÷"), ratio("e2e_p50_s", "E2E p50 ÷"),
         ratio("e2e_p99_s", "E2E p99 ÷")],
        rows, "The other requests' percentile divided by the hits' (above 1x: hits are faster).")


def _miss_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "What a miss pays for the lookup",
        [text("rule", "rule"), text("mode", "mode"), text("stream", "stream"), num("n", "misses", 0),
         ms("ttft_p50_s", "TTFT p50 ms", 1), ms("base_ttft_p50_s", "no cache: TTFT p50 ms", 1),
         ms("added_ttft_p50_s", "added ms", 1), ms("e2e_p50_s", "E2E p50 ms", 1),
         ms("base_e2e_p50_s", "no cache: E2E p50 ms", 1), ms("added_e2e_p50_s", "added ms", 1)],
        rows,
        "The cache arm's misses against the same requests in the no-cache arm. A semantic lookup embeds the last "
        "user turn before anything else (an embeddings request: the semantic hits' latency above is mostly that); "
        "the engines also carried more load in the no-cache arm (every request), which makes its side slower.")


def _engine_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return table(
        "Engine requests saved, and the cache at the end",
        [text("arm", "arm"), num("requests", "client requests", 0), num("ok", "ok", 0),
         num("engine_requests", "engine requests", 0), ratio("per_request", "engine / client"),
         num("saved", "saved vs no-cache", 0), num("hits", "hits (headers)", 0),
         num("metrics_hits", "hits (/metrics)", 0), num("metrics_lookups", "lookups (/metrics)", 0),
         num("stored", "stored", 0), num("not_stored", "not stored", 0), num("distinct", "distinct keys missed", 0),
         num("entries", "entries at the end", 0), num("bytes", "bytes at the end", 0),
         num("bytes_per_entry", "bytes / entry", 0)],
        rows,
        f"*Engine requests*: the generating engines' `{FINISHED}` deltas over the arm (embeddings are not "
        "counted); *saved*: the no-cache arm's less this arm's, which should equal the hits. *Stored*: "
        f"`{STORES}` deltas (every successful miss is offered; a repeat missed while its first answer was in "
        "flight stores the same key again); *distinct keys missed*: what the cache should hold; *entries*, "
        f"*bytes*: `{ENTRIES}`, `{BYTES}` after the arms (the gateway refreshes them every {GAUGE_REFRESH_S:g} s).")


def analyse(cache: ArmRun, base: ArmRun) -> dict[str, Any]:
    """Every figure of the run: hit ratios, latency, speed-ups, engine requests."""
    latency = latency_rows(cache, base)
    return {"hits": hit_rows(cache), "latency": latency, "speedup": speedup_rows(latency),
            "misses": miss_cost_rows(cache, base), "engines": engine_rows(cache, base)}


def goals_of(a: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The scenario's goals from :func:`analyse`'s figures."""
    hits = {r["family"]: r for r in a["hits"]}
    speed = next(r for r in a["speedup"] if r["stream"] == "all" and r["against"] == "misses")
    lat = {(r["requests"], r["stream"]): r for r in a["latency"]}
    hit_all, miss_all = lat[("hits (all)", "all")], lat[("misses", "all")]
    value = speed["e2e_p50_s"]
    goals = [goal("hits vs misses, end-to-end p50", f"≥ {GOAL_SPEEDUP:g}x faster", value,
                  None if value is None else value >= GOAL_SPEEDUP, unit="x", decimals=1,
                  note=f"hits {fixed(hit_all['e2e_p50_s'], scale=1000, unit=' ms')} ({hit_all['n']}), misses "
                       f"{fixed(miss_all['e2e_p50_s'], scale=1000, unit=' ms')} ({miss_all['n']}); TTFT p50 ÷ "
                       f"{fixed(speed['ttft_p50_s'], unit='x')}")]
    for family, label in (("chat", "exact"), ("faq", "semantic")):
        row = hits[family]
        of = row["of_bound"]
        goals.append(goal(f"{label} hit ratio of its repeat bound", f"≥ {100 * GOAL_OF_BOUND:g}%", of,
                          None if of is None else of >= GOAL_OF_BOUND, unit="%", multiplier=100, decimals=1,
                          note=f"{row['hits']} hits of {row['requests']} requests ({percent(row['hit_ratio'])}); "
                               f"bound {percent(row['bound'])}, reachable {percent(row['reachable'])}"))
    cache_row = next(r for r in a["engines"] if r["arm"] == "cache")
    saved, hit_n = cache_row["saved"], cache_row["hits"]
    goals.append(goal("engine requests saved = hits", "= hits", saved, None if saved is None else saved == hit_n,
                      decimals=0, note=f"{hit_n} hits (headers), {cache_row['metrics_hits']:.0f} (/metrics); "
                      f"engines: {fixed(cache_row['engine_requests'], decimals=0)} requests with the cache"))
    return goals


def run(ctx: ScenarioContext) -> Outcome:
    """Run the cache scenario and write its report into ``ctx.out_dir``."""
    started = time.monotonic()
    bench = CacheBench(ctx)
    bench.run()
    cache, base = bench.arms
    a = analyse(cache, base)
    goals = goals_of(a)
    tables = [_hit_table(a["hits"]), _speedup_table(a["speedup"]), _latency_table(a["latency"]),
              _miss_table(a["misses"]), _engine_table(a["engines"])]
    qs = bench.questions
    bounds = repeat_bounds(cache.plan.items)
    traces = public_repeats(ctx.options.trace)
    hits = {r["family"]: r for r in a["hits"]}
    notes = [
        "Workload: synthetic, with Zipf-distributed repeats (exponent "
        f"{ZIPF_S:g}), not a trace replay: the public traces hold too few repeated prompts to measure a response "
        "cache in minutes (Mooncake, equal `hash_ids` lists: "
        + ("; ".join(traces) if traces else "the traces were not found here") + ").",
        f"{len(cache.results)} requests per arm at {bench.rate:g}/s over {bench.duration_s:g} s: "
        + ", ".join(f"{f} {100 * SHARES[f]:g}%" for f in FAMILIES)
        + f"; {100 * STREAM_SHARE:g}% streamed; {CHAT_ITEMS} chat prompts ({CHAT_PROMPT_TOKENS[0]}-"
        f"{CHAT_PROMPT_TOKENS[1]} tokens), {len(qs.questions)} FAQ questions, {100 * PARAPHRASE_SHARE:g}% of them "
        "reworded. Repeat fraction (the bound of the hit ratio): "
        f"chat {percent(bounds['chat'].exact)} (exact rule), faq {percent(bounds['faq'].semantic)} by question "
        f"({percent(bounds['faq'].exact)} by exact wording), the whole workload {percent(bounds['all'].exact)}.",
        f"FAQ wordings under the simulator's embedding: every pair of wordings of one question ≥ "
        f"{qs.paraphrase_min:.3f} cosine, every pair of different questions ≤ {qs.cross_max:.3f} "
        f"(the rule's min_similarity is {MIN_SIMILARITY:g}); {qs.dropped} rewordings dropped below "
        f"{PARAPHRASE_FLOOR:g}.",
        f"Arms on the same engines ({REPLICAS} replicas of `{PROFILE}` at time scale {bench.time_scale:g}, one "
        f"embeddings engine) and gateway, one after the other: `cache`, then `no-cache` (every request sends "
        f"`{CONTROL_HEADER}: {BASELINE_CONTROL}`); the no-cache arm's chat prompts are other texts of the same "
        "lengths, so that it starts with cold engine prefix caches as the cache arm did.",
    ]
    if hits["sampled"]["hits"] or hits["sampled"].get("with_header"):
        notes.append(f"{hits['sampled']['hits']} sampled (temperature > 0) requests were answered from the cache and "
                     f"{hits['sampled'].get('with_header')} got a cache header: they should get neither.")
    failed = {arm.name: sum(not r.ok for r in arm.results) for arm in bench.arms}
    if any(failed.values()):
        notes.append("Failed requests: " + ", ".join(f"{k} {v}" for k, v in failed.items()) + ".")
    parameters = {"scenario": "cache", "rate": bench.rate, "duration_s": bench.duration_s,
                  "time_scale": bench.time_scale, "replicas": REPLICAS, "profile": PROFILE,
                  "min_similarity": MIN_SIMILARITY, "zipf_s": ZIPF_S, "shares": dict(SHARES),
                  "stream_share": STREAM_SHARE, "paraphrase_share": PARAPHRASE_SHARE,
                  "chat_items": CHAT_ITEMS, "faq_questions": len(qs.questions),
                  "paraphrase_min_cosine": qs.paraphrase_min, "cross_max_cosine": qs.cross_max,
                  "repeat_bound": {k: {"requests": b.requests, "repeats": b.repeats, "group_repeats": b.group_repeats}
                                   for k, b in bounds.items()},
                  "public_trace_repeats": traces, "wall_s": time.monotonic() - started}
    report = build_report({arm.name: arm.results for arm in bench.arms}, title="switchyard bench: cache "
                          "(response caches)", workload=cache.plan.workload, parameters=parameters,
                          seeds={"workload": ctx.options.seed, "engines": ctx.options.seed}, baseline=BASELINE,
                          tables=tables, goals=goals, notes=notes,
                          extra_series={arm.name: arm.series for arm in bench.arms})
    write_report(report, ctx.out_dir)
    speed = goals[0]["value"]
    summary = (f"exact {percent(hits['chat']['hit_ratio'])} hits ({percent(hits['chat']['of_bound'])} of the "
               f"{percent(hits['chat']['bound'])} bound), semantic {percent(hits['faq']['hit_ratio'])} "
               f"({percent(hits['faq']['of_bound'])} of {percent(hits['faq']['bound'])}); hits "
               + fixed(speed, decimals=0, unit="x") + " faster than misses (E2E p50); engines saved "
               f"{fixed(goals[-1]['value'], decimals=0)} requests")
    return Outcome("cache", "ok", summary, goals, tables[:2], "cache/report.md", notes=notes[:2])
