"""A hedge's race: the late try and its hedge wait for their first byte side by side; the first to answer serves.

The procedure decided to hedge (:class:`~switchyard.decide.decision.Hedge`) or to keep waiting; this module
carries it out. Each try waits in its own task (:meth:`~switchyard.gateway.attempt.Try.start`), under its own
first-token deadline. The first try to answer (its first chunk, or the engine's own refusal of the client's
request) serves the request; the other is aborted at once (its connection closed: the engine aborts the
request, and its ``aborted`` count rises). A try that fails leaves the race to the other; when both fail, the
request moves on along its plan with the later failure.
"""

from __future__ import annotations

import asyncio

from switchyard.decide.decision import Raced, Tried
from switchyard.gateway.attempt import Try


async def race(first: Try, second: Try | None) -> tuple[Raced, Try]:
    """Wait for ``first`` (whose task is running) and ``second`` (started here; None: ``first`` alone); what came
    of it, and the try that answers."""
    assert first.task is not None
    if second is None:
        try:
            tried = await asyncio.shield(first.task)
        except BaseException:
            first.abandon()
            raise
        return Raced(first.deliver(tried), first.url), first
    tries = {first.task: first, second.start(): second}
    failed: list[tuple[Try, Tried]] = []
    try:
        pending = set(tries)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                tried = task.result()
                if tried.outcome != "failed":
                    winner = tries[task]
                    loser = next(t for t in tries.values() if t is not winner)
                    if loser.task is not None and loser.task.done() and loser.task.result().outcome == "failed":
                        other = loser.task.result()
                    else:
                        loser.abandon()
                        other = Tried("cancelled")
                    return Raced(winner.deliver(tried), winner.url, other, loser.url), winner
                failed.append((tries[task], tried))
    except BaseException:  # the client left: neither try may go on
        for t in tries.values():
            t.abandon()
        raise
    (early, early_tried), (late, late_tried) = failed
    return Raced(late_tried, late.url, early_tried, early.url), late
