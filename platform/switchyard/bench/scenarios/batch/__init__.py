"""``batch``: the Batch API filling the capacity interactive traffic leaves idle, without hurting it.

One pool of ``REPLICAS`` simulated replicas (``--max-num-seqs`` ``MAX_NUM_SEQS``, declared as the
pool's ``max_num_seqs``, priority scheduling on) serves two model names: ``chat`` (the interactive
traffic) and ``chat-batch`` (the batch's lines; the same pool and engines, a name of its own only so
that the gateway's ``switchyard_tokens_total`` counts the two apart). The policy has an interactive
class and a batch-lane class ``batch: {lane: batch}`` (the lane's default utilisation ceiling); the
gateway's own batch worker (every ``switchyard serve`` runs one, as many lines at a time as the pool has
sequence slots and batch waiting room) sends the lines in that class.

1. **Arms.** ``without-batch`` (the baseline: interactive load alone) and ``with-batch`` (the same
   interactive schedule while a large batch runs), one after the other, each on fresh engines and a
   fresh gateway (one database: the keys outlive the gateways). Fresh engines keep the arms apart:
   the second arm replays the same prompts, which the first arm's engines would have in their
   prefix caches.
2. **Capacity.** Before each arm's load its engines are called directly by a closed loop of
   ``MAX_NUM_SEQS`` clients per replica (every sequence slot busy) sending requests of the
   workload's lengths back to back (``arms.measure_capacity``); output tokens (and requests) per
   second after a warm-up are the pool's capacity. The first arm's sets the interactive rate and is
   the capacity the batch's share is computed from; the second's is a check.
3. **Interactive load.** One seeded open-loop Poisson schedule of streaming requests at ``LOAD``
   times the capacity (in requests per second, so about that share of its tokens per second) for the
   arm's duration, the same for both arms; TTFT counts from each request's scheduled time.
4. **Batch.** In ``with-batch``, a JSONL file of chat lines of the same lengths (other prompts: a
   seed of their own) is uploaded (``POST /v1/files``) and a batch made of it (``POST
   /v1/batches``) before the interactive schedule starts, which starts once the batch's first line
   is answered (the worker polls for work once a second). The batch has enough lines to keep the
   whole pool busy ``BATCH_MARGIN_S`` longer than the window, so it outlasts it. After the window
   the batch is cancelled; its output file is read back.
5. **Window figures.** Every ``POLL_S`` the gateway's ``/metrics`` (completion tokens by model) and
   ``GET /v1/batches/{id}`` (lines completed, failed) are read; the figures over the window
   ``[0, duration)`` are those cumulative counts interpolated at its ends. Idle capacity = capacity
   - interactive output tokens/s; the batch lane's share of it = batch output tokens/s ÷ idle
   capacity.

Interactive requests that find the pool full preempt batch lines in flight (the gateway cancels the
youngest; it queues again): :mod:`switchyard.gateway.flow`. The report counts the preemptions.

Goals: the batch lane's share of the idle capacity at least ``GOAL_SHARE``; interactive TTFT p99 with
the batch within ``GOAL_P99_RATIO`` of the same run without it; every interactive request answered
while the batch runs.

The package, by responsibility: :mod:`.workload` (the pool, classes and policy, the interactive mix,
the batch's lines), :mod:`.progress` (the gateway's counters and the batch's progress read while an
arm runs, and the Batch API calls), :mod:`.figures` (the rows, tables and plot of the report) and
:mod:`.scenario` (the run: fresh engines and gateway per arm, the batch submitted, cancelled and read
back, goals and the report; ``run`` is what the scenario registry calls).

Must not touch: the gateway's or the simulator's internals. The scenario starts real processes
(``bench.procs``) and talks HTTP to them.
"""
