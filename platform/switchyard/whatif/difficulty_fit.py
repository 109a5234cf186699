"""Fits the weights of :mod:`switchyard.decide.difficulty` on the labelled prompt set (offline).

``python -m switchyard.whatif.difficulty_fit [PATH]`` reads the set (default: the one shipped with
the benchmarks, ``switchyard/bench/data/auto_prompts.jsonl``), fits an L2-regularised logistic
regression on its ``train`` split (features standardised; the regularisation strength chosen by
stratified 5-fold cross-validation on the train split alone, by log-loss), reports accuracy on
both splits, and prints ``WEIGHTS`` and ``BIAS`` as Python source to paste into ``difficulty.py``
(on the features' raw scale, so the request path does no standardising).

A tool, not part of the request path: it reads a file and uses numpy. It lives in ``whatif``, the
package that may import both the decisions and bench's workloads, and reads the set with bench's
loader (:mod:`switchyard.bench.labelled`, which the ``auto`` scenario uses too).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from switchyard.bench.labelled import LabelledPrompt, Quality, load_prompts
from switchyard.decide.difficulty import FEATURE_NAMES, difficulty_features
from switchyard.decide.features import RequestFeatures
from switchyard.decide.tokens import estimate_chat_tokens

Matrix = npt.NDArray[np.float64]

#: Candidate L2 strengths (on standardised features; the intercept is not penalised).
L2_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
FOLDS = 5


def features_of(prompt: LabelledPrompt, model: str = "auto") -> RequestFeatures:
    """The request's features as the gateway would extract them (earlier turns empty, as in policy tests)."""
    texts = [prompt.prompt] + ([prompt.system] if prompt.system else [])
    texts += [""] * max(0, prompt.messages - len(texts))
    return RequestFeatures(model=model, prompt_tokens=estimate_chat_tokens(texts), messages=prompt.messages,
                           last_user_text=prompt.prompt, system_text=prompt.system or "", has_tools=prompt.tools,
                           json_mode=prompt.json_mode)


@dataclass(frozen=True, slots=True)
class FittedModel:
    """Weights on the raw feature scale, ready for ``difficulty.py``."""

    weights: tuple[float, ...]
    bias: float
    l2: float

    def scores(self, x: Matrix) -> Matrix:
        """The model's probability of ``hard`` for each row of raw features."""
        return _sigmoid(x @ np.asarray(self.weights) + self.bias)


def _sigmoid(z: Matrix) -> Matrix:
    return np.asarray(1.0 / (1.0 + np.exp(-np.clip(z, -40.0, 40.0))), dtype=np.float64)


def feature_matrix(prompts: Sequence[LabelledPrompt]) -> tuple[Matrix, Matrix]:
    """Raw features (one row per prompt) and labels (1.0 for hard)."""
    x = np.array([difficulty_features(features_of(p)) for p in prompts], dtype=np.float64)
    y = np.array([1.0 if p.hard else 0.0 for p in prompts], dtype=np.float64)
    return x.reshape(len(prompts), len(FEATURE_NAMES)), y


def fit(x: Matrix, y: Matrix, l2: float, iterations: int = 50) -> FittedModel:
    """L2-regularised logistic regression by Newton's method on standardised features."""
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale == 0] = 1.0
    z = np.hstack([np.ones((len(x), 1)), (x - mean) / scale])
    penalty = l2 * np.eye(z.shape[1])
    penalty[0, 0] = 0.0
    beta = np.zeros(z.shape[1])
    for _ in range(iterations):
        p = _sigmoid(z @ beta)
        gradient = z.T @ (p - y) + penalty @ beta
        hessian = (z.T * (p * (1 - p))) @ z + penalty + 1e-9 * np.eye(z.shape[1])
        step = np.linalg.solve(hessian, gradient)
        beta -= step
        if float(np.abs(step).max()) < 1e-10:
            break
    weights = beta[1:] / scale
    bias = float(beta[0] - (weights * mean).sum())
    return FittedModel(tuple(float(w) for w in weights), bias, l2)


def log_loss(model: FittedModel, x: Matrix, y: Matrix) -> float:
    """Mean negative log-likelihood of ``y`` under ``model``."""
    p = np.clip(model.scores(x), 1e-12, 1 - 1e-12)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def folds(y: Matrix, k: int = FOLDS) -> list[npt.NDArray[np.int64]]:
    """Stratified folds, deterministic: each class's rows dealt out in order."""
    out: list[list[int]] = [[] for _ in range(k)]
    for label in (0.0, 1.0):
        for rank, row in enumerate(np.flatnonzero(y == label)):
            out[rank % k].append(int(row))
    return [np.array(sorted(f), dtype=np.int64) for f in out]


def choose_l2(x: Matrix, y: Matrix, grid: Sequence[float] = L2_GRID) -> tuple[float, dict[float, float]]:
    """The strength with the lowest cross-validated log-loss on ``x``, ``y`` (and every strength's loss)."""
    parts = folds(y)
    losses = {}
    for l2 in grid:
        total = 0.0
        for held in parts:
            keep = np.setdiff1d(np.arange(len(y)), held)
            total += log_loss(fit(x[keep], y[keep], l2), x[held], y[held]) * len(held)
        losses[l2] = total / len(y)
    return min(grid, key=lambda l2: (losses[l2], -l2)), losses


def weights_source(model: FittedModel) -> str:
    """``WEIGHTS`` and ``BIAS`` as Python source for ``difficulty.py``."""
    lines = ["WEIGHTS: tuple[float, ...] = ("]
    lines += [f"    {w:+.6f},  # {name}" for name, w in zip(FEATURE_NAMES, model.weights, strict=True)]
    return "\n".join([*lines, ")", f"BIAS = {model.bias:+.6f}"])


def main(argv: Sequence[str] | None = None) -> None:
    """Fit on the train split, report both splits, print the weights."""
    parser = argparse.ArgumentParser(prog="python -m switchyard.decide.difficulty_fit", description=__doc__)
    parser.add_argument("path", nargs="?", type=Path, help="labelled prompt set (JSONL) [the shipped one]")
    args = parser.parse_args(argv)
    prompts = load_prompts(args.path)
    train = [p for p in prompts if p.split == "train"]
    test = [p for p in prompts if p.split == "test"]
    x, y = feature_matrix(train)
    l2, losses = choose_l2(x, y)
    model = fit(x, y, l2)
    print("# cross-validated log-loss by L2 strength: "
          + ", ".join(f"{k:g}: {v:.4f}" for k, v in losses.items()))
    for name, part in (("train", train), ("test", test)):
        xs, ys = feature_matrix(part)
        q = Quality.of([bool(s >= 0.5) for s in model.scores(xs)], [bool(v) for v in ys])
        print(f"# {name}: n={q.n} accuracy {q.accuracy:.3f}, hard precision {q.precision:.3f}, "
              f"recall {q.recall:.3f} (threshold 0.5)")
    print(f"# L2 strength {l2:g}, {len(train)} train prompts ({int(y.sum())} hard)")
    print(weights_source(model))


if __name__ == "__main__":
    main()
