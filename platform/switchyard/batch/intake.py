"""A new batch's intake: the checks of its parameters and of each line of its input file, and the
batch made from them.

The request is checked in this order (the first problem is the answer): the endpoint, the
completion window, the metadata (OpenAI's limits), the input file (the tenant's own, of purpose
``batch``); then every line of the file. Bad lines do not refuse the request: they make a ``failed``
batch whose ``errors`` name each one (OpenAI's shape: code, message, param, line). The rows are the
store's (:mod:`switchyard.store.batches`); this module only decides what goes in them.
Must not touch: the tables other than through the store's functions.
"""

from __future__ import annotations

from typing import Any

import msgspec
from sqlmodel import Session

from switchyard.store import batches
from switchyard.store.batch_tables import Now
from switchyard.store.batches import InputLine
from switchyard.store.errors import InvalidParam
from switchyard.store.files import MAX_LINES, file_content, jsonl_lines
from switchyard.store.models import Batch

#: Most line errors a failed batch lists (one more entry says how many were left out).
MAX_REPORTED_ERRORS = 100
MAX_CUSTOM_ID = 512
#: OpenAI's metadata limits.
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """``metadata`` if it keeps OpenAI's limits (at most 16 string pairs, keys ≤ 64, values ≤ 512 characters).

    Raises:
        InvalidParam: it does not.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise InvalidParam("metadata must be an object of string keys and string values.", "metadata")
    if len(metadata) > MAX_METADATA_KEYS:
        raise InvalidParam(f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed.",
                           "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise InvalidParam(f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                               f"{MAX_METADATA_VALUE}.", "metadata")
    return dict(metadata)


def _error(code: str, message: str, param: str | None = None, line: int | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def _check_line(line: Any, number: int, endpoint: str, seen: dict[str, int]) -> dict[str, Any] | None:
    """The first thing wrong with one parsed line (OpenAI's error entry), or ``None``."""
    if not isinstance(line, dict):
        return _error("invalid_json_line", "This line is not a JSON object.", None, number)
    custom_id = line.get("custom_id")
    if custom_id is None:
        return _error("missing_required_parameter", "Missing required parameter: custom_id.", "custom_id", number)
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return _error("invalid_value", f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} "
                      "characters.", "custom_id", number)
    first = seen.setdefault(custom_id, number)
    if first != number:
        return _error("duplicate_custom_id", f"The custom_id {custom_id!r} is also used on line {first}; each "
                      "request in a batch needs a unique custom_id.", "custom_id", number)
    for field in ("method", "url", "body"):
        if field not in line:
            return _error("missing_required_parameter", f"Missing required parameter: {field}.", field, number)
    if line["method"] != "POST":
        return _error("invalid_value", f"method must be POST, not {line['method']!r}.", "method", number)
    if line["url"] != endpoint:
        return _error("url_mismatch", f"The url {line['url']!r} does not match the batch's endpoint "
                      f"{endpoint!r}.", "url", number)
    body = line["body"]
    if not isinstance(body, dict):
        return _error("invalid_value", "body must be a JSON object.", "body", number)
    model = body.get("model")
    if model is None:
        return _error("missing_required_parameter", "Missing required parameter: body.model.", "body.model",
                      number)
    if not isinstance(model, str) or not model:
        return _error("invalid_value", "body.model must be a non-empty string.", "body.model", number)
    if body.get("stream") is True:
        return _error("invalid_value", "Batch requests cannot stream: remove body.stream.", "body.stream", number)
    return None


def parse_input(content: bytes, endpoint: str) -> tuple[list[InputLine], list[dict[str, Any]]]:
    """The lines of an input file for a batch calling ``endpoint``, validated; or (when any is bad)
    none, and what is wrong (OpenAI's error entries, each with its line number, at most
    :data:`MAX_REPORTED_ERRORS` and one that says how many more)."""
    rows: list[InputLine] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    more = 0
    for count, (number, raw) in enumerate(jsonl_lines(content), 1):
        if count > MAX_LINES:
            return [], [_error("too_many_tasks", f"The input file has more than {MAX_LINES} requests; a batch "
                               f"holds at most {MAX_LINES}.")]
        try:
            line = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            problem: dict[str, Any] | None = _error("invalid_json_line", "This line is not parseable as valid JSON.",
                                                    None, number)
        else:
            problem = _check_line(line, number, endpoint, seen)
        if problem is None:
            if not errors:  # once a line is bad no row is written: stop collecting them
                rows.append(InputLine(line_no=number, custom_id=line["custom_id"], body=line["body"]))
        elif len(errors) < MAX_REPORTED_ERRORS:
            errors.append(problem)
        else:
            more += 1
    if more:
        errors.append(_error("too_many_errors", f"{more} more lines have errors; fix those listed and try again."))
    if errors:
        return [], errors
    if not rows:
        return [], [_error("empty_file", "The input file has no requests.")]
    return rows, []


def create_batch(session: Session, *, tenant_id: int, key_id: int, input_file_id: str, endpoint: str,
                 completion_window: str = "24h", metadata: dict[str, str] | None = None,
                 now: Now | None = None) -> Batch:
    """A batch of ``tenant_id`` (made with key ``key_id``) over its file ``input_file_id``.

    The input is validated here: if every line is good the batch is ``in_progress`` with one
    pending ``batch_request`` per line; otherwise it is ``failed``, its ``errors`` list the bad lines
    and it has no lines. Either way it is written in the caller's one transaction.

    Raises:
        NotFound: no such file of this tenant.
        InvalidParam: an unknown endpoint or completion window, bad metadata, or a file whose
            purpose is not ``batch``.
    """
    batches.batch_window(endpoint, completion_window)  # checked first: the first problem is the answer
    metadata = check_metadata(metadata)
    info, content = file_content(session, tenant_id, input_file_id)
    if info.purpose != "batch":
        raise InvalidParam(f"File {input_file_id} has purpose {info.purpose!r}; a batch's input file must have "
                           "purpose 'batch'.", "input_file_id")
    lines, errors = parse_input(content, endpoint)
    return batches.create_batch(session, tenant_id=tenant_id, key_id=key_id, input_file_id=input_file_id,
                                endpoint=endpoint, lines=lines, errors=errors, completion_window=completion_window,
                                metadata=metadata, now=now)
