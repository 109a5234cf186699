"""The LiteLLM proxy as a comparison arm: its own virtual environment, config and start command.

LiteLLM is not a dependency of Switchyard. The bench installs ``litellm[proxy]`` (one pinned
version) from PyPI into a virtual environment of its own under
``~/.cache/switchyard/litellm-<version>`` the first time it is needed, and reuses it after. The
install is the only network access; at run time the proxy is pointed at a loopback engine and
told not to reach anything else:

- ``LITELLM_LOCAL_MODEL_COST_MAP=True``: read the bundled model cost map instead of downloading
  it from GitHub at import;
- ``litellm_settings.telemetry: false`` and ``LITELLM_TELEMETRY=False``: no usage telemetry
  (1.107+ has none unless an endpoint is set; older versions had an opt-out flag);
- no ``DATABASE_URL`` (no Prisma, no database), ``LITELLM_MODE=PRODUCTION`` (no ``.env``
  loading), offline flags for the Hugging Face libraries it may import.

The overhead scenario checks the proxy's sockets while it runs (:func:`outside_connections`)
and records any connection to a non-loopback address in the report.

Version ``1.108.7`` is the one DESIGN.md's reference figures were measured with; it was
verified to install and serve on CPython 3.11 (Linux x86-64) from PyPI's wheels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: The pinned LiteLLM version.
LITELLM_VERSION = "1.108.7"
#: Seconds the pip install may take (it pulls ~100 packages the first time).
INSTALL_TIMEOUT_S = 900
_MARKER = ".switchyard-installed"


class LiteLLMUnavailable(RuntimeError):
    """LiteLLM could not be installed or started; the message says exactly why."""


@dataclass(frozen=True, slots=True)
class LiteLLMEnv:
    """An installed LiteLLM: its virtual environment and version."""

    root: Path
    version: str

    @property
    def python(self) -> Path:
        """The environment's interpreter."""
        return self.root / "bin" / "python"

    @property
    def executable(self) -> Path:
        """The ``litellm`` proxy command."""
        return self.root / "bin" / "litellm"


def cache_root() -> Path:
    """Where bench environments live (``$XDG_CACHE_HOME/switchyard`` or ``~/.cache/switchyard``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "switchyard"


def env_dir(version: str = LITELLM_VERSION) -> Path:
    """The virtual environment of one LiteLLM version."""
    return cache_root() / f"litellm-{version}"


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def ensure_litellm(version: str = LITELLM_VERSION, *, log_file: Path | None = None,
                   timeout_s: float = INSTALL_TIMEOUT_S) -> LiteLLMEnv:
    """The LiteLLM environment of ``version``, installed first if it is not there yet.

    Raises:
        LiteLLMUnavailable: The virtual environment or the pip install failed (the message
            holds the command's last lines of output).
    """
    env = LiteLLMEnv(env_dir(version), version)
    marker = env.root / _MARKER
    if marker.exists() and env.executable.exists() and marker.read_text().strip() == version:
        return env
    env.root.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(env.root)],
        [str(env.python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
         f"litellm[proxy]=={version}"],
    ]
    output: list[str] = []
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise LiteLLMUnavailable(f"`{' '.join(cmd)}` did not finish within {timeout_s:.0f} s") from None
        except OSError as exc:
            raise LiteLLMUnavailable(f"`{' '.join(cmd)}` could not run: {exc}") from None
        output.append(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}")
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            log_file.write_text("\n".join(output), encoding="utf-8")
        if done.returncode != 0:
            raise LiteLLMUnavailable(f"`{' '.join(cmd[:2] + cmd[-1:])}` failed (exit {done.returncode}):\n"
                                     f"{_tail(done.stdout + done.stderr)}")
    if not env.executable.exists():
        raise LiteLLMUnavailable(f"litellm[proxy]=={version} installed, but {env.executable} is missing")
    marker.write_text(version)
    return env


def proxy_config(model: str, engine_url: str, served_model: str, master_key: str) -> str:
    """A proxy config (YAML) with one model, ``model``, served by an OpenAI-compatible engine.

    The proxy refuses to start without a master key (1.108+); clients send it as their bearer
    token, which LiteLLM checks without a database, as Switchyard checks its API keys.

    Args:
        model: The name clients put in ``model``.
        engine_url: The engine's base URL (without ``/v1``).
        served_model: The name the engine serves.
        master_key: The proxy's master key (``sk-...``).
    """
    return f"""\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{served_model}
      api_base: {engine_url.rstrip('/')}/v1
      api_key: none
litellm_settings:
  telemetry: false
  drop_params: true
  request_timeout: 60
general_settings:
  master_key: {master_key}
  disable_spend_logs: true
"""


def proxy_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the proxy runs in: the caller's, minus anything that would make it reach out."""
    env = {k: v for k, v in (base if base is not None else os.environ).items()
           if not k.startswith(("LITELLM_", "OPENAI_", "DATABASE_URL", "VIRTUAL_ENV", "PYTHON"))}
    env.update({
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_MODE": "PRODUCTION",
        "LITELLM_LOG": "ERROR",
        "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    })
    return env


def proxy_command(env: LiteLLMEnv, config: Path, port: int) -> list[str]:
    """The command that runs the proxy: one worker on ``127.0.0.1:port``."""
    return [str(env.executable), "--config", str(config.resolve()), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1"]


def outside_connections(pid: int) -> list[str]:
    """TCP connections of process ``pid`` whose peer is not a loopback address (from ``/proc``).

    Reads ``/proc/<pid>/net/tcp{,6}`` for the connections of the process's network namespace
    and keeps those whose socket inode belongs to ``pid``; returns ``"addr:port"`` peers.
    Returns an empty list where ``/proc`` cannot be read (not Linux).
    """
    try:
        inodes = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    peers: list[str] = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[9] not in inodes or fields[3] == "0A":  # 0A: listening
                continue
            addr, port = fields[2].split(":")
            if len(addr) != width:
                continue
            peer = _peer(addr)
            if peer is not None and not _loopback(peer):
                peers.append(f"{peer}:{int(port, 16)}")
    return sorted(set(peers))


def _peer(hex_addr: str) -> str | None:
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    # /proc writes each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    try:
        return str(ipaddress.ip_address(words))
    except ValueError:
        return None


def _loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified
