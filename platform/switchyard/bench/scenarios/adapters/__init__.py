"""``adapters``: LoRA adapter-aware endpoint picking against least-loaded, on one pool serving many adapters.

One pool of ``REPLICAS`` simulated replicas of one base model serves ``ADAPTERS`` LoRA adapters, each a model of
the policy (``adapter_of``), registered on every replica at start-up (vLLM's ``--lora-modules``; the pool does
not load them at run time), ``max_loras`` ``MAX_LORAS`` per replica: the GPU slots, and the most distinct
adapters in one batch (the CPU cache, ``--max-cpu-loras``, holds as many, vLLM's default). The simulator models
what vLLM does with them: a batch's adapters are made resident before its step (an adapter in neither cache is
read from disk: the profile's ``lora_load_s``, about 65 ms for ``h100-8b``, which the whole step waits for; the
least recently used one goes), each distinct adapter adds a little to every step, and a waiting request whose
adapter would take the batch past ``max_loras`` is skipped (deferred) until a slot frees.

1. **Workload.** Seeded open-loop Poisson arrivals (``RATE`` requests/s of wall clock for ``DURATION_S``;
   ``--quick``: a few seconds) to engines at time scale ``TIME_SCALE`` (half speed: twice the requests per
   simulated second, for half the machine's CPU), every request streamed, each for one adapter drawn by Zipf
   popularity (rank ``r`` with weight ``1 / r ** ZIPF_S``); the request's class is its adapter's popularity band
   (hot, warm, cold), which the report breaks the figures down by.
2. **Arms.** ``least-loaded`` (the baseline: ``SWITCHYARD_PICKER=least-loaded``, the gateway's least-loaded
   picker, blind to adapters) and ``adapter-aware`` (the built-in default endpoint profile, whose
   ``lora-affinity`` scorer prefers replicas where the adapter is active, then where it was sent lately, then
   with a free adapter slot), one after the other, each on fresh engines (one ``switchyard sim --policy``
   process) and a fresh gateway, with the same requests at the same times.
3. **Figures.** Per arm: the engines' adapter loads (``/sim/state`` ``lora.loads``, summed over the replicas,
   after the load less before it) per 1,000 requests, GPU slot copies and the engines' time spent loading;
   the requests deferred for an adapter slot (``lora.deferred``, sampled every second); TTFT p50/p90/p99 and
   ITL p99 as the clients saw them; throughput; failures; how many replicas each adapter's requests were
   spread over; the simulators' lag behind the wall clock. The adapter-aware arm ÷ the baseline; the same
   per popularity band. Goals (the scenario's claims, not an issue's): fewer adapter loads than least-loaded,
   TTFT p90 no worse, no failed request.

The package, by responsibility: :mod:`.workload` (the pool, the adapters and their popularity, the mix and the
policy document), :mod:`.engines` (the engines' adapter counters and the sampler of their state), :mod:`.figures`
(rows, tables, goals, notes), :mod:`.plots` (the scenario's plot) and :mod:`.scenario` (the run; ``run`` is what
the scenario registry calls).

Must not touch: the gateway's or the simulator's internals. The scenario starts real processes
(``bench.procs``) and talks HTTP to them.
"""
