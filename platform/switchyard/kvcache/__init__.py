"""vLLM's KV-cache events, as both sides of Switchyard speak them.

The wire format (:mod:`~switchyard.kvcache.wire`: vLLM's msgspec structs, field for field, and the
ZeroMQ frames around them), the ``--kv-events-config`` JSON (:mod:`~switchyard.kvcache.config`), the
publisher the simulator runs (:mod:`~switchyard.kvcache.publisher`) and the chain keys of token blocks
both the gateway's index and the benchmarks' oracle name blocks by (:mod:`~switchyard.kvcache.blocks`).
A leaf: it imports no other part of switchyard.
"""
