"""The maths of embedding classifiers (cosine, centroid, nearest-centroid score) and reading an answer."""

from __future__ import annotations

import math

import msgspec
import pytest

from switchyard.gateway.classifiers import ClassifierError, _vectors, centroid, cosine, nearest_centroid_score


def test_cosine() -> None:
    assert cosine([1, 0], [0, 1]) == 0.0
    assert cosine([2, 0], [5, 0]) == pytest.approx(1.0)
    assert cosine([1, 1], [-1, -1]) == pytest.approx(-1.0)
    assert cosine([1, 2, 3], [2, 4, 6.0]) == pytest.approx(1.0)
    assert cosine([1, 0], [1, 1]) == pytest.approx(1 / math.sqrt(2))
    assert cosine([0, 0], [1, 1]) == 0.0  # no direction: no similarity
    with pytest.raises(ValueError, match="dimensions"):
        cosine([1, 2], [1, 2, 3])


def test_centroid() -> None:
    assert centroid([[1, 2], [3, 4], [5, 6]]) == [3.0, 4.0]
    assert centroid([[0.5, -1]]) == [0.5, -1.0]
    with pytest.raises(ValueError, match="no vectors"):
        centroid([])
    with pytest.raises(ValueError, match="different dimensions"):
        centroid([[1, 2], [1]])


def test_nearest_centroid_score() -> None:
    pos, neg = [1.0, 0.0], [0.0, 1.0]
    assert nearest_centroid_score([1, 0], pos, neg) == pytest.approx(1.0)
    assert nearest_centroid_score([0, 1], pos, neg) == pytest.approx(0.0)
    assert nearest_centroid_score([1, 1], pos, neg) == pytest.approx(0.5)  # as close to both
    assert nearest_centroid_score([3, 1], pos, neg) > 0.5 > nearest_centroid_score([1, 3], pos, neg)
    # The scale of any vector does not matter.
    assert nearest_centroid_score([30, 10], [5, 0], [0, 0.1]) == pytest.approx(nearest_centroid_score([3, 1], pos, neg))
    # Opposite centroids would reach 1.5 and -0.5: the score stays in [0, 1].
    assert nearest_centroid_score([1, 0], [1, 0], [-1, 0]) == 1.0
    assert nearest_centroid_score([-1, 0], [1, 0], [-1, 0]) == 0.0
    with pytest.raises(ValueError, match="dimensions"):
        nearest_centroid_score([1, 0, 0], pos, neg)


def _answer(*items: tuple[int, list[float]]) -> bytes:
    return msgspec.json.encode({"object": "list", "model": "m", "usage": {"prompt_tokens": 3},
                                "data": [{"index": i, "object": "embedding", "embedding": e} for i, e in items]})


def test_answers_are_read_in_input_order() -> None:
    assert _vectors(_answer((1, [0.0, 1.0]), (0, [1.0, 0.0])), 2) == [[1.0, 0.0], [0.0, 1.0]]


@pytest.mark.parametrize("raw", [
    b"not json",
    b'{"data": "nope"}',
    b'{"data": [{"index": 0, "embedding": "AAAA"}]}',  # base64, which was not asked for
    _answer((0, [1.0])),  # one item for two inputs
    _answer((0, [1.0]), (0, [1.0])),
    _answer((0, [1.0]), (1, [1.0, 2.0])),
    _answer((0, []), (1, [])),
])
def test_malformed_answers_are_errors(raw: bytes) -> None:
    with pytest.raises(ClassifierError):
        _vectors(raw, 2)
