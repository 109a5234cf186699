"""Load a policy document: YAML text → validated :class:`PolicyDocument`, or located errors."""

from __future__ import annotations

import io
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from switchyard.policy.errors import PolicyError, PolicyIssue, issues_at, locate
from switchyard.policy.references import check_references
from switchyard.policy.schema import PolicyDocument

MAX_POLICY_BYTES = 4 * 1024 * 1024


def _yaml() -> YAML:
    # Round-trip mode keeps line numbers on every mapping and sequence; duplicate keys are errors.
    yaml = YAML(typ="rt")
    yaml.allow_duplicate_keys = False
    return yaml


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text into ruamel's line-annotated tree, or raise a located :class:`PolicyError`."""
    if len(text.encode("utf-8", errors="replace")) > MAX_POLICY_BYTES:
        raise PolicyError([PolicyIssue("", f"document larger than {MAX_POLICY_BYTES} bytes", None, source)])
    try:
        return _yaml().load(io.StringIO(text))
    except MarkedYAMLError as exc:
        message, line = _plain_yaml_error(exc)
        raise PolicyError([PolicyIssue("", f"invalid YAML: {message}", line, source)]) from None
    except YAMLError as exc:
        raise PolicyError([PolicyIssue("", f"invalid YAML: {exc}", None, source)]) from None


def _plain_yaml_error(exc: MarkedYAMLError) -> tuple[str, int | None]:
    """The parser's complaint said plainly, at the line of the mistake where that can be told: an unclosed
    quote or bracket is where it opens (the parser notices only where the document ends or a key appears), a
    badly indented line is the line itself."""
    problem = exc.problem or exc.context or "invalid YAML"
    context = exc.context or ""
    noticed = exc.problem_mark.line + 1 if exc.problem_mark is not None else None
    opened = exc.context_mark.line + 1 if exc.context_mark is not None else None
    if "duplicate key" in problem:
        key = problem.split(" with value")[0].removeprefix("found duplicate key ")
        first = f" (first at line {opened})" if opened is not None else ""
        return f"the key {key} appears twice in one mapping{first}", noticed
    if "quoted scalar" in context:
        return f"a quoted string that opens at line {opened} is never closed", opened or noticed
    if "flow sequence" in context or "flow mapping" in context:
        bracket = "[" if "sequence" in context else "{"
        closer = "]" if bracket == "[" else "}"
        return (f"the {bracket} opened at line {opened} is not closed with {closer} (or an item in it lacks a comma)",
                opened or noticed)
    if "cannot start any token" in problem and ("\\t" in problem or "\t" in problem):
        return "a tab character: YAML indents with spaces only", noticed
    if "mapping values are not allowed here" in problem:
        return ("a colon where a value was expected: put a space after a key's colon and quote values that contain "
                "': ' (or the line before lacks its colon)"), noticed
    if problem.startswith("expected <block end>"):
        return "this line's indentation does not match the lines above it", noticed
    if "could not find expected ':'" in problem:
        return "a key without its colon (or a line indented as if it continued the one above)", noticed
    if "undefined alias" in problem:
        return f"{problem.removeprefix('found ')}: an *alias needs an &anchor of that name above it", noticed
    return problem, noticed or opened


# Pydantic's wording, said the way an operator reads a config file.
_PLAIN_MESSAGES = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
}


def _message(err: ErrorDetails) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        field = str(err["loc"][-1])
        allowed = _allowed_fields(err["loc"][:-1])
        hint = get_close_matches(field, allowed, n=1)
        suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
        return f"unknown field {field!r}{suggestion}"
    if kind == "missing":
        return "required field is missing"
    if kind == "string_pattern_mismatch":
        return (f"{err['input']!r} is not a valid name (lower-case letters, digits, '-' and '_', "
                "starting with a letter)")
    ctx = err.get("ctx", {})
    if kind in _PLAIN_MESSAGES:
        return _PLAIN_MESSAGES[kind]
    if kind == "greater_than":
        return f"must be > {ctx.get('gt')}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx.get('ge')}"
    if kind == "less_than_equal":
        return f"must be <= {ctx.get('le')}"
    if kind == "too_short":
        n = ctx.get("min_length")
        return "must not be empty" if n == 1 else f"needs at least {n} items"
    return str(err["msg"]).removeprefix("Value error, ")


def _allowed_fields(parent: tuple[Any, ...]) -> list[str]:
    """Field names valid at ``parent``, found by walking the schema along the raw path."""
    model: type[BaseModel] | None = PolicyDocument
    for part in parent:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(str(part)) or next(
            (f for f in model.model_fields.values() if f.alias == part), None)
        model = _inner_model(field.annotation) if field is not None else None
    if model is None:
        return []
    return [f.alias or name for name, f in model.model_fields.items()]


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def parse_policy(text: str, source: str = "<policy>") -> PolicyDocument:
    """Validate a policy document's YAML text.

    Raises:
        PolicyError: every problem found, each with its YAML path and line.
    """
    raw = parse_yaml(text, source)
    if not isinstance(raw, dict):
        raise PolicyError([PolicyIssue("", "the document must be a YAML mapping of sections", 1, source)])
    try:
        doc = PolicyDocument.model_validate(raw)
    except ValidationError as exc:
        issues = []
        for err in exc.errors(include_url=False):
            path, line = locate(raw, tuple(err["loc"]))
            issues.append(PolicyIssue(path, _message(err), line, source))
        raise PolicyError(sorted(issues, key=lambda i: (i.line or 0, i.path))) from None
    found = check_references(doc)
    if found:
        raise PolicyError(issues_at(raw, source, found))
    return doc


def read_policy_file(path: str | Path) -> str:
    """Read a policy file as text, turning I/O problems into a :class:`PolicyError`."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise PolicyError([PolicyIssue("", f"cannot read policy file: {exc.strerror}", None, str(p))]) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise PolicyError([PolicyIssue("", "the policy file is not UTF-8 text", None, str(p))]) from None
