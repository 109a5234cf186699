"""A shutdown's step that takes long is named in the log, once; quick steps say nothing."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from switchyard.gateway.shutdown import ShutdownSteps


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_long_step_is_named_once_even_while_the_caller_is_blocked(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "switchyard.gateway")
    with ShutdownSteps("shutdown", warn_after_s=0.2) as steps:
        steps.at("closing the engines' connections")
        deadline = time.monotonic() + 10
        while not warnings_of(caplog) and time.monotonic() < deadline:
            time.sleep(0.05)  # (blocking: the warning comes from the watch's own thread)
        time.sleep(0.6)  # three times as long again: it is not said twice
        steps.at("closing the database")
    said = warnings_of(caplog)
    assert len(said) == 1, said
    step, after = said[0].rsplit(" after ", 1)
    assert step == "shutdown: still closing the engines' connections"
    assert float(after.removesuffix(" s")) >= 0.2
    assert not any(t.name == "switchyard-shutdown" for t in threading.enumerate())  # the watch ended with it


def test_quick_steps_and_a_shutdown_without_steps_say_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "switchyard.gateway")
    with ShutdownSteps("shutdown", warn_after_s=5.0) as steps:
        for step in ("stopping the background tasks", "writing the usage ledger", "closing the database"):
            steps.at(step)
    with ShutdownSteps("shutdown"):
        pass
    assert warnings_of(caplog) == []
    assert not any(t.name == "switchyard-shutdown" for t in threading.enumerate())
