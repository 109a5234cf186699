"""Chat templates as Hugging Face's ``apply_chat_template`` runs them (and so vLLM 0.32): a model's Jinja
template found the way a model folder keeps it (a ``chat_template`` file the policy names, else the
``chat_template.jinja`` beside the tokenizer.json, else the ``chat_template`` of the ``tokenizer_config.json``
beside it), compiled once per file version in a sandbox with ``trim_blocks`` and ``lstrip_blocks``,
``raise_exception``, ``strftime_now`` and ``tojson``, with the tokenizer's special tokens as variables.
:mod:`switchyard.gateway.prompts` renders requests with them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from switchyard.gateway.tokenizers import TokenizerCache

#: The file a Hugging Face model folder keeps its chat template in (it wins over tokenizer_config.json's).
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
#: The special tokens ``apply_chat_template`` hands a template as variables (``bos_token``, …).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                        "mask_token")

class ChatTemplateError(ValueError):
    """A chat template cannot be used; the message names the file and why."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot load chat template {path}: {reason}")


# --- the template environment: Hugging Face's apply_chat_template's -----------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %} … {% endgeneration %}`` (assistant-mask markers) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike Jinja's own filter, HTML characters are not escaped (apply_chat_template's filter).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


# --- what vLLM reads of a template's source ------------------------------------------------------


def _unwrapped(node: jinja2.nodes.Node) -> jinja2.nodes.Node | None:
    """What a filter, a test or a slice applies to (None for anything else)."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return node.node
    return None


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` is ``name`` (or ``name.key`` / ``name['key']``), possibly filtered, tested or sliced."""
    while (inner := _unwrapped(node)) is not None:
        node = inner
    if key is not None:
        if isinstance(node, jinja2.nodes.Getitem):
            if not (isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key):
                return False
        elif isinstance(node, jinja2.nodes.Getattr):
            if node.attr != key:
                return False
        else:
            return False
        node = node.node
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _loops_over_content(ast: jinja2.nodes.Template) -> bool:
    """Whether the template iterates over a message's content (vLLM then passes content as a list of parts,
    the "openai" content format; else each message's text parts joined by newlines, the "string" format)."""
    # Names bound to the messages (``{% set msgs = messages[1:] %}``), then the loop variables over them.
    message_lists, pending = {"messages"}, ["messages"]
    while pending:
        name = pending.pop()
        for assign in ast.find_all(jinja2.nodes.Assign):
            if (isinstance(assign.target, jinja2.nodes.Name) and _reads(assign.node, name)
                    and assign.target.name not in message_lists):
                message_lists.add(assign.target.name)
                pending.append(assign.target.name)
    messages = {loop.target.name for loop in ast.find_all(jinja2.nodes.For)
                if isinstance(loop.target, jinja2.nodes.Name) and any(_reads(loop.iter, m) for m in message_lists)}
    in_macros = {id(loop) for macro in ast.find_all(jinja2.nodes.Macro) for loop in macro.find_all(jinja2.nodes.For)}
    # Macro parameters given a message's content: ``{{ render(message.content) }}``.
    content_params: dict[int, set[str]] = {}
    for macro in ast.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in ast.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                bound |= {params[i] for i, arg in enumerate(call.args)
                          if i < len(params) and any(_reads(arg, m, "content") for m in messages)}
                bound |= {kw.key for kw in call.kwargs
                          if kw.key in params and any(_reads(kw.value, m, "content") for m in messages)}
        if bound:
            for loop in macro.find_all(jinja2.nodes.For):
                content_params[id(loop)] = bound
    for loop in ast.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, m, "content") for m in messages):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name) and (
                loop.iter.name in content_params.get(id(loop), ())
                or (id(loop) not in in_macros and loop.iter.name == "content")):
            return True
    return False


