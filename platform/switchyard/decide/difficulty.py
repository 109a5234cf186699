"""Switchyard's built-in difficulty classifier (``classifiers: {NAME: {type: features}}``).

:func:`difficulty_score` is a logistic model over cheap features of the request (its length, the
words of the last user message, how much code, maths notation and structure it holds, tools, JSON
mode, the system prompt): no network, no GPU, no model file. It runs on the request path, so it
makes a few passes in C over the message (two ``bytes.translate``, one split of a bounded window into
words, one set intersection with the keyword lists) and never a regular expression per keyword:
about 10 µs for a short message and 30 µs for 2 kB on a busy two-core machine, bounded for long ones
by :data:`~switchyard.decide.features.MAX_MATCH_CHARS` and :data:`WORD_WINDOW`.

The weights below are fitted offline on the labelled prompt set shipped with the benchmarks
(``switchyard/bench/data/auto_prompts.jsonl``) by :mod:`switchyard.whatif.difficulty_fit`;
refit and paste its output here when the features or the set change.
"""

from __future__ import annotations

import math
import re
from operator import mul

from switchyard.decide.features import RequestFeatures

#: Words of the message looked up in the keyword lists: its first and last bytes. Instructions sit
#: at the start or the end of a message ("fix the typos: <paste>", "<paste> why does this fail?"),
#: and the split into words is the costly step, so a long paste in the middle is not split.
WORD_WINDOW = (1024, 512)
#: The instruction of a message with a paste: its first and last bytes. "Easy only" (easy words and
#: none that say the task needs thought) is judged there, so that words of the paste do not count.
EDGES = 96
#: Length counts up to this many bytes: it tells "hi" from a real request, but past a few sentences
#: the content decides (a long paste to proofread is easy), and a larger cap would extrapolate.
LENGTH_CAP = 256

# Keyword lists: a message's score counts the distinct words of each list it contains.
_KEYWORDS: dict[str, str] = {
    "math": """prove proves proof proofs theorem lemma induction derive derivation integral integrals eigenvalue
        eigenvalues eigenvectors probability expected converge converges convergence diverge diverges polynomial
        matrix matrices recurrence equation equations solve solutions countable uncountable prime primes
        isomorphic derivative lagrange minimize maximize optimal optimum infinitely rigorous rigorously iff np graph
        graphs vertices edges integer integers modulo permutations combinations arrangements""",
    "engineering": """algorithm algorithms complexity concurrency concurrent thread threads race deadlock latency
        throughput distributed shard sharding replica replicas replication cache caching database schema
        migration migrate kafka kubernetes memory leak leaking async await mutex lock locks transaction
        transactions consistency failover scalability architecture microservices protocol compile compiler
        runtime segfault traceback exception panic heap pointer implement implementation refactor debug bug
        bugs production deploy deploys deployment python rust java typescript javascript golang sql pandas""",
    "reasoning": """analyze analyse analysis compare comparing tradeoffs trade evaluate justify why explain
        diagnose differential implications risks strategy recommend options approach approaches design plan
        correctness cause causes root assumptions pros cons versus vs whether architect tradeoff""",
    "domain": """liability contract clause enforceable court gdpr statute tax taxes legal lawsuit rights patient
        diagnosis dosage symptoms treatment clinical mortgage invest investment regression significant
        significance cohort forecast statistical hypothesis confidence variance""",
    "constraints": """must without exactly least constraints constraint ensure guarantee guarantees strictly
        never including include requirements requirement words""",
    "easy": """translate translation typo typos spelling proofread grammar rephrase reword rewrite shorten
        summarize summarise summary tl dr gist synonyms synonym capital define definition convert format sort
        alphabetically bullet csv uppercase lowercase title hi hello hey thanks thank bye joke haiku name
        caption classify sentiment spam label tag category extract remind reminder weather polite friendlier
        formal tweet""",
}
_GROUPS = tuple(_KEYWORDS)
_KEYWORD_GROUP: dict[bytes, int] = {
    word.encode(): index for index, group in enumerate(_GROUPS) for word in _KEYWORDS[group].split()
}
_KEYWORD_SET = frozenset(_KEYWORD_GROUP)
_EASY = _GROUPS.index("easy")
#: Lists whose words say the task needs thought (a message with easy words and none of these is "easy only").
_THOUGHT = tuple(_GROUPS.index(g) for g in ("math", "engineering", "reasoning", "domain"))
#: Distinct keywords of one list that count (more says little more).
_KEYWORD_CAP = 4


def _word_table() -> bytes:
    """ASCII letters lower-cased, apostrophes and bytes of non-ASCII characters kept, the rest a space."""
    table = bytearray(range(256))
    for byte in range(128):
        char = chr(byte)
        if char.isupper():
            table[byte] = ord(char.lower())
        elif not (char.isalpha() or char == "'"):
            table[byte] = ord(" ")
    return bytes(table)


def _class_table() -> tuple[bytes, bytes]:
    """A ``bytes.translate`` table and deletion set that keep only bytes of a counted class, each mapped to
    its class: ``c`` code punctuation, ``m`` maths operators, ``d`` digits, ``q`` question marks, ``n``
    newlines, ``u`` bytes of non-ASCII characters. One pass leaves a short string that is cheap to count."""
    table = bytearray(range(256))
    for chars, cls in (("{};`", "c"), ("^=+*<>|\\", "m"), ("0123456789", "d"), ("?", "q"), ("\n", "n")):
        for char in chars:
            table[ord(char)] = ord(cls)
    for byte in range(128, 256):
        table[byte] = ord("u")
    kept = {byte for byte in range(256) if table[byte] != byte or byte >= 128}
    return bytes(table), bytes(sorted(set(range(256)) - kept))


_WORDS = _word_table()
_CLASSES, _UNCOUNTED = _class_table()
#: Items of a numbered or bulleted list ("1. ", "2) ", "- ", "* ", "• ") at the start of a line.
_LIST_ITEM = re.compile(rb"\n[ \t]*(?:\d{1,2}[.)]|[-*]|\xe2\x80\xa2)[ \t]")

#: What :func:`difficulty_features` returns, in order.
FEATURE_NAMES: tuple[str, ...] = (
    "log_message_bytes", "kw_math", "kw_engineering", "kw_reasoning", "kw_domain", "kw_constraints", "kw_easy",
    "easy_only", "log_code_chars", "log_math_chars", "log_digits", "questions", "log_lines", "list_items",
    "log_non_ascii", "log_messages", "has_tools", "json_mode", "log_system_chars",
)


def _keyword_counts(lowered: bytes) -> list[int]:
    """Distinct keywords of each list among the words of ``lowered`` (already through ``_WORDS``)."""
    counts = [0] * len(_GROUPS)
    for word in _KEYWORD_SET.intersection(lowered.split()):
        counts[_KEYWORD_GROUP[word]] += 1
    return counts


def difficulty_features(features: RequestFeatures) -> tuple[float, ...]:
    """The model's inputs for a request (named by :data:`FEATURE_NAMES`)."""
    raw = features.last_user_text.encode("utf-8", "replace")
    head, tail = WORD_WINDOW
    window = raw if len(raw) <= head + tail else raw[:head] + b" " + raw[-tail:]
    lowered = window.translate(_WORDS)
    counts = _keyword_counts(lowered)
    edges = _keyword_counts(lowered[:EDGES] + b" " + lowered[-EDGES:]) if len(lowered) > 2 * EDGES else counts
    classes = raw.translate(_CLASSES, _UNCOUNTED)
    return (
        math.log1p(min(len(raw), LENGTH_CAP)),
        *[float(min(c, _KEYWORD_CAP)) for c in counts],
        float(edges[_EASY] > 0 and not any(edges[i] for i in _THOUGHT)),
        math.log1p(classes.count(b"c")),
        math.log1p(classes.count(b"m")),
        math.log1p(classes.count(b"d")),
        float(min(classes.count(b"q"), 5)),
        math.log1p(classes.count(b"n")),
        float(min(len(_LIST_ITEM.findall(window)), 10)),
        math.log1p(classes.count(b"u")),
        math.log(max(features.messages, 1)),
        float(features.has_tools),
        float(features.json_mode),
        math.log1p(len(features.system_text)),
    )


# Fitted by `python -m switchyard.whatif.difficulty_fit` on the 247 prompts of the shipped set's train
# split (113 hard): L2-regularised logistic regression, strength 1 chosen by 5-fold cross-validation on
# the train split alone (as were the features, EDGES and LENGTH_CAP). Accuracy at threshold 0.5: train
# 0.968, test 0.908 (109 prompts never used in fitting or choosing; for "hard", precision 0.915 and
# recall 0.878). The JSON-mode and tools weights rest on few examples (about ten of each in train).
#: Weight of each feature of :data:`FEATURE_NAMES`, on the features' raw scale.
WEIGHTS: tuple[float, ...] = (
    +3.191819,  # log_message_bytes
    +4.779540,  # kw_math
    +1.551774,  # kw_engineering
    +1.608297,  # kw_reasoning
    +1.658584,  # kw_domain
    -0.459802,  # kw_constraints
    -1.102396,  # kw_easy
    -3.008869,  # easy_only
    +0.763184,  # log_code_chars
    +0.426013,  # log_math_chars
    -0.058376,  # log_digits
    +0.471790,  # questions
    -1.021549,  # log_lines
    +0.260427,  # list_items
    +0.730644,  # log_non_ascii
    +0.774350,  # log_messages
    +0.518896,  # has_tools
    -2.247480,  # json_mode
    -0.026779,  # log_system_chars
)
BIAS = -15.812661
assert len(WEIGHTS) == len(FEATURE_NAMES), "refit the weights after changing the features"


def difficulty_score(features: RequestFeatures) -> float:
    """How likely the request needs a strong model, in [0, 1]."""
    z = BIAS + sum(map(mul, WEIGHTS, difficulty_features(features)))
    # Clamped so that exp never overflows, whatever the weights.
    return 1.0 / (1.0 + math.exp(-max(-40.0, min(40.0, z))))
