"""A request's prompt as the engine's token ids: the simulator's tokenizer and template, or a model's
tokenizer.json and Jinja chat template rendered as vLLM renders it; templates that cannot be used are
located policy errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from switchyard.gateway.chat_templates import load_chat_template
from switchyard.gateway.prompts import HfPromptRenderer, SimPromptRenderer, load_prompt_renderers
from switchyard.gateway.tokenizers import SimTokenCounter, TokenizerCache, load_token_counters
from switchyard.policy import compile_policy
from switchyard.policy.errors import PolicyError
from switchyard.sim.protocol import parse_generation
from switchyard.simtext.tokens import tokenize
from tests.unit.decide.test_tokens import make_tokenizer
from tests.unit.policy.base import base, to_yaml

LLAMA3 = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
          "{{ message['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
#: A template that loops over content parts (vLLM then hands content as a list), knows tools and raises.
PARTS = """{%- if tools %}TOOLS {{ tools | tojson }}
{% endif %}
{%- for m in messages %}
  {%- if m.role == 'oops' %}{{ raise_exception('no oops') }}{% endif %}
[{{ m.role }}]
  {%- if m.content is string %}{{ m.content }}{% else %}
    {%- for part in m.content %}<{{ part.text }}>{% endfor %}{% endif %}
  {%- for call in m.tool_calls or [] %} call {{ call.function.name }} {{ call.function.arguments | tojson }}{% endfor %}
{% endfor %}
{%- if add_generation_prompt %}[assistant]{% endif %}"""

SYSTEM_USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there, 1234 cats!"}]
MULTI_TURN = [{"role": "user", "content": "a question"}, {"role": "assistant", "content": "an answer"},
              {"role": "user", "content": [{"type": "text", "text": "and a"}, {"type": "text", "text": "follow-up"}]}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def sim_engine_ids(body: dict[str, Any]) -> list[int]:
    """What the simulator itself makes of a request body."""
    spec = parse_generation(body, chat="messages" in body, served_model="m", vocab_size=129_000,
                            max_model_len=100_000)
    [prompt] = spec.prompts
    return prompt


@pytest.mark.parametrize("body", [
    {"messages": SYSTEM_USER},
    {"messages": MULTI_TURN},
    {"messages": MULTI_TURN, "add_generation_prompt": False},
    {"messages": SYSTEM_USER, "tools": TOOLS, "response_format": {"type": "json_object"}},
    {"messages": [{"role": "user", "content": "call it"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "1", "content": "sunny"}], "tools": TOOLS},
    {"prompt": "Once upon a time, 42 tokens"},
    {"prompt": ["one prompt in a list"]},
    {"prompt": [5, 6, 7]},
], ids=["system-user", "multi-turn", "no-generation-prompt", "tools", "tool-calls", "completion", "listed",
        "token-ids"])
def test_the_sim_renderer_gives_the_ids_the_simulator_computes(body: dict[str, Any]) -> None:
    assert SimPromptRenderer()(body) == sim_engine_ids(body)


def test_the_sim_renderer_gives_none_for_what_is_not_one_prompt() -> None:
    render = SimPromptRenderer()
    assert render({"prompt": ["two", "prompts"]}) is None
    assert render({"messages": "not a list"}) is None
    assert render({"messages": SYSTEM_USER, "truncate_prompt_tokens": 5}) is None
    assert render({"messages": SYSTEM_USER, "cache_salt": "tenant-a"}) is None  # its blocks are its own


def policy(**fields: Any) -> str:
    doc = base()
    doc["models"][0].update(fields)
    return to_yaml(doc)


def test_a_policy_names_the_simulators_tokenizer() -> None:
    snapshot = compile_policy(policy(tokenizer="switchyard-sim"))
    renderers = load_prompt_renderers(snapshot, Path("/nonexistent"), TokenizerCache())
    assert set(renderers) == {"small"}  # models without a tokenizer have no renderer
    body = {"messages": SYSTEM_USER}
    assert renderers["small"](body) == sim_engine_ids(body)
    counter = load_token_counters(snapshot, Path("/nonexistent"), TokenizerCache())["small"]
    assert isinstance(counter, SimTokenCounter) and counter.exact
    assert counter.count_text("Hello there") == len(sim_engine_ids({"prompt": "Hello there"}))
    users = {"messages": [{"role": "user", "content": "Hello there, 1234 cats!"}, {"role": "user", "content": "Hi"}]}
    assert counter.count_chat([m["content"] for m in users["messages"]]) == len(sim_engine_ids(users))


def model_folder(tmp_path: Path, config: dict[str, Any] | None = None, jinja: str | None = None) -> Path:
    """A Hugging Face-style folder: tokenizer.json, and a tokenizer_config.json and chat_template.jinja."""
    path = make_tokenizer(tmp_path / "model" / "tokenizer.json")
    if config is not None:
        (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path.parent / "chat_template.jinja").write_text(jinja)
    return path


def hf_renderer(path: Path, template: Path | None = None) -> HfPromptRenderer:
    cache = TokenizerCache()
    return HfPromptRenderer(cache.get(path), load_chat_template(path, template, cache))


def encode(path: Path, text: str, special: bool = False) -> list[int]:
    return list(Tokenizer.from_file(str(path)).encode(text, add_special_tokens=special).ids)


def test_the_template_in_tokenizer_config_is_rendered_and_tokenized_without_special_tokens(tmp_path: Path) -> None:
    path = model_folder(tmp_path, {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"},
                                   "chat_template": LLAMA3})
    render = hf_renderer(path)
    text = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHello there, 1234 cats!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render({"messages": SYSTEM_USER}) == encode(path, text)
    # vLLM's "string" content format: text parts joined by newlines.
    ids = render({"messages": MULTI_TURN, "add_generation_prompt": False})
    assert ids == encode(path, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\na question<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\nan answer<|eot_id|>"
                               "<|start_header_id|>user<|end_header_id|>\n\nand a\nfollow-up<|eot_id|>")
    assert render({"messages": SYSTEM_USER, "add_special_tokens": True}) == encode(path, text, special=True)
    # Completions: the tokenizer's special tokens (BOS) are added; token ids pass through.
    assert render({"prompt": "The router"}) == encode(path, "The router", special=True)
    assert render({"prompt": "The router", "add_special_tokens": False}) == encode(path, "The router")
    assert render({"prompt": [[1, 2, 3]]}) == [1, 2, 3]
    assert render({"prompt": ["two", "prompts"]}) is None


def test_a_template_that_loops_over_content_gets_parts_tools_and_parsed_tool_calls(tmp_path: Path) -> None:
    path = model_folder(tmp_path, {"chat_template": LLAMA3}, jinja=PARTS)  # the .jinja file wins
    render = hf_renderer(path)
    body = {"messages": [*MULTI_TURN,
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "1", "type": "function",
                              "function": {"name": "f", "arguments": '{"city": "Paris"}'}}]}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "extra": 1}}],
            "add_generation_prompt": False}
    tools = ('[{"type": "function", "function": {"name": "get_weather", "description": null, '
             '"parameters": null}}]')
    assert render(body) == encode(path, f"TOOLS {tools}\n[user]<a question>[assistant]<an answer>"
                                        f"[user]<and a><follow-up>[assistant] call f {{\"city\": \"Paris\"}}")
    assert render({"messages": [{"role": "oops", "content": "x"}]}) is None  # raise_exception: vLLM answers 400


def test_developer_messages_become_one_system_message_for_a_template_without_the_role(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}")
    render = hf_renderer(make_tokenizer(tmp_path / "tokenizer.json"), template)
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                         {"role": "developer", "content": "d"}]}
    assert render(body) == encode(tmp_path / "tokenizer.json", "system:s\n\nd;user:u;")


def test_what_cannot_be_rendered_exactly_gives_none(tmp_path: Path) -> None:
    path = model_folder(tmp_path, {"chat_template": LLAMA3})
    render = hf_renderer(path)
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    assert render({"messages": [{"role": "user", "content": [image]}]}) is None
    assert render({"messages": SYSTEM_USER, "chat_template": "{{ messages }}"}) is None
    assert render({"messages": SYSTEM_USER, "chat_template_kwargs": {"tokenize": True}}) is None
    assert render({"messages": []}) is None
    no_template = hf_renderer(make_tokenizer(tmp_path / "bare" / "tokenizer.json"))
    assert no_template({"messages": SYSTEM_USER}) is None
    assert no_template({"prompt": "still a completion"}) is not None


def test_continue_final_message_leaves_the_last_message_open(tmp_path: Path) -> None:
    path = model_folder(tmp_path, {"bos_token": "<|begin_of_text|>", "chat_template": LLAMA3})
    ids = hf_renderer(path)({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}],
                             "add_generation_prompt": False, "continue_final_message": True})
    assert ids == encode(path, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\nSure,")


def test_templates_are_compiled_once_per_file_version(tmp_path: Path) -> None:
    path = model_folder(tmp_path, jinja=LLAMA3)
    cache = TokenizerCache()
    first = load_chat_template(path, None, cache)
    assert first is not None and load_chat_template(path, None, cache) == first
    (path.parent / "chat_template.jinja").write_text(LLAMA3 + " ")
    again = load_chat_template(path, None, cache)
    assert again is not None and again.default is not first.default


@pytest.mark.parametrize(("make", "reason"), [
    (lambda p: None, "No such file or directory"),
    (lambda p: p.write_text("{% for m in messages %}"), "not valid Jinja"),
    (lambda p: p.mkdir(), "not a file"),
    (lambda p: p.write_bytes(b"\xff\xfe{{"), "not UTF-8"),
])
def test_an_unusable_chat_template_is_a_located_policy_error(tmp_path: Path, make: Any, reason: str) -> None:
    make_tokenizer(tmp_path / "tokenizer.json")
    make(tmp_path / "template.jinja")
    text = policy(tokenizer="tokenizer.json", chat_template="template.jinja")
    with pytest.raises(PolicyError) as caught:
        load_prompt_renderers(compile_policy(text, "policies.yaml"), tmp_path, TokenizerCache(), "policies.yaml")
    [issue] = caught.value.issues
    line = next(i for i, raw in enumerate(text.splitlines(), 1) if "chat_template:" in raw)
    assert (issue.path, issue.line, issue.source) == ("models[small].chat_template", line, "policies.yaml")
    assert str(tmp_path / "template.jinja") in issue.message and reason in issue.message


def test_a_broken_template_beside_the_tokenizer_is_an_error_at_the_tokenizer(tmp_path: Path) -> None:
    model_folder(tmp_path, {"chat_template": "{% if %}"})
    text = policy(tokenizer="model/tokenizer.json")
    with pytest.raises(PolicyError) as caught:
        load_prompt_renderers(compile_policy(text, "policies.yaml"), tmp_path, TokenizerCache(), "policies.yaml")
    [issue] = caught.value.issues
    assert issue.path == "models[small].tokenizer" and "tokenizer_config.json" in issue.message


@pytest.mark.parametrize(("fields", "message"), [
    ({"chat_template": "t.jinja"}, "chat_template needs a tokenizer"),
    ({"tokenizer": "switchyard-sim", "chat_template": "t.jinja"}, "the simulator's tokenizer has its own template"),
    ({"tokenizer": "tokenizer.json", "chat_template": "https://example.com/t.jinja"}, "must be a local file path"),
])
def test_the_policy_refuses_a_chat_template_it_cannot_use(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        compile_policy(policy(**fields))


def test_tokenize_is_what_the_sim_renderer_uses_for_text() -> None:
    assert SimPromptRenderer()({"prompt": "abc def"})[1:] == tokenize("abc def")  # type: ignore[index]
