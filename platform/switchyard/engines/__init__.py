"""Endpoints and pools as the gateway observes them, and the client that calls them.

Owns: per-endpoint state (``endpoints``: this process's in-flight accounting, the scraped load
signals, health and the circuit breakers of endpoints and pools), the health probes and breaker
trials (``health``, ``breakers``), the ``/metrics`` scraper (``scrape``), and the upstream HTTP
client with its answers' checks and the SSE relay (``upstream``, ``streams``). Must not touch:
policy decisions (it reports state; ``decide`` chooses), the database.
"""