@dataclass(frozen=True, slots=True)
class _Compiled:
    """One chat template, compiled, with what vLLM reads of its source."""

    template: jinja2.Template
    source: str
    parts: bool  # content as a list of parts ("openai" format), else a string
    developer_role: bool  # the template knows the "developer" role (else vLLM makes it "system")
    variables: frozenset[str]


def _compile(source: str) -> _Compiled:
    """Raises: jinja2.TemplateSyntaxError."""
    ast = _ENV.parse(source)
    return _Compiled(template=_ENV.from_string(source), source=source, parts=_loops_over_content(ast),
                     developer_role='"developer"' in source or "'developer'" in source,
                     variables=frozenset(jinja2.meta.find_undeclared_variables(ast)))


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A model's chat template(s) and the special tokens handed to them as variables.

    A ``tokenizer_config.json`` may hold named templates; ``tool_use`` is then used for requests with
    ``tools`` and ``default`` for the others, as ``apply_chat_template`` chooses.
    """

    default: _Compiled | None
    tool_use: _Compiled | None
    special_tokens: Mapping[str, str]

    def for_request(self, tools: object) -> _Compiled | None:
        if tools and self.tool_use is not None:
            return self.tool_use
        return self.default


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):  # a serialised AddedToken
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChatTemplateError(path, f"not a readable tokenizer_config.json ({exc})") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(path, "not a JSON object")
    return config


def _compile_named(sources: Mapping[str, str], path: Path) -> tuple[_Compiled | None, _Compiled | None]:
    compiled: dict[str, _Compiled] = {}
    for name, source in sources.items():
        if name not in ("default", "tool_use"):
            continue
        try:
            compiled[name] = _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(path, f"template {name!r} is not valid Jinja ({exc.message}, "
                                          f"line {exc.lineno})") from None
    return compiled.get("default"), compiled.get("tool_use")


def _template_file(path: Path) -> tuple[_Compiled | None, _Compiled | None]:
    try:
        source = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(path, f"not UTF-8 text ({exc.reason})") from None
    return _compile_named({"default": source}, path)


def _config_templates(path: Path) -> tuple[_Compiled | None, _Compiled | None]:
    """The chat template(s) of a tokenizer_config.json (none when it has no ``chat_template``)."""
    value = _read_config(path).get("chat_template")
    if value is None:
        return None, None
    if isinstance(value, str):
        return _compile_named({"default": value}, path)
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return _compile_named({t["name"]: t["template"] for t in value}, path)
    raise ChatTemplateError(path, "chat_template is neither a string nor a list of named templates")


def _config_special_tokens(path: Path) -> dict[str, str]:
    return _special_tokens(_read_config(path))


def load_chat_template(tokenizer_path: Path, template_path: Path | None, cache: TokenizerCache) -> ChatTemplate | None:
    """The chat template for a model whose tokenizer is ``tokenizer_path``: ``template_path`` when the policy
    names one, else the ``chat_template.jinja`` or ``tokenizer_config.json`` beside the tokenizer; ``None``
    when there is none (chats are then not rendered).

    Raises:
        ChatTemplateError: A named file is missing, unreadable or not valid Jinja; a template beside the
            tokenizer exists but is not valid.
    """
    folder = tokenizer_path.absolute().parent
    config_path = folder / TOKENIZER_CONFIG_FILE
    special = cache.made_from(config_path, "special_tokens", _config_special_tokens) if config_path.is_file() else {}
    if template_path is not None:
        try:
            default, tool_use = cache.made_from(template_path, "chat_template", _template_file)
        except OSError as exc:
            raise ChatTemplateError(template_path, exc.strerror or str(exc)) from None
    elif (folder / CHAT_TEMPLATE_FILE).is_file():
        default, tool_use = cache.made_from(folder / CHAT_TEMPLATE_FILE, "chat_template", _template_file)
    elif config_path.is_file():
        default, tool_use = cache.made_from(config_path, "config_chat_template", _config_templates)
    else:
        return None
    if default is None and tool_use is None:
        return None
    return ChatTemplate(default=default, tool_use=tool_use, special_tokens=special)
