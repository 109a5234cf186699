"""The stall sampler names the code that held the event loop."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from switchyard.gateway.stalls import PREFIX, StallSampler

# Timings compared with what they should be: no other test competes for the cores meanwhile.
pytestmark = pytest.mark.alone


def hog_the_loop() -> None:
    time.sleep(0.06)  # a blocking call on the loop: every request waits for it


async def beating(sampler: StallSampler, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(0.01)
        sampler.beat()


def test_a_blocking_call_on_the_loop_is_logged_with_where_it_was(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        sampler = StallSampler(0.02, 0.01)
        sampler.start()
        try:
            await beating(sampler, 0.1)  # a healthy loop: nothing logged
            assert sampler.stalls == 0
            asyncio.get_running_loop().call_soon(hog_the_loop)
            await beating(sampler, 0.2)
        finally:
            sampler.stop()
        assert sampler.stalls == 1

    with caplog.at_level(logging.WARNING, logger="switchyard.stalls"):
        asyncio.run(main())
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith(PREFIX)]
    stalled_ms = float(line.split()[3])
    assert 40 <= stalled_ms <= 200, line
    assert "test_stalls.py" in line and "hog_the_loop" in line.split(" < ")[0], line
    # the frames below it: asyncio's, named from the standard library's folder, not the machine's path
    assert "asyncio/events.py" in line and ".pyenv" not in line and "/usr/" not in line, line
