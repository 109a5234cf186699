"""What a policy's models need to read prompts, loaded together on every policy (re)load: each model's
prompt-token counter (limits, fits) and prompt renderer (the precise KV-cache scorer)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from switchyard.decide.picking import PromptRenderer
from switchyard.decide.tokens import TokenCounter
from switchyard.gateway.prompts import load_prompt_renderers
from switchyard.gateway.tokenizers import TokenizerCache, load_token_counters
from switchyard.policy import PolicySnapshot


class ModelTokens(NamedTuple):
    """Each model's token counter and prompt renderer."""

    counters: Mapping[str, TokenCounter]
    renderers: Mapping[str, PromptRenderer]


def load_model_tokens(snapshot: PolicySnapshot, base_dir: Path, cache: TokenizerCache) -> ModelTokens:
    """The counters and renderers of ``snapshot``'s models (files relative to ``base_dir``, read once through
    ``cache``), errors named in the policy's label.

    Raises:
        PolicyError: A tokenizer or chat template cannot be loaded; each issue names its YAML location.
    """
    return ModelTokens(load_token_counters(snapshot, base_dir, cache, snapshot.label),
                       load_prompt_renderers(snapshot, base_dir, cache, snapshot.label))
