"""The convergence test: whether a curve of scores has stopped moving, a pure function of the curve.

The engine uses it to stop a run (``RunConfig.stop_at_plateau``) and :mod:`fedlab_core.verdicts` to refuse to
decide on runs that fail it; it sits below both, so that neither imports the other for it.

**The test** (:func:`plateaued`): a line fitted by least squares to the last third of the evaluated rounds (at
least three of them, and at least :data:`MIN_EVALUATIONS` evaluated rounds in all) rises or falls by at most
:data:`PLATEAU_RISE` over that span. A claim's runs (:func:`converged`) are tested on their mean curve over the
seeds, the quantity a verdict reads.

**The stop** (:func:`stop_round`): a run stops at the evaluated round where the test has passed at `patience`
evaluations in a row. It reads whatever curve it is given; the book's runs give it the clients' accuracy on a
validation share held out of their training data (``"validation_accuracy"``, :func:`metric_curve`), never the
test set. :func:`replay` applies the stop to finished curves: how far the score at the stop lies from the
score at the end.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

PLATEAU_RISE = 0.01      # the most a converged curve may rise or fall over the last third of its evaluations
MIN_EVALUATIONS = 6      # fewer evaluated rounds than this show nothing about a plateau
VALIDATION = "validation_accuracy"   # the curve of the clients' mean accuracy on their held-out validation shares


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


def mean_curve(curves: Sequence[Sequence[float | None] | Mapping[int, float | None]]) -> dict[float, float] | None:
    """``{round: mean over the curves}`` of curves that evaluated the same rounds; None when their evaluated
    rounds differ (runs that stopped at different rounds, or one that diverged: its NaN rounds are not evaluated)."""
    points = [evaluated(c) for c in curves]
    if not points or any(len(r) != len(points[0][0]) or (r != points[0][0]).any() for r, _ in points):
        return None
    return dict(zip(points[0][0].tolist(), np.mean([v for _, v in points], axis=0).tolist()))


def converged(curves: Sequence[Sequence[float | None]] | Sequence[float | None], rise: float = PLATEAU_RISE) -> bool:
    """The convergence test of a claim's runs, one curve per seed (or a single curve): the mean curve over the
    seeds passes :func:`plateaued`, since a verdict reads the mean over the seeds and a fitted rise averaged over
    five seeds is resolved to well under the test's point. Where the runs evaluated different rounds (each stopped
    at its own plateau) there is no mean curve, and every curve must pass."""
    curves = list(curves)
    if curves and not isinstance(curves[0], (Sequence, Mapping, np.ndarray)):
        curves = [curves]
    if not curves:
        return False
    mean = mean_curve(curves)
    return plateaued(mean, rise) if mean is not None else all(plateaued(c, rise) for c in curves)


def metric_curve(rows: Sequence[Mapping], metric: str) -> dict[int, float | None]:
    """``{round: value}`` of a run's log rows for `metric`: a logged number, or :data:`VALIDATION`, the mean over
    clients of ``client_validation_accuracy`` (rounds without it: None)."""
    if metric != VALIDATION:
        return {int(r["round"]): r.get(metric) for r in rows}
    out: dict[int, float | None] = {}
    for r in rows:
        val = [v for v in (r.get("client_validation_accuracy") or ()) if v is not None and not math.isnan(v)]
        out[int(r["round"])] = float(np.mean(val)) if val else None
    return out


def stop_round(curve: Sequence[float | None] | Mapping[int, float | None], patience: int = 1,
               rise: float = PLATEAU_RISE) -> int | None:
    """The evaluated round at which a run with this curve stops: the first at which the curve up to it has passed
    :func:`plateaued` at `patience` evaluated rounds in a row; None when it never does."""
    if patience < 1:
        raise ValueError(f"patience: must be at least 1; got {patience}")
    rounds, values = evaluated(curve)
    streak = 0
    for i in range(MIN_EVALUATIONS, len(values) + 1):
        streak = streak + 1 if plateaued(dict(zip(rounds[:i], values[:i])), rise) else 0
        if streak >= patience:
            return int(rounds[i - 1])
    return None


def last_fifth(values: Sequence[float]) -> float:
    """The mean of the last fifth of a curve's values (at least one): a run's score, which one noisy round cannot
    decide."""
    values = list(values)
    return float(np.mean(values[-max(1, math.ceil(len(values) / 5)):])) if values else math.nan


def replay(curve: Sequence[float | None] | Mapping[int, float | None], patience: int = 1,
           rise: float = PLATEAU_RISE, score: Sequence[float | None] | Mapping[int, float | None] | None = None
           ) -> tuple[int | None, float]:
    """The stop applied to a finished curve: (the round it stops at, or None, and the score at the end minus the
    score at the stop; 0 when it does not stop). The stop reads `curve`; the scores (:func:`last_fifth`) read
    `score` (default: the same curve), e.g. the stop on validation and the score on test."""
    at = stop_round(curve, patience, rise)
    rounds, values = evaluated(curve if score is None else score)
    if at is None:
        return None, 0.0
    return at, last_fifth(values) - last_fifth(values[rounds <= at])
