"""Benchmarks: workloads, an open-loop load generator, statistics, side-by-side reports, scenarios.

Owns: what ``switchyard bench`` starts, sends and reports.

- Workloads: ``workload`` builds schedules of requests (trace replays of Mooncake and Azure
  traces, synthetic Poisson and bursty mixes) with prompt text exact in tokens under the
  simulator's tokenizer (``prompts``).
- Driving: ``loadgen`` sends them open-loop over HTTP, each request through ``sender``, which
  records what the client saw (``results``, with ``sse`` parsing streams); ``closedloop``
  saturates a server; ``sampler`` reads engines' ``/metrics`` over time.
- Reading: ``stats`` turns results into percentiles, SLO attainment, goodput and time series;
  ``report`` (with ``plots`` and ``tables``) writes Markdown, JSON and PNG from one computed
  structure; ``profile`` summarises py-spy samples.
- Running: ``procs`` starts and always stops real processes on loopback (simulated engines,
  gateways, ``instant`` — an engine that answers at once, a measuring device — and the LiteLLM
  proxy of ``litellm_env``), ``stack`` the Switchyard ones among them and its command line;
  ``policies`` writes the policy each scenario runs; ``scenarios`` holds one module per
  ``--scenario``; ``runner`` runs them and writes the run's index.

Must not touch: the gateway's internals. It talks to gateways and engines only over HTTP, as a
client would, starts them only through the ``switchyard`` command line, and imports nothing of
Switchyard's but ``switchyard.simtext`` (the tokenizer and chat template, so token counts match the
simulated engines), the simulator's text embedding, ``figures`` and the header names of ``api``.
"""
