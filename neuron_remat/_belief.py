"""What `fit`'s search believes about a step's compiled bytes, as pure functions.

Two layers. `_Model` is the linear part: ``bytes(S) = intercept + scale x kept(S) + slope x
read(S)`` over the bytes a save set keeps and the bytes one layer's backward reads that it
recomputes (`_search._Candidate`), calibrated on the compiles with a figure. Beyond it,
each saved tag adds an unknown effect; the effects are one Gaussian belief, updated by the
compiles' figures (`_observe`, exact) and by compiles that said only whether they fit
(`_condition_on_outcomes`, expectation propagation). `_search._Search` chooses the prior
(its constants), the rows and the outcomes; nothing here knows which sets exist.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class _Model:
    """``bytes(S) = intercept + scale x kept(S) + slope x read(S)``: least squares over the
    compiled sets, `scale` and `slope` pulled towards 1 (`PRIOR_WEIGHT`) so that two or
    three compiles make a model. kept(S) and read(S) are bytes as the backend stores them
    (`_search._Candidate.stored`: XLA:CPU keeps bfloat16 as float32), so 1 is the right
    prior for `scale`, which learns what is left; `error` is the largest miss on the
    compiles."""

    intercept: float
    scale: float
    slope: float
    error: float = 0.0

    @classmethod
    def calibrate(cls, points: Sequence[tuple[int, int, int]]) -> _Model:
        """`points`: (compiled bytes, kept bytes, read bytes)."""
        y = np.array([b for b, _, _ in points], float)
        k = np.array([p[1] for p in points], float)
        r = np.array([p[2] for p in points], float)
        if len(points) == 1:
            return cls(float(y[0] - k[0] - r[0]), 1.0, 1.0, 0.0)
        wk = PRIOR_WEIGHT * max(float(np.ptp(k)), 1.0)
        wr = PRIOR_WEIGHT * max(float(np.ptp(r)), 1.0)
        a = np.vstack([np.column_stack([np.ones_like(k), k, r]),
                       [[0.0, wk, 0.0], [0.0, 0.0, wr]]])
        t = np.concatenate([y, [wk, wr]])
        (c0, scale, slope), *_ = np.linalg.lstsq(a, t, rcond=None)
        scale, slope = float(np.clip(scale, 0.0, 4.0)), float(np.clip(slope, 0.0, 4.0))
        intercept = float(np.mean(y - scale * k - slope * r))
        error = float(np.max(np.abs(y - intercept - scale * k - slope * r)))
        return cls(intercept, scale, slope, error)

    def predict(self, kept: int, read: int) -> int:
        return int(round(self.intercept + self.scale * kept + self.slope * read))


PRIOR_WEIGHT = 0.5
"""How hard the model's per-byte scale and workspace slope are pulled towards 1 (tuned with
the search's constants on the zoo's train steps: `_search`)."""


def _observe(prior: np.ndarray, x: np.ndarray, y: np.ndarray, noise: float
             ) -> tuple[np.ndarray, np.ndarray]:
    """The belief N(0, `prior`) about per-tag effects after compiles with figures: row i of
    `x` marks the tags of the i-th compiled set (`_marks`), whose effects, summed, plus
    normal noise of variance `noise`, came to `y[i]`. Returns the mean and covariance (the
    prior itself where no row is given)."""
    if not len(y):
        return np.zeros(len(prior)), prior
    k = x @ prior @ x.T + noise * np.eye(len(y))
    gain = prior @ x.T @ np.linalg.inv(k)
    return gain @ y, prior - gain @ x @ prior


EP_SWEEPS = 8
"""Passes of expectation propagation over the compiles that gave no figure
(`_condition_on_outcomes`). A numerical setting, not a tuned one: with 30 passes the search
makes the same compiles and plan at every size of the zoo's train steps, in both oracle
modes."""
EP_DAMP = 0.7
"""Each pass moves an outcome's Gaussian stand-in this share of the way to its new value
(damping keeps the passes from oscillating where outcomes pull against each other)."""


def _condition_on_outcomes(mean: np.ndarray, cov: np.ndarray, sets: np.ndarray,
                           room: np.ndarray, over: np.ndarray, noise: float
                           ) -> tuple[np.ndarray, np.ndarray]:
    """The normal belief N(`mean`, `cov`) about per-tag effects, conditioned on compiles
    that said only whether they fit: row i of `sets` marks the tags of the i-th compiled set,
    whose effects, summed, plus normal noise of variance `noise`, came out over `room[i]`
    where `over[i]`, at most that elsewhere. The exact belief is a normal cut by those
    half-spaces; this is its closest normal by expectation propagation (each outcome's step
    replaced by a Gaussian factor in its set's summed effect, `EP_SWEEPS` damped passes).
    Returns the mean and covariance."""
    n = len(mean)
    prec0 = np.linalg.inv(cov + 1e-9 * max(float(np.trace(cov)), 1.0) * np.eye(n))
    shift0 = prec0 @ mean
    sign = np.where(over, -1.0, 1.0)
    site_prec, site_shift = np.zeros(len(sets)), np.zeros(len(sets))
    for _ in range(EP_SWEEPS):
        for i, a in enumerate(sets):
            m, v = float(a @ mean), float(a @ cov @ a)
            vc = 1.0 / max(1.0 / v - site_prec[i], 1e-30)  # the belief without outcome i
            mc = vc * (m / v - site_shift[i])
            d = math.sqrt(noise + vc)
            z = sign[i] * (room[i] - mc) / d
            r = _mills(z)
            hat_m = mc - sign[i] * vc * r / d  # the moments with outcome i's step
            hat_v = max(vc - vc * vc * r * (z + r) / (d * d), 1e-12 * vc)
            site_prec[i] += EP_DAMP * (max(1.0 / hat_v - 1.0 / vc, 0.0) - site_prec[i])
            site_shift[i] += EP_DAMP * (hat_m / hat_v - mc / vc - site_shift[i])
            cov = np.linalg.inv(prec0 + (sets.T * site_prec) @ sets)
            mean = cov @ (shift0 + sets.T @ site_shift)
    return mean, cov


def _marks(tags: Sequence[str], sets: Sequence[tuple[str, ...]]) -> np.ndarray:
    """One row per save set of `sets`, 1.0 in the column of each of `tags` it saves."""
    return np.array([[float(t in s) for t in tags] for s in sets]).reshape(len(sets), len(tags))


def _mills(z: float) -> float:
    """phi(z) / Phi(z), the standard normal's density over its distribution function (Phi
    by erfc: 1 + erf loses its digits below about -8); -z below -30, where the quotient
    is -z to within 0.1% and both terms head for underflow."""
    if z < -30:
        return -z
    cdf = 0.5 * math.erfc(-z / math.sqrt(2.0))
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) / cdf


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
