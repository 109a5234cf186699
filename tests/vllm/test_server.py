"""The real vLLM servers of the tier are up and serve the tiny model as the tests expect."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest


@pytest.fixture(params=["a", "b"])
def base_url(request: pytest.FixtureRequest, vllm_servers: Any) -> str:
    vllm_servers.ensure_running()
    url: str = getattr(vllm_servers, request.param).url
    return url


def test_health_and_model_list(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    models = httpx.get(f"{base_url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    assert models["data"][0]["max_model_len"] == 512


def test_ignore_eos_gives_exact_lengths(base_url: str) -> None:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        done = client.completions.create(model="tiny-llama", prompt="The river", max_tokens=7,
                                         extra_body={"ignore_eos": True})
        chat = client.chat.completions.create(model="tiny-llama", max_tokens=5,
                                              messages=[{"role": "user", "content": "Hello there"}],
                                              extra_body={"ignore_eos": True})
    assert done.usage is not None and done.usage.completion_tokens == 7
    assert done.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    assert chat.choices[0].finish_reason == "length"
