"""Real processes on loopback for ``switchyard bench``: engines, gateways, proxies, profilers.

Everything a scenario measures runs as a separate process, started the way a user would start
it (``switchyard sim``, ``switchyard serve``, ``switchyard keys create``), on free ports of
127.0.0.1, with its stdout and stderr in ``<report>/logs/<name>.log``. A :class:`Processes` set
stops everything it started when its ``with`` block ends, however it ends (an error, Ctrl-C,
SIGTERM turned into ``KeyboardInterrupt`` by the CLI): SIGTERM first, SIGKILL after a grace
period. Children run in their own sessions, so a Ctrl-C at the terminal reaches only the bench,
which then stops them in order.

Switchyard's own processes (gateways, simulated engines, the instant engine, the CLI) are started
through :mod:`switchyard.bench.stack`.

Processes may be pinned to CPUs (``cpus``): the overhead scenario keeps the proxy it measures on
a core of its own, away from the load generator.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import msgspec

#: Seconds a process gets to stop after SIGTERM before it is killed.
STOP_GRACE_S = 10.0


class StartError(RuntimeError):
    """A process did not start or did not become ready; the message ends with its log's tail."""


def free_port() -> int:
    """A TCP port nobody listens on right now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int, offsets: Sequence[int] = ()) -> list[int]:
    """``count`` distinct free ports (held open together while chosen, so they differ).

    With ``offsets``, each port plus each offset is free as well, on every interface: the ports a simulated
    engine's KV events bind there (a policy's ``kv_events`` ``port_offset`` and ``replay_port_offset``; the
    shipped policy's are 1000 and 2000). A port whose offset ports are taken is passed over.

    Raises:
        StartError: Not enough such ports were found.
    """
    socks: list[socket.socket] = []
    chosen: list[int] = []
    tries = count * 50
    try:
        while len(chosen) < count:
            if tries == 0:
                raise StartError(f"no {count} free ports with their offsets {list(offsets)} free too")
            tries -= 1
            s = socket.socket()
            socks.append(s)  # (kept bound while choosing, taken or not: the OS offers it no more)
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            try:
                for offset in offsets:
                    other = socket.socket()
                    socks.append(other)
                    other.bind(("", port + offset))
            except (OSError, OverflowError):
                continue
            chosen.append(port)
        return chosen
    finally:
        for s in socks:
            s.close()


def tail(path: Path, lines: int = 12) -> str:
    """The last lines of a log file ('' if unreadable)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used (Linux ``/proc``), None if unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (int(fields[11]) + int(fields[12])) / ticks


def machine_cpu_seconds() -> float | None:
    """CPU seconds every CPU of the machine spent busy since boot (``/proc/stat``), None if unknown."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait.
    values = [int(v) for v in fields[1:9]]
    busy = values[0] + values[1] + values[2] + values[5] + values[6] + values[7]
    return busy / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used over a span by the whole machine and by this bench (itself and what it started).

    The difference is what *other* processes used (and, on a virtual machine, the time the
    hypervisor gave to other guests: ``/proc/stat``'s steal counts as busy): on a shared machine,
    a figure measured while something else was busy is not the system's own.
    """

    def __init__(self, procs: Processes) -> None:
        self.procs = procs
        self._start: tuple[float, float, float] | None = None

    def _ours(self) -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        waited = resource.getrusage(resource.RUSAGE_CHILDREN)
        live = sum(cpu_seconds(p.pid) or 0.0 for p in self.procs.running() if p.alive())
        return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime + live

    def start(self) -> None:
        """Begin the span."""
        machine = machine_cpu_seconds()
        self._start = (time.monotonic(), machine if machine is not None else -1.0, self._ours())

    def stop(self) -> dict[str, float] | None:
        """End the span: its seconds, and the machine's CPU share used by this bench and by others."""
        if self._start is None:
            return None
        wall0, machine0, ours0 = self._start
        machine = machine_cpu_seconds()
        if machine is None or machine0 < 0:
            return None
        elapsed = time.monotonic() - wall0
        capacity = elapsed * (os.cpu_count() or 1)
        if capacity <= 0:
            return None
        ours = self._ours() - ours0
        used = machine - machine0
        return {"seconds": elapsed, "bench_share": ours / capacity, "others_share": max(0.0, used - ours) / capacity}


@dataclass
class Proc:
    """One started process."""

    name: str
    cmd: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path
    cpus: tuple[int, ...] = ()
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        """Its process id."""
        return self.popen.pid

    def alive(self) -> bool:
        """Whether it is still running."""
        return self.popen.poll() is None

    def log_tail(self, lines: int = 12) -> str:
        """The end of its log."""
        if self._log is not None:
            self._log.flush()
        return tail(self.log_path, lines)


