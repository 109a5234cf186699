"""One request as the simulated engine core sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from switchyard.sim.kv import ROOT_HASH, chain_hashes
from switchyard.sim.lora import LoraAdapter
from switchyard.simtext.tokens import filler_ids


class Status(enum.Enum):
    """Where a request is in the engine."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenSink(Protocol):
    """Receives a request's progress once the step that produced it has elapsed."""

    def publish(self, request: SimRequest) -> None:
        """Called after a step produced a token for (or finished) ``request``."""


@dataclass(eq=False, slots=True)
class SimRequest:
    """A generation request: its prompt, its target output, and its engine state.

    Args:
        request_id: Identifier (used in logs and ``/sim/state`` only).
        prompt: Prompt token ids.
        max_output: Exact number of tokens the request will generate.
        final_reason: Finish reason when ``max_output`` is reached ("length" or "stop").
        priority: vLLM priority; lower runs first.
        arrival: Simulated time the request reached the server (TTFT counts from here).
        seed: Seed of the generated text.
        cache_salt: Optional prefix-cache salt (vLLM's ``cache_salt``): separates caches.
        budget: The output budget (``max_tokens`` as the engine applies it), for the metrics.
        n_param: The request's ``n`` on its first sample, 0 on the others (counted once).
        stop_reason: The stop string that ends the output, if one does.
        text_len: Characters of the output's text a client sees (it ends before the stop
            string), or None for all of it.
        text_start: Where in the seed's filler text the output starts: 0 opens a sentence, 1
            continues one (a chat's ``continue_final_message``).
        lora: The LoRA adapter it runs with (its ``model`` named one), None for the base model.
    """

    request_id: str
    prompt: list[int]
    max_output: int
    final_reason: str = "length"
    priority: int = 0
    arrival: float = 0.0
    seed: int = 0
    cache_salt: str | None = None
    budget: int = 0
    n_param: int = 1
    stop_reason: str | None = None
    text_len: int | None = None
    text_start: int = 0
    lora: LoraAdapter | None = None
    seq: int = 0
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_registered: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    queued_at: float = 0.0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    finished_at: float | None = None
    finish_reason: str | None = None
    sink: TokenSink | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt) + len(self.output)

    def generate(self, count: int) -> None:
        """Append the next ``count`` generated tokens (deterministic in ``seed``)."""
        done = len(self.output) + self.text_start
        self.output.extend(filler_ids(self.seed, done, done + count))

    def tokens(self, start: int, stop: int) -> list[int]:
        """Token ids ``[start, stop)`` of prompt followed by output."""
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        if start >= p:
            return self.output[start - p:stop - p]
        return self.prompt[start:] + self.output[:stop - p]

    def full_block_hashes(self, count: int, block_size: int) -> list[int]:
        """Chained hashes of the first ``count`` full blocks (computed once, then kept)."""
        hashes = self.block_hashes
        done = len(hashes)
        if done < count:
            parent = hashes[-1] if hashes else self._root()
            hashes.extend(chain_hashes(self.tokens(done * block_size, count * block_size), block_size, parent))
        return hashes[:count]

    def _root(self) -> int:
        # vLLM puts the adapter's name and path in every block's extra keys (the salt in the first one's):
        # chained from a root that holds them, no block of one adapter's prefix matches another's.
        lora = self.lora
        if lora is not None:
            return hash((ROOT_HASH, self.cache_salt, "lora", lora.name, lora.path))
        return ROOT_HASH if self.cache_salt is None else hash((ROOT_HASH, self.cache_salt))
