"""Simulated vLLM engines: the OpenAI-compatible API and ``/metrics`` over a performance model.

Owns: ``switchyard sim`` — engines that speak vLLM's HTTP API (``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``, ``/health``, ``/metrics``) and model what a
real engine does with a request: a paged KV cache with an LRU prefix cache keyed by chained
block hashes, continuous batching with chunked prefill and priority scheduling, preemption
when KV runs out, and step times from a per-hardware roofline cost model (``profiles.py``).
Also fault injection (``/sim/faults`` per engine, and a control server for all the engines of a
process: ``--control-port``, ``switchyard sim fault``) and a view of the internals (``/sim/state``).
With ``--kv-events-config`` each engine publishes vLLM's KV-cache events on ZeroMQ (``kv`` records
them, ``core`` batches them per step, ``switchyard.kvcache.publisher`` sends them) and serves
``POST /reset_prefix_cache``.

Must not touch: any other switchyard package. It imports only its own modules (and the
``simtext`` and ``figures`` leaves: its tokenizer and chat template, shared with the gateway, and the
``kvcache`` leaf: the events' wire format and publisher), the web
framework (litestar, uvicorn), msgspec, pyzmq and prometheus_client (and, for calibration and profile
files, aiohttp and ruamel.yaml), so it can run on its own and be replaced by real vLLM servers
without anything else noticing.

Layout: the tokenizer, generated text and chat template are ``switchyard.simtext``'s · ``kv`` (block
pool, prefix cache) · ``request`` / ``core`` (the synchronous scheduler: ``step()``) ·
``profiles`` (hardware cost models) · ``runtime`` (the asyncio engine loop on an anchored
clock; the stalling fault modes) · ``protocol`` / ``responses`` / ``generate`` / ``streaming`` (the OpenAI
surface) · ``metrics`` ·
``faults`` · ``garbage`` (the garbage fault modes' answers) · ``app`` (Litestar app) · ``listener``
(closing and reopening a socket: fault ``down``)
· ``control`` (the fault control app) · ``fault_client`` (its client, for the CLI) · ``serve`` (uvicorn
servers, signals) · ``measured``
(profile files: coefficients measured on a real engine) · ``calibrate`` (``switchyard sim
calibrate``: measure, fit, compare) · ``calibrated/`` (shipped measured profiles).
"""

from switchyard.sim.app import create_engine_app
from switchyard.sim.config import EngineConfig
from switchyard.sim.profiles import PROFILES, HardwareProfile
from switchyard.sim.serve import ControlAddress, run_engines, serve_engines

__all__ = [
    "PROFILES",
    "ControlAddress",
    "EngineConfig",
    "HardwareProfile",
    "create_engine_app",
    "run_engines",
    "serve_engines",
]