def _pin(cpus: tuple[int, ...]) -> Callable[[], None] | None:
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None

    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    return pin


class Processes:
    """The processes of one bench run; a context manager that stops them all on exit.

    Args:
        log_dir: Where each process's log goes (``<name>.log``; a number is added to repeats).
        env: The base environment of every process (default: this process's).
    """

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = dict(env if env is not None else os.environ)
        self._procs: list[Proc] = []
        self._names: dict[str, int] = {}

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop_all()

    def start(self, name: str, cmd: Sequence[str], *, env: dict[str, str] | None = None, whole_env: bool = False,
              cpus: Iterable[int] = (), cwd: Path | None = None) -> Proc:
        """Start ``cmd`` with its output in ``<log_dir>/<name>.log``.

        Args:
            name: A short name for logs and messages.
            cmd: The command line.
            env: Variables added to the base environment.
            whole_env: ``env`` is the whole environment (the base is not used).
            cpus: Pin the process to these CPUs (nothing: no pinning).
            cwd: Working directory.
        """
        self.log_dir.mkdir(parents=True, exist_ok=True)
        count = self._names.get(name, 0)
        self._names[name] = count + 1
        log_path = self.log_dir / (f"{name}.log" if not count else f"{name}-{count + 1}.log")
        log = log_path.open("ab")
        pinned = tuple(cpus)
        environment = dict(env or {}) if whole_env else {**self.env, **(env or {})}
        try:
            popen = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=environment, cwd=cwd, start_new_session=True, preexec_fn=_pin(pinned))
        except OSError as exc:
            log.close()
            raise StartError(f"{name}: cannot run {cmd[0]}: {exc}") from None
        proc = Proc(name, list(cmd), popen, log_path, pinned, log)
        self._procs.append(proc)
        return proc

    def stop(self, proc: Proc, grace_s: float = STOP_GRACE_S, sig: int = signal.SIGTERM) -> int:
        """Stop one process (``sig``, then SIGKILL after ``grace_s``); its exit code."""
        popen = proc.popen
        if popen.poll() is None:
            try:
                popen.send_signal(sig)
                popen.send_signal(signal.SIGCONT)  # a paused process must run to handle it
                popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
            except ProcessLookupError:
                pass
        if proc._log is not None:
            proc._log.close()
            proc._log = None
        if proc in self._procs:
            self._procs.remove(proc)
        return popen.returncode

    def stop_all(self) -> None:
        """Stop every process still running, newest first (gateways before their engines)."""
        for proc in reversed(list(self._procs)):
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGTERM)
                    proc.popen.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in reversed(list(self._procs)):
            self.stop(proc, grace_s=max(0.1, deadline - time.monotonic()))

    def running(self) -> list[Proc]:
        """The processes started and not stopped."""
        return list(self._procs)


def wait_http(url: str, proc: Proc | None = None, timeout_s: float = 60.0, *,
              ok: Callable[[int], bool] = lambda status: status == 200) -> None:
    """Wait until ``url`` answers a status ``ok`` accepts; fail early if ``proc`` exits.

    Raises:
        StartError: ``proc`` exited, or the time ran out (with the end of its log).
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise StartError(f"{proc.name} exited with code {proc.popen.returncode} before {url} answered:\n"
                             f"{proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - loopback only
                if ok(response.status):
                    return
                last = response.status
        except urllib.error.HTTPError as err:
            if ok(err.code):
                return
            last = err.code
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    where = f"\n{proc.log_tail()}" if proc is not None else ""
    raise StartError(f"{url} did not answer within {timeout_s:.0f} s (last: {last}){where}")


def http_get(url: str, timeout_s: float = 5.0) -> bytes:
    """GET ``url`` and return the body (raises ``OSError`` subclasses on failure)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - loopback only
        body: bytes = response.read()
        return body


def engine_states(ports: Sequence[int]) -> list[dict[str, Any]]:
    """Every simulated engine's ``/sim/state`` now, on ``127.0.0.1`` (an empty one for an engine that does not
    answer)."""
    states = []
    for port in ports:
        try:
            states.append(msgspec.json.decode(http_get(f"http://127.0.0.1:{port}/sim/state")))
        except (OSError, msgspec.DecodeError):
            states.append({})
    return states


def http_post_json(url: str, body: bytes, headers: dict[str, str] | None = None,
                   timeout_s: float = 5.0) -> tuple[int, bytes]:
    """POST a JSON body; returns status and body (HTTP errors included)."""
    request = urllib.request.Request(url, data=body, method="POST",  # noqa: S310 - loopback only
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
