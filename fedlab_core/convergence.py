"""The convergence test: whether a curve of scores has stopped moving, a pure function of the curve.

The engine uses it to stop a run (``RunConfig.stop_at_plateau``) and :mod:`fedlab_core.verdicts` to refuse to
decide on runs that fail it; it sits below both, so that neither imports the other for it.

**The test** (:func:`plateaued`): a line fitted by least squares to the last third of the evaluated rounds (at
least three of them, and at least :data:`MIN_EVALUATIONS` evaluated rounds in all) rises or falls by at most
:data:`PLATEAU_RISE` over that span.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

PLATEAU_RISE = 0.01      # the most a converged curve may rise or fall over the last third of its evaluations
MIN_EVALUATIONS = 6      # fewer evaluated rounds than this show nothing about a plateau


def evaluated(curve: Sequence[float | None] | Mapping[int, float | None]) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, values) of the evaluated points of a curve (None or NaN: not evaluated); a sequence's
    entries are rounds 1, 2, ..."""
    items = curve.items() if isinstance(curve, Mapping) else enumerate(curve, 1)
    pts = [(float(r), float(v)) for r, v in items if v is not None and not math.isnan(float(v))]
    rounds, values = (np.array(x, dtype=float) for x in zip(*pts)) if pts else (np.array([]), np.array([]))
    return rounds, values


def plateau_rise(curve: Sequence[float | None] | Mapping[int, float | None]) -> float:
    """The rise of a least-squares line over the last third of a curve's evaluated rounds (at least three
    points), from the first of them to the last; NaN when fewer than :data:`MIN_EVALUATIONS` rounds were
    evaluated.

    Parameters
    ----------
    curve : the metric per round (a sequence for rounds 1, 2, ... or a mapping round -> value); None or NaN
        marks a round without an evaluation.
    """
    rounds, values = evaluated(curve)
    if len(values) < MIN_EVALUATIONS:
        return math.nan
    k = max(3, math.ceil(len(values) / 3))
    x, y = rounds[-k:], values[-k:]
    slope = np.polyfit(x, y, 1)[0]
    return float(slope * (x[-1] - x[0]))


def plateaued(curve: Sequence[float | None] | Mapping[int, float | None], rise: float = PLATEAU_RISE) -> bool:
    """The convergence test of one run's curve: the line fitted to its last third moves by at most `rise`
    (up or down) over that span. False with fewer than :data:`MIN_EVALUATIONS` evaluated rounds."""
    r = plateau_rise(curve)
    return bool(not math.isnan(r) and abs(r) <= rise)


def converged(curves: Sequence[Sequence[float | None]] | Sequence[float | None], rise: float = PLATEAU_RISE) -> bool:
    """Whether every seed's curve passes :func:`plateaued` (one curve, or one per seed)."""
    curves = list(curves)
    if curves and not isinstance(curves[0], (Sequence, Mapping, np.ndarray)):
        curves = [curves]
    return bool(curves) and all(plateaued(c, rise) for c in curves)
