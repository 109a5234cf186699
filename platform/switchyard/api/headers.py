"""The name of every ``x-switchyard-*`` header, the requests' and the answers'.

A leaf: it imports nothing, so the decisions (``decide``), the gateway, the console, the Batch API and
the bench read the one spelling of each name. (Tests keep the literal names: they check the wire.)
"""

from __future__ import annotations

# --- request headers: what a client may ask of one request ------------------------------------------

#: Lowers a request's priority class to the class it names (``decide.classes``).
PRIORITY_HEADER = "x-switchyard-priority"
#: The region a request would rather be served in (``decide.regions``).
REGION_HEADER = "x-switchyard-region"
#: How a client opts out of the response cache for one request: ``no-cache``, ``no-store``, ``bypass``
#: (``decide.cache``).
CACHE_CONTROL_HEADER = "x-switchyard-cache-control"

# --- response headers: what the gateway did ----------------------------------------------------------

#: What served the request: model, pool, endpoint, region, policy version, ... (``gateway.proxy``).
ROUTE_HEADER = "x-switchyard-route"
#: The priority class the request was served in, and why.
CLASS_HEADER = "x-switchyard-class"
#: How long the request waited in flow control's queue, in milliseconds.
QUEUE_MS_HEADER = "x-switchyard-queue-ms"
#: Why flow control downgraded the request to another model (ASCII).
DEGRADED_HEADER = "x-switchyard-degraded"
#: How many times the request gave way to a more important one while it waited.
PREEMPTED_HEADER = "x-switchyard-preempted"
#: What the response cache did: ``hit|miss|error|off; rule=…; mode=…[; similarity=…]``.
CACHE_HEADER = "x-switchyard-cache"
#: The limit that refused a 429 (``tokens_per_minute``, ...).
LIMIT_HEADER = "x-switchyard-limit"
#: How many attempts a request that failed after more than one made.
ATTEMPTS_HEADER = "x-switchyard-attempts"
