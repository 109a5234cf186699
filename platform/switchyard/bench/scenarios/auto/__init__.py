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

The package, by responsibility: :mod:`.policy` (the shipped policy and what the figures need of it:
prices, the route's rules, the classifiers), :mod:`.client` (how a labelled prompt is sent), :mod:`.figures`
(what the gateway did with each prompt, costs, classifier quality, the tables and goals) and
:mod:`.scenario` (the run; ``run`` is what the scenario registry calls).

Must not touch: the gateway's or the simulator's internals, or the policy code (the policy is read as
YAML). The scenario starts real processes (``bench.procs``) and talks HTTP to them.
"""
