"""The gateway's prompt renderer gives the token ids real vLLM computes for the tiny model: its
tokenizer.json and the chat template beside it, against the server's own ``/tokenize`` (the chat
path vLLM generates with) and against transformers' ``apply_chat_template`` in the vLLM environment."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchyard.gateway.chat_templates import load_chat_template
from switchyard.gateway.prompts import HfPromptRenderer
from switchyard.gateway.tokenizers import TokenizerCache

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello there"}]},
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Which river runs by the old city? 1234 words, please!"}]},
    {"messages": [{"role": "user", "content": "a question"}, {"role": "assistant", "content": "an answer"},
                  {"role": "user", "content": "  and a follow-up\n\nwith lines  "}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "unseen wörds and émojis 🚀 <|eot_id|> inside"}]},
]
#: Bodies only vLLM's own message handling explains (content parts, developer role, tools).
VLLM_ONLY: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}]},
    {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    {"messages": [{"role": "user", "content": "weather?"}],
     "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
]

_APPLY = """
import json, sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
print(json.dumps([tokenizer.apply_chat_template(body["messages"], tokenize=True, return_dict=False,
                                                add_generation_prompt=body.get("add_generation_prompt", True))
                  for body in json.load(sys.stdin)]))
"""


def renderer(tiny_model: Path) -> HfPromptRenderer:
    cache = TokenizerCache()
    path = tiny_model / "tokenizer.json"
    chat = load_chat_template(path, None, cache)
    assert chat is not None, "the tiny model's folder holds its chat template"
    return HfPromptRenderer(cache.get(path), chat)


def test_chats_render_as_transformers_apply_chat_template(vllm_env: Path, tiny_model: Path) -> None:
    done = subprocess.run([str(vllm_env / "bin" / "python"), "-c", _APPLY, str(tiny_model)], input=json.dumps(CHATS),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    expected = json.loads(done.stdout.splitlines()[-1])
    render = renderer(tiny_model)
    assert [render(body) for body in CHATS] == expected


@pytest.mark.parametrize("body", [*CHATS, *VLLM_ONLY, {"prompt": "The river runs by the old city."},
                                  {"prompt": "no special tokens", "add_special_tokens": False}])
def test_requests_render_as_the_vllm_server_tokenizes_them(vllm_servers: Any, tiny_model: Path,
                                                           body: dict[str, Any]) -> None:
    vllm_servers.ensure_running()
    answer = httpx.post(f"{vllm_servers.a.url}/tokenize", json={"model": "tiny-llama", **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert renderer(tiny_model)(body) == answer.json()["tokens"]
