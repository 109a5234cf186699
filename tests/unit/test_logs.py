"""JSON log lines: fields, the request id from the context, extras, exceptions; configure()."""

from __future__ import annotations

import json
import logging

import pytest

from switchyard.logs import REQUEST_ID, JsonFormatter, RequestIdFilter, configure


def render(record: logging.LogRecord) -> dict[str, object]:
    RequestIdFilter().filter(record)
    data: dict[str, object] = json.loads(JsonFormatter().format(record))
    return data


def make(msg: str = "hello %s", args: tuple[object, ...] = ("world",), **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("switchyard.test", logging.WARNING, __file__, 1, msg, args, None)
    for name, value in extra.items():
        setattr(record, name, value)
    return record


def test_a_line_is_one_json_object_with_the_request_id_of_its_context() -> None:
    outside = render(make())
    assert outside["message"] == "hello world" and outside["level"] == "warning"
    assert outside["logger"] == "switchyard.test" and "request_id" not in outside
    assert str(outside["time"]).endswith("+00:00") and "." in str(outside["time"])  # UTC, milliseconds
    token = REQUEST_ID.set("req-123")
    try:
        inside = render(make())
    finally:
        REQUEST_ID.reset(token)
    assert inside["request_id"] == "req-123"


def test_extra_fields_are_kept_and_odd_values_written_as_text() -> None:
    data = render(make(status=200, pool="small-us", when=object, request_id="explicit"))
    assert data["status"] == 200 and data["pool"] == "small-us"
    assert data["request_id"] == "explicit"  # an explicit id wins over the context's
    assert "class 'object'" in str(data["when"])
    for standard in ("args", "msg", "levelno", "pathname", "lineno", "exc_info"):
        assert standard not in data


def test_an_exception_is_one_field_holding_its_traceback() -> None:
    try:
        raise ValueError("bad value")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), exc_info=__import__("sys").exc_info())
    data = render(record)
    assert "Traceback" in str(data["exception"]) and "ValueError: bad value" in str(data["exception"])
    assert "\n" not in JsonFormatter().format(record)  # one line however long the traceback


def test_configure_routes_every_logger_uvicorns_included(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    uvicorn = logging.getLogger("uvicorn.error")
    uvicorn_saved = (list(uvicorn.handlers), uvicorn.level, uvicorn.propagate, uvicorn.disabled)
    # As uvicorn's own configuration leaves it (a handler of its own, not propagating); other tests
    # may have left a level on it or disabled it.
    uvicorn.addHandler(logging.NullHandler())
    uvicorn.propagate, uvicorn.disabled = False, False
    uvicorn.setLevel(logging.INFO)
    try:
        configure("info", "json")
        logging.getLogger("switchyard.anything").info("first %d", 1)
        uvicorn.info("second")
        logging.getLogger("switchyard.anything").debug("not shown")
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        assert [(x["logger"], x["message"]) for x in lines] == [("switchyard.anything", "first 1"),
                                                                ("uvicorn.error", "second")]
        configure("warning", "text")
        logging.getLogger("switchyard.anything").warning("plain")
        assert capsys.readouterr().err.rstrip().endswith("WARNING switchyard.anything: plain")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        uvicorn.handlers[:] = uvicorn_saved[0]
        uvicorn.setLevel(uvicorn_saved[1])
        uvicorn.propagate, uvicorn.disabled = uvicorn_saved[2], uvicorn_saved[3]
