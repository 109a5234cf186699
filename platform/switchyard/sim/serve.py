"""Running engines: many uvicorn servers, one process, one event loop.

Each engine's server gets an ``EngineListener`` (fault mode ``down`` closes and reopens its
socket); with a control port, one more server runs the fault control app (``control.py``) over
all of them. Sockets are bound up front, so a port in use is reported as one clear line before
anything starts. Signals are handled here, not by uvicorn (whose per-server handlers would fight over
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
from dataclasses import dataclass
from typing import Literal

import uvicorn
from litestar import Litestar
from uvicorn.loops.auto import auto_loop_factory

from switchyard.sim.app import build_app
from switchyard.sim.config import EngineConfig, ResolvedConfig, resolve
from switchyard.sim.control import build_control_app
from switchyard.sim.listener import EngineListener, bind_socket
from switchyard.sim.runtime import EngineRuntime

log = logging.getLogger("switchyard.sim")
#: Seconds in-flight requests get to finish on shutdown before they are cancelled.
GRACEFUL_SHUTDOWN_S = 3


@dataclass(frozen=True)
class ControlAddress:
    """Where the fault control server listens (``switchyard sim --control-host/--control-port``)."""

    host: str
    port: int

    @property
    def url(self) -> str:
        """Its base URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to ``run_engines``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class _QuietBrokenAnswers(logging.Filter):
    """Drops uvicorn's complaint about an answer left incomplete: fault ``abort_rate`` does it on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing response."


_QUIET = _QuietBrokenAnswers()


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


def _bind(host: str, port: int, what: str) -> socket.socket:
    try:
        return bind_socket(host, port)
    except OSError as exc:
        raise SystemExit(f"sim: cannot listen on {host}:{port} for {what}: {exc.strerror or exc}") from None


def _bind_all(resolved: list[ResolvedConfig], control: ControlAddress | None) -> list[socket.socket]:
    """The engines' sockets in order, then the control server's (if any)."""
    wanted = [(r.host, r.port, r.served_model) for r in resolved]
    if control is not None:
        wanted.append((control.host, control.port, "the fault control server"))
    sockets: list[socket.socket] = []
    try:
        for host, port, what in wanted:
            sockets.append(_bind(host, port, what))
    except SystemExit:
        for s in sockets:
            s.close()
        raise
    return sockets


def _server(app: Litestar, lifespan: Literal["on", "off"]) -> _Server:
    return _Server(uvicorn.Config(app, lifespan=lifespan, log_level="warning", access_log=False,
                                  timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, server_header=False))


async def _serve(resolved: list[ResolvedConfig], sockets: list[socket.socket],
                 on_ready: Callable[[list[ResolvedConfig], ControlAddress | None], None]) -> None:
    """Serve the engines on their sockets (and the control app on the one after them, if any)."""
    # Report the port actually bound (port 0 asks the OS for a free one).
    bound = [dataclasses.replace(r, port=s.getsockname()[1])
             for r, s in zip(resolved, sockets, strict=False)]
    apps = [build_app(r) for r in bound]
    _open_kv_publishers([app.state["engine"] for app in apps], sockets)
    servers = [_server(app, "on") for app in apps]
    names = [f"sim-server-{r.port}" for r in bound]
    control: ControlAddress | None = None
    if len(sockets) > len(bound):
        host, port = sockets[-1].getsockname()[:2]
        control = ControlAddress(host, port)
        engines: list[EngineRuntime] = [app.state["engine"] for app in apps]
        servers.append(_server(build_control_app(engines), "off"))
        names.append(f"sim-control-{port}")
    tasks = [asyncio.create_task(s.serve(sockets=[sock]), name=name)
             for s, sock, name in zip(servers, sockets, names, strict=True)]
    try:
        while not all(s.started for s in servers):
            done = [t for t in tasks if t.done()]
            if done:
                done[0].result()  # a server failed to start: raise its error
                raise RuntimeError("sim: an engine stopped during start-up")
            await asyncio.sleep(0.01)
        logging.getLogger("uvicorn.error").addFilter(_QUIET)
        for app, server, r in zip(apps, servers, bound, strict=False):
            app.state["engine"].listener = EngineListener(server, r.host, r.port)
        on_ready(bound, control)
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        for sock in sockets:
            sock.close()


class KVEventsSetupError(ValueError):
    """An engine's KV event endpoints cannot be set up (``run_engines`` exits with its message)."""


def _open_kv_publishers(engines: list[EngineRuntime], sockets: list[socket.socket]) -> None:
    """Set up every engine's KV event publisher before any server starts: a busy address is one line."""
    for i, engine in enumerate(engines):
        try:
            engine.open_kv_publisher()
        except ValueError as exc:
            for opened in engines[:i]:
                opened.close_kv_publisher()
            for sock in sockets:
                sock.close()
            raise KVEventsSetupError(f"sim: {engine.config.served_model} on port {engine.config.port}: {exc}") from None


def _control_line(control: ControlAddress) -> str:
    return (f"sim: fault control on {control.url} (switchyard sim faults --control {control.url}; "
            f"switchyard sim fault --control {control.url} --port PORT --mode down)")


async def serve_engines(configs: Sequence[EngineConfig], control: ControlAddress | None = None) -> None:
    """Serve every engine in this process and event loop until cancelled.

    Each engine gets its own uvicorn server on its own port, and ``control`` (if given) the
    fault control server. Cancelling the task stops all of them gracefully (in-flight requests
    get a few seconds to finish).

    Raises:
        ValueError: A configuration is invalid, or KV event endpoints cannot be set up.
        SystemExit: A port cannot be bound (message names host, port and model).
    """
    resolved = _resolve_all(configs)

    def ready(bound: list[ResolvedConfig], listening: ControlAddress | None) -> None:
        for r in bound:
            log.info(r.describe())
        if listening is not None:
            log.info(_control_line(listening))

    await _serve(resolved, _bind_all(resolved, control), ready)


def run_engines(configs: Sequence[EngineConfig], control: ControlAddress | None = None) -> None:
    """Run engines until SIGINT or SIGTERM, printing one line per engine once it listens.

    With ``control``, the fault control server runs too (one more line says where).

    Raises:
        SystemExit: Invalid configuration or a port in use (with a one-line message).
    """
    try:
        resolved = _resolve_all(configs)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    sockets = _bind_all(resolved, control)

    def ready(bound: list[ResolvedConfig], listening: ControlAddress | None) -> None:
        for r in bound:
            print(r.describe(), flush=True)
        if listening is not None:
            print(_control_line(listening), flush=True)
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
        try:
            runner.run(main())
        except KVEventsSetupError as exc:
            raise SystemExit(str(exc)) from None
