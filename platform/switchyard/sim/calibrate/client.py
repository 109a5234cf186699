"""The client side of a calibration: one streaming completion, timed token by token.

Prompts are token ids (exact lengths, no tokenizer needed) and outputs are exact lengths
(``max_tokens`` with ``ignore_eos``), so every figure is about a known amount of work. Token
counts come from ``usage``; ``continuous_usage_stats`` asks vLLM for a running count in every
chunk, so a chunk that carries several tokens (vLLM merges outputs while a stream lags) is
counted right. Engines that ignore it send one token per chunk, which is what is assumed then.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


class EngineError(RuntimeError):
    """The engine answered with an error, or not at all."""


@dataclass(slots=True)
class StreamResult:
    """What one streamed completion looked like from the client.

    Attributes:
        prompt_len: Prompt tokens sent.
        sent_at: ``time.perf_counter()`` when the request was sent.
        chunks: (arrival time, tokens carried) of every chunk that carried tokens.
        prompt_tokens: ``usage.prompt_tokens``.
        completion_tokens: ``usage.completion_tokens``.
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` if the engine reports it.
    """

    prompt_len: int
    sent_at: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None

    @property
    def first_token_at(self) -> float:
        """Arrival time of the first token."""
        return self.chunks[0][0]

    @property
    def last_token_at(self) -> float:
        """Arrival time of the last token."""
        return self.chunks[-1][0]

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first token."""
        return self.first_token_at - self.sent_at

    def token_times(self) -> list[float]:
        """Arrival time of every token (tokens of one chunk share its time)."""
        return [t for t, n in self.chunks for _ in range(n)]

    def itls(self) -> list[float]:
        """Inter-token latencies: each chunk's gap spread over the tokens it carried."""
        out: list[float] = []
        prev = self.first_token_at
        first_n = self.chunks[0][1]
        out.extend([0.0] * (first_n - 1))
        for t, n in self.chunks[1:]:
            out.extend([(t - prev) / n] * n)
            prev = t
        return out


class EngineClient:
    """An OpenAI-compatible engine (vLLM, or ``switchyard sim``) at ``base_url``.

    Args:
        session: The HTTP session to use (its lifetime is the caller's).
        base_url: ``http://host:port`` (with or without a trailing ``/v1``).
        model: Served model name; None until ``discover`` fills it in.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str | None = None):
        base = base_url.rstrip("/")
        self.base_url = base.removesuffix("/v1")
        self.session = session
        self.model = model
        self.max_model_len = 0
        self.root = ""

    async def _get(self, path: str) -> aiohttp.ClientResponse:
        try:
            resp = await self.session.get(self.base_url + path)
        except aiohttp.ClientError as exc:
            raise EngineError(f"cannot reach {self.base_url}{path}: {exc}") from None
        return resp

    async def discover(self) -> None:
        """Read ``/v1/models``: the served model (the first, unless one was named) and limits.

        Raises:
            EngineError: No answer, or the named model is not served.
        """
        resp = await self._get("/v1/models")
        async with resp:
            if resp.status != 200:
                raise EngineError(f"{self.base_url}/v1/models answered {resp.status}")
            cards: list[dict[str, Any]] = (await resp.json()).get("data") or []
        if not cards:
            raise EngineError(f"{self.base_url}/v1/models lists no model")
        if self.model is None:
            card = cards[0]
        else:
            named = [c for c in cards if c.get("id") == self.model]
            if not named:
                served = ", ".join(str(c.get("id")) for c in cards)
                raise EngineError(f"{self.base_url} does not serve {self.model!r} (it serves "
                                  f"{served})")
            card = named[0]
        self.model = str(card["id"])
        self.root = str(card.get("root") or self.model)
        self.max_model_len = int(card.get("max_model_len") or 0)

    async def text(self, path: str) -> str | None:
        """The body of a GET, or None when the engine does not serve ``path``."""
        resp = await self._get(path)
        async with resp:
            return await resp.text() if resp.status == 200 else None

    async def version(self) -> str | None:
        """vLLM's ``/version`` (None when the engine has none)."""
        body = await self.text("/version")
        if body is None:
            return None
        try:
            version = json.loads(body).get("version")
        except (ValueError, AttributeError):
            return None
        return str(version) if version else None

    async def accepts_token(self, token_id: int) -> bool:
        """Whether a one-token prompt of ``token_id`` is accepted (a vocabulary probe)."""
        body = {"model": self.model, "prompt": [token_id], "max_tokens": 1, "temperature": 0}
        try:
            async with self.session.post(self.base_url + "/v1/completions", json=body) as resp:
                await resp.read()
                if resp.status == 200:
                    return True
                if resp.status == 400:
                    return False
                raise EngineError(f"vocabulary probe answered {resp.status}")
        except aiohttp.ClientError as exc:
            raise EngineError(f"cannot reach {self.base_url}: {exc}") from None

    async def complete(self, prompt: list[int], max_tokens: int) -> StreamResult:
        """Stream one completion of exactly ``max_tokens`` tokens; time every chunk.

        Raises:
            EngineError: A non-200 answer, a broken stream, or a stream without tokens.
        """
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        result = StreamResult(prompt_len=len(prompt), sent_at=time.perf_counter())
        counted = 0
        try:
            async with self.session.post(self.base_url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    raise EngineError(f"completion answered {resp.status}: {text}")
                async for raw in resp.content:
                    now = time.perf_counter()
                    if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(raw[6:])
                    usage = chunk.get("usage")
                    if chunk.get("choices"):
                        # A running count when the engine honours continuous_usage_stats.
                        n = (int(usage["completion_tokens"]) - counted
                             if usage and "completion_tokens" in usage else 1)
                        if n > 0:
                            result.chunks.append((now, n))
                            counted += n
                    if usage and not chunk.get("choices"):
                        _final_usage(result, usage)
        except aiohttp.ClientError as exc:
            raise EngineError(f"stream from {self.base_url} broke: {exc}") from None
        if not result.chunks:
            raise EngineError("a completion streamed no tokens")
        if not result.completion_tokens:
            result.completion_tokens = counted
        return result


def _final_usage(result: StreamResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    result.cached_tokens = int(cached) if cached is not None else None


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def prometheus_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition."""
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m["labels"] or ""))
        out.append((m["name"], labels, value))
    return out


def metric_total(text: str, name: str) -> float | None:
    """Sum of a counter over its label sets (``name`` with or without ``_total``)."""
    names = {name, name + "_total"}
    values = [v for n, _, v in prometheus_samples(text) if n in names]
    return sum(values) if values else None
