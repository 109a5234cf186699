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

The package, by responsibility: :mod:`.questions` (the FAQ questions and their wordings),
:mod:`.workload` (the schedule with its repeats, the repeat bounds, the public traces' repeats),
:mod:`.counters` (the ``x-switchyard-cache`` header, the gateway's and the engines' counters, what an
arm measured), :mod:`.analysis` (the figures), :mod:`.report` (the tables and goals) and
:mod:`.scenario` (the run: engines, gateway, both arms, the report; ``run`` is what the scenario
registry calls).

Must not touch: the gateway's or the simulator's internals. The scenario starts real processes
(``bench.procs``) and talks HTTP to them.
"""
