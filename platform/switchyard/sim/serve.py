"""Running engines: many uvicorn servers, one process, one event loop.

Sockets are bound up front, so a port in use is reported as one clear line before anything
starts. Signals are handled here, not by uvicorn (whose per-server handlers would fight over
SIGINT and re-raise it after shutdown): SIGINT/SIGTERM stop every server gracefully and the
process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
import socket
import sys
from collections.abc import Callable, Generator, Sequence

import uvicorn
from uvicorn.loops.auto import auto_loop_factory

from switchyard.sim.app import build_app
from switchyard.sim.config import EngineConfig, ResolvedConfig, resolve

log = logging.getLogger("switchyard.sim")
#: Seconds in-flight requests get to finish on shutdown before they are cancelled.
GRACEFUL_SHUTDOWN_S = 3


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to ``run_engines``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _resolve_all(configs: Sequence[EngineConfig]) -> list[ResolvedConfig]:
    if not configs:
        raise ValueError("sim: no engines to run")
    resolved = [resolve(c) for c in configs]
    seen: set[tuple[str, int]] = set()
    for r in resolved:
        if r.port and (r.host, r.port) in seen:
            raise ValueError(f"sim: two engines on {r.host}:{r.port}")
        seen.add((r.host, r.port))
    return resolved


def _bind(config: ResolvedConfig) -> socket.socket:
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise SystemExit(f"sim: cannot listen on {config.host}:{config.port} for "
                         f"{config.served_model}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def _bind_all(resolved: list[ResolvedConfig]) -> list[socket.socket]:
    sockets: list[socket.socket] = []
    try:
        for r in resolved:
            sockets.append(_bind(r))
    except SystemExit:
        for s in sockets:
            s.close()
        raise
    return sockets


async def _serve(resolved: list[ResolvedConfig], sockets: list[socket.socket],
                 on_ready: Callable[[list[ResolvedConfig]], None]) -> None:
    # Report the port actually bound (port 0 asks the OS for a free one).
    bound = [dataclasses.replace(r, port=s.getsockname()[1])
             for r, s in zip(resolved, sockets, strict=True)]
    servers = [
        _Server(uvicorn.Config(build_app(r), lifespan="on", log_level="warning",
                               access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                               server_header=False))
        for r in bound
    ]
    tasks = [asyncio.create_task(s.serve(sockets=[sock]), name=f"sim-server-{r.port}")
             for s, sock, r in zip(servers, sockets, bound, strict=True)]
    try:
        while not all(s.started for s in servers):
            done = [t for t in tasks if t.done()]
            if done:
                done[0].result()  # a server failed to start: raise its error
                raise RuntimeError("sim: an engine stopped during start-up")
            await asyncio.sleep(0.01)
        on_ready(bound)
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        for sock in sockets:
            sock.close()


async def serve_engines(configs: Sequence[EngineConfig]) -> None:
    """Serve every engine in this process and event loop until cancelled.

    Each engine gets its own uvicorn server on its own port. Cancelling the task stops all of
    them gracefully (in-flight requests get a few seconds to finish).

    Raises:
        ValueError: A configuration is invalid.
        SystemExit: A port cannot be bound (message names host, port and model).
    """
    resolved = _resolve_all(configs)

    def ready(bound: list[ResolvedConfig]) -> None:
        for r in bound:
            log.info(r.describe())

    await _serve(resolved, _bind_all(resolved), ready)


def run_engines(configs: Sequence[EngineConfig]) -> None:
    """Run engines until SIGINT or SIGTERM, printing one line per engine once it listens.

    Raises:
        SystemExit: Invalid configuration or a port in use (with a one-line message).
    """
    try:
        resolved = _resolve_all(configs)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    sockets = _bind_all(resolved)

    def ready(bound: list[ResolvedConfig]) -> None:
        for r in bound:
            print(r.describe(), flush=True)
        # Start-up garbage is permanent: keep the collector from rescanning it.
        gc.collect()
        gc.freeze()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        serving = asyncio.create_task(_serve(resolved, sockets, ready))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            serving.cancel()
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    with asyncio.Runner(loop_factory=auto_loop_factory(use_subprocess=False)) as runner:
        runner.run(main())
