"""Errors in vLLM's shapes, and request fields read the way vLLM's pydantic models read them.

vLLM answers two kinds of 400: its own checks (``type`` "BadRequestError", ``param`` the
parameter's name, the message often ending in ``(parameter=…, value=…)``), and pydantic's
request validation as FastAPI reports it (``type`` "Bad Request", ``param`` the location such
as ``body.max_tokens``, the message listing the errors as Python dicts). Fields are read in
pydantic's lax mode, as vLLM's are: ``"3"``, ``3.0`` and ``true`` are all valid integers.

Only the first validation error is reported (pydantic lists every one); ``type``, ``param``
and ``code`` are vLLM's.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed",
                429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


class ApiError(Exception):
    """An error answered in vLLM's shape: ``{"error": {message, type, param, code}}``.

    Args:
        status: HTTP status code (also the ``code`` field, as vLLM does).
        message: Human-readable message.
        param: The offending parameter, if any.
        err_type: Error type; defaults from the status (``BadRequestError`` for 400, …).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _ERROR_TYPES.get(status, "InternalServerError")

    def body(self) -> bytes:
        """The JSON error body."""
        return msgspec.json.encode({"error": {"message": self.message, "type": self.err_type,
                                              "param": self.param, "code": self.status}})


def bad(message: str, param: str | None = None, value: object = None, *,
        suffix: bool = True) -> ApiError:
    """One of vLLM's own 400s; ``suffix`` appends its ``(parameter=…, value=…)`` note."""
    if suffix and param is not None:
        note = f"parameter={param}" if value is None else f"parameter={param}, value={value}"
        message = f"{message} ({note})"
    return ApiError(400, message, param)


def input_repr(value: object) -> str:
    """How vLLM's validation errors show the offending input."""
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return str(value)


def invalid(kind: str, loc: str, msg: str, value: object, ctx: dict[str, str] | None = None,
            more: list[dict[str, Any]] | None = None) -> ApiError:
    """A pydantic validation error as vLLM reports it (``type`` "Bad Request")."""
    error: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": input_repr(value)}
    if ctx is not None:
        error["ctx"] = ctx
    errors = [error, *(more or [])]
    plural = "s" if len(errors) > 1 else ""
    lines = "\n  ".join(repr(e) for e in errors)
    return ApiError(400, f"{len(errors)} validation error{plural}:\n  {lines}", loc, "Bad Request")


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, with FastAPI's errors for anything else.

    Raises:
        ApiError: Empty, not JSON, or not an object.
    """
    try:
        body = msgspec.json.decode(raw) if raw.strip() else None
    except msgspec.DecodeError:
        # The stdlib parser (FastAPI's) tells the position and reason vLLM reports.
        try:
            json.loads(raw)
        except ValueError as exc:
            pos, reason = (exc.pos, exc.msg) if isinstance(exc, json.JSONDecodeError) else (0, str(exc))
            raise invalid("json_invalid", f"body.{pos}", "JSON decode error", {},
                          {"error": reason}) from None
        raise invalid("json_invalid", "body.0", "JSON decode error", {}, {"error": "Invalid JSON"}) from None
    if body is None:
        raise invalid("missing", "body", "Field required", None)
    if not isinstance(body, dict):
        raise invalid("model_attributes_type", "body",
                      "Input should be a valid dictionary or object to extract fields from", body)
    return body


def lax_int(value: object, loc: str) -> int:
    """An integer as pydantic's lax mode reads one (bools, integral floats, numeric strings)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise invalid("int_from_float", loc,
                      "Input should be a valid integer, got a number with a fractional part", value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise invalid("int_parsing", loc,
                          "Input should be a valid integer, unable to parse string as an integer",
                          value) from None
    raise invalid("int_type", loc, "Input should be a valid integer", value)


def lax_float(value: object, loc: str) -> float:
    """A number as pydantic's lax mode reads one."""
    if isinstance(value, bool | int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise invalid("float_parsing", loc,
                          "Input should be a valid number, unable to parse string as a number",
                          value) from None
    raise invalid("float_type", loc, "Input should be a valid number", value)


def read_bool(value: object) -> bool | tuple[str, str]:
    """A boolean as pydantic's lax mode reads one (0/1, "yes"/"no", …), or what is wrong with it: pydantic's
    error (type, message)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int | float | str):
        return "bool_parsing", "Input should be a valid boolean, unable to interpret input"
    return "bool_type", "Input should be a valid boolean"


def lax_bool(value: object, loc: str) -> bool:
    """A boolean as pydantic's lax mode reads one (0/1, "yes"/"no", …)."""
    read = read_bool(value)
    if isinstance(read, bool):
        return read
    raise invalid(read[0], loc, read[1], value)


def strict_str(value: object, loc: str) -> str:
    """A string (pydantic does not turn numbers into strings)."""
    if not isinstance(value, str):
        raise invalid("string_type", loc, "Input should be a valid string", value)
    return value


class Fields:
    """Typed access to the optional fields of a request body (``None`` when absent or null).

    Args:
        body: The decoded request body.
    """

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def get_int(self, key: str) -> int | None:
        """An optional integer field."""
        value = self.body.get(key)
        return None if value is None else lax_int(value, f"body.{key}")

    def get_float(self, key: str) -> float | None:
        """An optional number field."""
        value = self.body.get(key)
        return None if value is None else lax_float(value, f"body.{key}")

    def get_bool(self, key: str, default: bool = False) -> bool:
        """An optional boolean field."""
        value = self.body.get(key)
        return default if value is None else lax_bool(value, f"body.{key}")

    def get_str(self, key: str) -> str | None:
        """An optional string field."""
        value = self.body.get(key)
        return None if value is None else strict_str(value, f"body.{key}")

    def stop(self) -> tuple[str, ...]:
        """``stop``: a string or a list of strings."""
        value = self.body.get("stop")
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, list):
            raise invalid("string_type", "body.stop", "Input should be a valid string", value,
                          more=[{"type": "list_type", "loc": "body.stop", "msg": "Input should be a valid list",
                                 "input": input_repr(value)}])
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise invalid("string_type", "body.stop", "Input should be a valid string", value,
                              more=[{"type": "string_type", "loc": f"body.stop.{i}",
                                     "msg": "Input should be a valid string", "input": input_repr(item)}])
        return tuple(value)

    def options(self, key: str) -> dict[str, Any] | None:
        """An optional object field (``stream_options``)."""
        value = self.body.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise invalid("model_attributes_type", f"body.{key}",
                          "Input should be a valid dictionary or object to extract fields from", value)
        return value
