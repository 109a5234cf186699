"""A small valid policy document, as a dict, for tests to mutate."""

from __future__ import annotations

import copy
import io
from typing import Any

from ruamel.yaml import YAML

BASE: dict[str, Any] = {
    "schema": 1,
    "regions": ["us-east", "eu-west"],
    "pools": [
        {"name": "small-us", "region": "us-east", "served_model": "llama-8b",
         "endpoints": ["http://127.0.0.1:9001", "http://127.0.0.1:9002"], "kv_cache_tokens": 100000},
        {"name": "small-eu", "region": "eu-west", "served_model": "llama-8b",
         "endpoints": ["http://127.0.0.1:9003"], "kv_cache_tokens": 100000},
        {"name": "large-us", "region": "us-east", "served_model": "llama-70b",
         "endpoints": ["http://127.0.0.1:9004"], "kv_cache_tokens": 200000, "sim_profile": "h100-70b"},
    ],
    "models": [
        {"name": "small", "pools": ["small-us", "small-eu"], "context_window": 8192,
         "price": {"input_per_mtok": 0.1, "output_per_mtok": 0.2}, "fallback": ["small@eu-west"]},
        {"name": "large", "pools": ["large-us"], "context_window": 32768,
         "price": {"input_per_mtok": 1.0, "output_per_mtok": 3.0}, "fallback": ["small"]},
    ],
    "routes": [
        {"name": "auto", "rules": [
            {"name": "hard", "when": {"match": "(?i)prove"}, "model": "large"},
            {"name": "short", "when": {"prompt_tokens_lt": 100}, "model": "small"},
        ], "default": "large"},
    ],
    "priorities": {
        "critical": {"max_queue_ms": 5000},
        "sheddable": {"max_queue_ms": 200, "shed_above_utilisation": 0.8},
        "batch": {"lane": "batch"},
    },
    "tiers": [
        {"name": "free", "priority": "sheddable", "models": ["auto", "small"],
         "limits": {"tokens_per_minute": 1000, "tokens_per_day": 10000}},
        {"name": "pro", "priority": "critical", "models": ["*"],
         "model_limits": {"large": {"tokens_per_minute": 500}}},
    ],
    "cache": [
        {"match": {"models": ["small"]}, "mode": "exact", "ttl": "10m"},
    ],
    "tests": [
        {"name": "hi is small", "request": {"model": "auto", "tier": "free", "prompt": "hi"},
         "expect": {"model": "small"}},
    ],
}


def base() -> dict[str, Any]:
    """A fresh deep copy of :data:`BASE`."""
    return copy.deepcopy(BASE)


def to_yaml(doc: Any) -> str:
    """Block-style YAML, one key per line (so reported lines can be checked)."""
    yaml = YAML()
    yaml.default_flow_style = False
    out = io.StringIO()
    yaml.dump(doc, out)
    return out.getvalue()


def free_tokens_per_day(n: int) -> str:
    """:data:`BASE` as YAML with the free tier's ``tokens_per_day`` set to ``n`` (a one-line policy change)."""
    doc = base()
    doc["tiers"][0]["limits"]["tokens_per_day"] = n
    return to_yaml(doc)
