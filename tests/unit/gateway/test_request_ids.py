"""Request ids: the client's when sane, else unique without a system call each."""

from __future__ import annotations

import pytest

from switchyard.gateway.request import RequestIds


def test_new_ids_are_unique_within_and_across_processes() -> None:
    a, b = RequestIds(), RequestIds()
    ids = [a.new() for _ in range(1000)] + [b.new() for _ in range(1000)]
    assert len(set(ids)) == 2000


@pytest.mark.parametrize(("given", "kept"), [
    ("req-123", True), ("a" * 128, True), ("a" * 129, False), ("bad id", False), ("x\r\ny", False), ("", False),
])
def test_client_ids_are_kept_only_when_sane(given: str, kept: bool) -> None:
    ids = RequestIds()
    got = ids.for_request({"x-request-id": given})
    assert (got == given) is kept
    assert ids.for_request({}) != ids.for_request({})
