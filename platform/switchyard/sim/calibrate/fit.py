"""Fitting the step-time model to measured latencies. Pure functions, no I/O.

Two kinds of measurement, each one step of known shape:

* a **prefill sample**: the TTFT of one request on an idle engine, ``new`` uncached prompt
  tokens after ``cached`` prefix-cache hits: the frontend overhead plus one step of ``new``
  tokens, one sequence, ``cached + new`` KV tokens read and ``new*cached + new(new+1)/2``
  attention pairs;
* a **decode sample**: the mean inter-token latency while ``batch`` sequences all decode with
  ``kv_tokens`` context tokens between them: one step of ``batch`` tokens and sequences,
  reading ``kv_tokens`` of KV (attention pairs are the same number).

The model (``StepTimeModel``, plus the frontend overhead) is linear in its seven coefficients
once each sample is assigned to the side of the ``max`` that binds (compute or memory). The
fit alternates: solve a non-negative least-squares problem for an assignment, reassign every
sample to the side the solution says binds, repeat until stable; it starts from every
plausible assignment (all compute; decode on the memory side with prefill split at each
prompt length) and keeps the solution with the lowest BIC, so a side that never binds costs
nothing and fits to zero. Residuals are relative (a 5 ms ITL and a 50 ms TTFT count alike), but
no sample is weighted above four times a typical one of its kind.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from switchyard.sim.measured import StepTimeModel

#: Coefficient order of the parameter vector.
PARAMS = ("step_s", "per_seq_s", "per_token_s", "per_attn_pair_s", "frontend_overhead_s",
          "weights_s", "per_kv_token_s")
_COMMON = (0, 1, 4)  # step, per-seq and frontend columns are on neither side of the max
_COMPUTE = (2, 3)
_MEMORY = (5, 6)


@dataclass(frozen=True)
class PrefillSample:
    """TTFT of one request on an idle engine."""

    new_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass(frozen=True)
class DecodeSample:
    """Mean inter-token latency while ``batch`` sequences decode together."""

    batch: int
    kv_tokens: float
    itl_s: float


@dataclass(frozen=True)
class GroupQuality:
    """How well the model reproduces one kind of sample."""

    samples: int
    r2: float
    rms_s: float
    max_rel_error: float


@dataclass(frozen=True)
class StepFit:
    """The fitted model and how well it fits.

    Attributes:
        step_time: The step-time coefficients.
        frontend_overhead_s: Fitted TTFT time outside the prefill step.
        prefill: Quality on the prefill samples.
        decode: Quality on the decode samples.
        memory_bound_decode: Decode samples whose fitted step is on the memory side.
        memory_bound_prefill: Prefill samples whose fitted step is on the memory side.
    """

    step_time: StepTimeModel
    frontend_overhead_s: float
    prefill: GroupQuality
    decode: GroupQuality
    memory_bound_decode: int
    memory_bound_prefill: int

    def predict_ttft(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """TTFT the model predicts on an idle engine."""
        return self.frontend_overhead_s + _prefill_step(self.step_time, new_tokens, cached_tokens)

    def predict_itl(self, batch: int, kv_tokens: float) -> float:
        """Decode step time the model predicts."""
        return _decode_step(self.step_time, batch, kv_tokens)


def _prefill_step(m: StepTimeModel, new: int, cached: int) -> float:
    pairs = new * cached + new * (new + 1) / 2
    compute = m.per_token_s * new + m.per_attn_pair_s * pairs
    memory = m.weights_s + m.per_kv_token_s * (cached + new)
    return m.step_s + m.per_seq_s + max(compute, memory)


def _decode_step(m: StepTimeModel, batch: int, kv: float) -> float:
    compute = m.per_token_s * batch + m.per_attn_pair_s * kv
    memory = m.weights_s + m.per_kv_token_s * kv
    return m.step_s + m.per_seq_s * batch + max(compute, memory)


# --- linear algebra (seven unknowns: no numpy needed) ----------------------------------------

def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a small symmetric positive definite system by Gaussian elimination."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        if abs(p) < 1e-300:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / p
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        p = m[i][i]
        s = m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))
        x[i] = s / p if abs(p) > 1e-300 else 0.0
    return x


def _lstsq_subset(cols: list[list[float]], y: list[float], subset: list[int],
                  ridge: float) -> list[float]:
    """Least squares on the chosen (unit-norm) columns; a tiny ridge settles rank deficiency."""
    k = len(subset)
    ata = [[sum(p * q for p, q in zip(cols[i], cols[j], strict=True)) for j in subset]
           for i in subset]
    for d in range(k):
        ata[d][d] += ridge
    aty = [sum(p * q for p, q in zip(cols[i], y, strict=True)) for i in subset]
    z = _solve(ata, aty)
    full = [0.0] * len(cols)
    for pos, i in enumerate(subset):
        full[i] = z[pos]
    return full


def nnls(rows: Sequence[Sequence[float]], y: Sequence[float], ridge: float = 1e-10) -> list[float]:
    """Non-negative least squares (Lawson-Hanson), columns scaled to unit norm first.

    Args:
        rows: The design matrix, one row per observation.
        y: The observations.
        ridge: Tikhonov term on the scaled problem: negligible for identified coefficients,
            it sends unidentified ones (columns that are combinations of others) to zero.

    Returns:
        The coefficient vector (>= 0).
    """
    n = len(rows[0])
    raw = [[float(r[j]) for r in rows] for j in range(n)]
    norms = [math.sqrt(sum(v * v for v in c)) for c in raw]
    cols = [[v / s for v in c] if s > 0 else [0.0] * len(c) for c, s in zip(raw, norms, strict=True)]
    yv = [float(v) for v in y]
    usable = [j for j in range(n) if norms[j] > 0]
    x = [0.0] * n
    passive: list[int] = []

    def gradient(xs: list[float]) -> list[float]:
        resid = [yv[i] - sum(cols[j][i] * xs[j] for j in usable) for i in range(len(yv))]
        return [sum(c * r for c, r in zip(cols[j], resid, strict=True)) for j in range(n)]

    for _ in range(3 * n + 10):
        w = gradient(x)
        candidates = [j for j in usable if j not in passive and w[j] > 1e-12]
        if not candidates:
            break
        passive.append(max(candidates, key=lambda j: w[j]))
        for _ in range(3 * n + 10):
            z = _lstsq_subset(cols, yv, passive, ridge)
            if all(z[j] > 0 for j in passive):
                x = z
                break
            alpha = min(x[j] / (x[j] - z[j]) for j in passive if z[j] <= 0)
            x = [xi + alpha * (zi - xi) for xi, zi in zip(x, z, strict=True)]
            passive = [j for j in passive if x[j] > 1e-15]
            x = [xi if j in passive else 0.0 for j, xi in enumerate(x)]
            if not passive:
                break
    return [x[j] / norms[j] if norms[j] > 0 else 0.0 for j in range(n)]


# --- the model fit --------------------------------------------------------------------------

def _features(prefill: Sequence[PrefillSample],
              decode: Sequence[DecodeSample]) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """Per sample: the compute-side and memory-side feature rows, and the observation."""
    compute: list[list[float]] = []
    memory: list[list[float]] = []
    obs: list[float] = []
    for p in prefill:
        new, c = p.new_tokens, p.cached_tokens
        pairs = new * c + new * (new + 1) / 2
        compute.append([1, 1, new, pairs, 1, 0, 0])
        memory.append([1, 1, 0, 0, 1, 1, c + new])
        obs.append(p.ttft_s)
    for d in decode:
        compute.append([1, d.batch, d.batch, d.kv_tokens, 0, 0, 0])
        memory.append([1, d.batch, 0, 0, 0, 1, d.kv_tokens])
        obs.append(d.itl_s)
    return compute, memory, obs


def _predict(x: Sequence[float], crow: Sequence[float], mrow: Sequence[float]) -> tuple[float, bool]:
    common = sum(x[j] * crow[j] for j in _COMMON)
    comp = sum(x[j] * crow[j] for j in _COMPUTE)
    mem = sum(x[j] * mrow[j] for j in _MEMORY)
    return common + max(comp, mem), mem > comp


def _fit_assignment(compute: list[list[float]], memory: list[list[float]], obs: list[float],
                    scale: list[float], on_memory: list[bool]) -> tuple[list[float], list[bool], float]:
    seen: set[tuple[bool, ...]] = set()
    x: list[float] = [0.0] * len(PARAMS)
    for _ in range(30):
        seen.add(tuple(on_memory))
        rows = [[v / w for v in (m if mem else c)]
                for c, m, w, mem in zip(compute, memory, scale, on_memory, strict=True)]
        x = nnls(rows, [y / w for y, w in zip(obs, scale, strict=True)])
        predicted = [_predict(x, c, m) for c, m in zip(compute, memory, strict=True)]
        nxt = [mem for _, mem in predicted]
        if tuple(nxt) in seen:
            on_memory = nxt
            break
        on_memory = nxt
    sse = sum(((_predict(x, c, m)[0] - y) / w) ** 2
              for c, m, y, w in zip(compute, memory, obs, scale, strict=True))
    return x, on_memory, sse


def _quality(pred: list[float], obs: list[float]) -> GroupQuality:
    n = len(obs)
    if n == 0:
        return GroupQuality(0, float("nan"), float("nan"), float("nan"))
    mean = sum(obs) / n
    ss_res = sum((p - o) ** 2 for p, o in zip(pred, obs, strict=True))
    ss_tot = sum((o - mean) ** 2 for o in obs)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")
    return GroupQuality(samples=n, r2=r2, rms_s=math.sqrt(ss_res / n),
                        max_rel_error=max(abs(p - o) / o for p, o in zip(pred, obs, strict=True)))


def fit_step_time(prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample]) -> StepFit:
    """Fit the step-time model and frontend overhead to prefill and decode samples.

    Raises:
        ValueError: Too few samples to fit (at least two prefill lengths and one decode
            sample are needed), or a non-positive latency.
    """
    if len({p.new_tokens for p in prefill}) < 2 or not decode:
        raise ValueError("calibrate: need TTFTs at two prompt lengths or more and at least "
                         "one decode measurement to fit")
    if any(p.ttft_s <= 0 for p in prefill) or any(d.itl_s <= 0 for d in decode):
        raise ValueError("calibrate: measured latencies must be positive")
    compute, memory, obs = _features(prefill, decode)
    n_pre = len(prefill)
    # Relative residuals, but no sample weighs more than four times a typical one of its
    # kind: one disturbed, far too short measurement must not steer the fit.
    floor_pre = statistics.median(obs[:n_pre]) / 4
    floor_dec = statistics.median(obs[n_pre:]) / 4
    scale = [max(y, floor_pre) for y in obs[:n_pre]] + [max(y, floor_dec) for y in obs[n_pre:]]
    starts: list[list[bool]] = [[False] * len(obs), [False] * n_pre + [True] * len(decode)]
    for t in sorted({p.new_tokens for p in prefill}):
        starts.append([p.new_tokens <= t for p in prefill] + [True] * len(decode))
    best: tuple[float, list[float], list[bool]] | None = None
    n = len(obs)
    for start in starts:
        x, on_memory, sse = _fit_assignment(compute, memory, obs, scale, start)
        k = sum(1 for v in x if v > 0)
        bic = n * math.log(max(sse, 1e-24) / n) + k * math.log(n)
        if best is None or bic < best[0] - 1e-9:
            best = (bic, x, on_memory)
    assert best is not None
    _, x, on_memory = best
    values = dict(zip(PARAMS, x, strict=True))
    frontend = values.pop("frontend_overhead_s")
    model = StepTimeModel(**values)
    pred = [_predict(x, c, m)[0] for c, m in zip(compute, memory, strict=True)]
    return StepFit(
        step_time=model, frontend_overhead_s=frontend,
        prefill=_quality(pred[:n_pre], obs[:n_pre]), decode=_quality(pred[n_pre:], obs[n_pre:]),
        memory_bound_decode=sum(on_memory[n_pre:]), memory_bound_prefill=sum(on_memory[:n_pre]))


def busy_ttft(model: StepTimeModel, frontend_s: float, batch: int, kv_tokens: float,
              prompt_tokens: int) -> float:
    """Mean TTFT of a request joining ``batch`` decoding sequences, as the simulator has it.

    The request reaches the scheduler ``frontend_s`` after it arrives, waits for the step in
    flight to end (half a decode step on average) and is prefilled in a mixed step.
    """
    n = prompt_tokens
    decode = model.seconds(batch, batch, round(kv_tokens), round(kv_tokens))
    mixed = model.seconds(batch + n, batch + 1, round(kv_tokens) + n,
                          round(kv_tokens) + n * (n + 1) // 2)
    return frontend_s + decode / 2 + mixed


def busy_frontend(model: StepTimeModel, probes: Sequence[tuple[int, float, int, float]]) -> float | None:
    """The frontend overhead that busy-engine TTFTs imply (median over the probes).

    Args:
        model: The fitted step-time model.
        probes: (batch, kv_tokens, prompt_tokens, measured TTFT) of each probe.

    Returns:
        Seconds, or None without probes.
    """
    if not probes:
        return None
    return statistics.median(ttft - busy_ttft(model, 0.0, b, kv, n) for b, kv, n, ttft in probes)
