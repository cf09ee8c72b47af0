"""Verdicts on a paper's claims, computed from per-seed scores by one written rule with a stated error rate.

Every verdict in the book comes from this module; none is typed by hand.

**The score.** A run is scored at convergence, not on its last noisy round: by default the mean of the
metric over the last fifth of its evaluated rounds (:data:`LAST_FIFTH`); a paper's own protocol where it
states one, named in the verdict (:data:`BEST_ROUND`: the best evaluated round, DisTrans's Tables 5-6;
:data:`BEST_VALIDATION`: each client's test accuracy at its best round on a validation set held out of its
training data, FRAug's authors' code, for runs with ``RunConfig.validation_monitor``).

**The convergence test** (:func:`plateaued`), per seed: a line fitted by least squares to the last third of
the evaluated rounds (at least three of them, and at least :data:`MIN_EVALUATIONS` evaluated rounds in
all) rises or falls by at most :data:`PLATEAU_RISE` over that span. A verdict on runs of which any fails it
is *inconclusive (not converged)*, never held or not held. The engine can stop a run as soon as it passes
(``RunConfig.stop_at_plateau``), with ``num_rounds`` as the cap.

**An ordering claim** ("A beats B") is judged on the paired per-seed differences ``d = A - B`` of the
scores (the same seeds: the same splits and initialisations), by the 95% Student-t interval of mean d:

- *held* when the interval lies wholly on the claimed side of zero;
- *not held (reversed)* when it lies wholly on the other side;
- *not held (no difference)* when it lies wholly inside the equivalence margin ``±margin``
  (:data:`MARGIN`, one accuracy point, for accuracies);
- *inconclusive* otherwise, and always with fewer than :data:`MIN_SEEDS` seeds, with runs that have not
  converged, or with a run that diverged (the reason is printed with it).

Under no difference the interval misses zero on each side with probability 2.5%, so a false *held* and a
false *not held (reversed)* each happen at most 2.5% of the time; :func:`error_rates` measures it by
simulation, and the power against a real difference, and :func:`rule` prints both. A chapter may add
seeds to an undecided claim, up to :data:`SEED_CAP`, by declaring two looks (``looks=2``): each look then
uses a 97.5% interval (Bonferroni), which keeps the false-decision rate of the two looks together within
the 5% of one look.

**A claimed number** ("+11.2 points", "a 1.2% overhead") is judged only where it is comparable on our data:
a gain in points, a share of a gap normalised by a reference run at the same budget, a cost ratio. It is
*reached* when the claimed value lies within our 95% interval or on its worse side (below it for a
quantity where higher is better, above it for a cost), *not reached* otherwise, with the same seed and
convergence requirements. An absolute number from another dataset ("reaches 99%") is *not comparable*,
with the reason: our dataset, not the method, would decide it. A deterministic measurement (a byte count,
a fitted exponent) is judged with ``deterministic=True``: one value, no interval.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

    from .store import History

MIN_SEEDS = 5            # a decision stands on at least this many seeds
SEED_CAP = 10            # the most seeds a chapter may add to an undecided claim (a second look)
LEVEL = 0.95             # the interval that decides, over all looks together
MARGIN = 0.01            # the equivalence margin for accuracies: one point (see rule())
PLATEAU_RISE = 0.01      # the most a converged curve may rise or fall over the last third of its evaluations
MIN_EVALUATIONS = 6      # fewer evaluated rounds than this show nothing about a plateau
NOISE_SD = 0.01          # the spread of paired per-seed differences in our converged runs, for error_rates()
SIMULATIONS = 20_000     # simulated claims per rate printed by rule()

LAST_FIFTH = "mean of the last fifth of evaluated rounds"
BEST_ROUND = "best evaluated round"
BEST_VALIDATION = "each client's best round on validation"
SCORES = (LAST_FIFTH, BEST_ROUND, BEST_VALIDATION)

HELD, NOT_HELD, INCONCLUSIVE = "held", "not held", "inconclusive"
REVERSED, NO_DIFFERENCE = "reversed", "no difference"
ORDER_VERDICTS = (HELD, NOT_HELD, INCONCLUSIVE)
REACHED, NOT_REACHED, NOT_COMPARABLE = "reached", "not reached", "not comparable"
NUMBER_VERDICTS = (REACHED, NOT_REACHED, INCONCLUSIVE, NOT_COMPARABLE)
NOT_CONVERGED, DIVERGED = "not converged", "a run diverged"
# every label a verdict can print, in the order tables and charts list them
OUTCOMES = (HELD, REACHED, f"{NOT_HELD} ({REVERSED})", f"{NOT_HELD} ({NO_DIFFERENCE})", NOT_REACHED,
            f"{INCONCLUSIVE} ({NOT_CONVERGED})", f"{INCONCLUSIVE} (fewer than {MIN_SEEDS} seeds)", INCONCLUSIVE,
            f"{INCONCLUSIVE} ({DIVERGED})", NOT_COMPARABLE)


def _values(x: Sequence[float] | Mapping[int, float]) -> dict[int, float] | list[float]:
    return {int(k): float(v) for k, v in x.items()} if isinstance(x, Mapping) else [float(v) for v in x]


def _paired(a, b) -> list[float]:
    """Per-seed differences a - b; mappings are paired by seed, sequences by position."""
    a, b = _values(a), _values(b)
    if isinstance(a, dict) != isinstance(b, dict):
        raise TypeError("a and b must both be sequences or both be mappings seed -> value")
    if isinstance(a, dict):
        if set(a) != set(b):
            raise ValueError(f"a and b must have the same seeds, got {sorted(a)} and {sorted(b)}")
        return [a[s] - b[s] for s in sorted(a)]
    if len(a) != len(b):
        raise ValueError(f"a and b must have one value per seed each, got {len(a)} and {len(b)}")
    return [x - y for x, y in zip(a, b)]


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def _t_quantile(level: float, dof):
    from scipy import stats
    return stats.t.ppf(0.5 + level / 2, dof)


def look_level(looks: int) -> float:
    """The level of each look's interval when a claim may be looked at `looks` times (Bonferroni)."""
    if not isinstance(looks, int) or isinstance(looks, bool) or looks < 1:
        raise ValueError(f"looks: must be an integer >= 1; got {looks!r}")
    return 1 - (1 - LEVEL) / looks


def _decide(low, high, sign: float, margin: float | None):
    """The rule's decision from an interval [low, high] of mean d (arrays or floats): 0 held, 1 reversed,
    2 no difference, 3 undecided. `sign` is +1 when the claim is that d > 0, -1 when d < 0."""
    low, high = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
    lo, hi = (low, high) if sign > 0 else (-high, -low)  # the interval of sign * d
    equivalent = (lo >= -margin) & (hi <= margin) if margin is not None else np.zeros_like(lo, dtype=bool)
    return np.select([lo > 0, hi < 0, equivalent], [0, 1, 2], default=3)


def _interval(values: list[float], level: float) -> tuple[float, float, float, float]:
    """(mean, standard error, low, high) of the mean of `values` at `level` (NaN bounds with one value)."""
    mean, se = _mean_se(values)
    if len(values) < 2:
        return mean, se, math.nan, math.nan
    half = float(_t_quantile(level, len(values) - 1)) * se
    return mean, se, mean - half, mean + half


@dataclass(frozen=True)
class Verdict:
    """One judged claim.

    Attributes
    ----------
    claim : the claim in a short phrase.
    verdict : the outcome, one of :data:`ORDER_VERDICTS` or :data:`NUMBER_VERDICTS`.
    mean : the mean paired difference (ordering) or our mean value (number).
    stderr : its standard error over seeds (NaN with one value).
    seeds : how many seeds it stands on.
    low, high : the interval the rule decided on (NaN with one value).
    claimed : the paper's number (numbers; None for orderings).
    converged : False when a run behind it failed the plateau test.
    values : the per-seed differences or values it was computed from.
    paper : the paper's figure for the claim, as text (e.g. "+0.189 on CIFAR-10"), for the tables.
    runs : for a claim judged on training runs, the runs of each side (claimed better first, one per seed),
        whose curves :meth:`Verdicts.curves` draws; empty otherwise.
    reason : why a claim is not held (reversed, no difference) or undecided (not converged, too few seeds,
        a run diverged), or why a number is not comparable; printed in brackets after the outcome.
    score : how each run was scored (:data:`SCORES`), for claims judged on runs.
    margin : the equivalence margin of an ordering claim (None: no "no difference" decision).
    """

    claim: str
    verdict: str
    mean: float
    stderr: float
    seeds: int
    low: float = math.nan
    high: float = math.nan
    claimed: float | None = None
    converged: bool = True
    values: tuple[float, ...] = ()
    paper: str = ""
    runs: tuple = field(default=(), compare=False, repr=False)
    reason: str = ""
    score: str = ""
    margin: float | None = None

    @property
    def label(self) -> str:
        """The verdict as printed: "held", "not held (reversed)", "inconclusive (not converged)", ..."""
        return self.verdict + (f" ({self.reason})" if self.reason else "")

    @property
    def category(self) -> str:
        """The label a count groups by (one of :data:`OUTCOMES`): the label, with a not comparable number's
        own reason left out and "not converged" standing for every unconverged claim."""
        if self.verdict == NOT_COMPARABLE:
            return NOT_COMPARABLE
        if self.reason.startswith(NOT_CONVERGED):
            return f"{INCONCLUSIVE} ({NOT_CONVERGED})"
        return self.label

    @property
    def decided(self) -> bool:
        """Whether the rule decided the claim (held, not held, reached or not reached)."""
        return self.verdict not in (INCONCLUSIVE, NOT_COMPARABLE)

    @property
    def evidence(self) -> str:
        """Our numbers in one phrase: "d = +0.012 [+0.004, +0.020] (5 seeds)" or "0.91 [0.88, 0.94] (5 seeds)"."""
        seeds = f"{self.seeds} seed{'s' if self.seeds != 1 else ''}"
        if self.diverged:
            return f"{seeds}, a run diverged"
        if self.claimed is None:
            return difference_text(self.mean, self.low, self.high, self.seeds, self.paper)
        interval = "" if math.isnan(self.low) or self.low == self.high else f" [{self.low:.3g}, {self.high:.3g}]"
        return f"{self.mean:.3g}{interval} ({seeds}), claimed {self.claimed:.3g}"

    def __str__(self) -> str:
        return f"{self.label}: {self.evidence}"

    @property
    def diverged(self) -> bool:
        return any(math.isnan(v) for v in self.values)


_IN_POINTS = re.compile(r"^\s*[+\-−]?\d*\.?\d+ points\b")


def difference_text(mean: float, low: float | None, high: float | None, seeds: int, paper: str = "") -> str:
    """An ordering claim's evidence in one phrase, in the paper's unit: the mean per-seed difference d, the
    interval the rule decided on and the seed count, in accuracy points where the paper's figure is in points
    ("+3.98 points (...)": "d = +0.42 points [+0.10, +0.74] (5 seeds)"), else as measured
    ("d = +0.004 [+0.001, +0.007] (5 seeds)")."""
    scale, unit, digits = (100, " points", 2) if _IN_POINTS.match(paper or "") else (1, "", 3)
    interval = ("" if low is None or math.isnan(low)
                else f" [{scale * low:+.{digits}f}, {scale * high:+.{digits}f}]")
    return f"d = {scale * mean:+.{digits}f}{unit}{interval} ({seeds} seed{'s' if seeds != 1 else ''})"


def _undecided(n: int, converged: bool, required: bool = True) -> str:
    """The reason a claim cannot be decided before its interval is looked at ("" when it can)."""
    if required and n < MIN_SEEDS:
        return f"fewer than {MIN_SEEDS} seeds" if converged else f"{NOT_CONVERGED}; fewer than {MIN_SEEDS} seeds"
    return "" if converged else NOT_CONVERGED


def order(a: Sequence[float] | Mapping[int, float], b: Sequence[float] | Mapping[int, float], claim: str = "",
          higher: bool = True, converged: bool = True, paper: str = "",
          runs: tuple[Sequence["History"], Sequence["History"]] = (), margin: float | None = MARGIN,
          looks: int = 1, score: str = "") -> Verdict:
    """Judge "a beats b" from paired per-seed results.

    Parameters
    ----------
    a, b : per-seed results of the two sides (sequences in the same seed order, or mappings seed -> value).
    claim : the claim in a short phrase.
    higher : True when the claim is that a is higher than b (accuracy), False when lower (loss, cost).
    converged : whether the runs behind both sides passed the plateau test (see :func:`converged`).
    paper : the paper's figure for the claim, as text.
    runs : the training runs behind a and b, when the values come from runs: their curves are drawn by
        :meth:`Verdicts.curves`.
    margin : the equivalence margin in the unit of a and b (default one accuracy point); None for a
        quantity with no natural margin: the claim is then never decided as "no difference".
    looks : how many times the chapter may look at this claim as it adds seeds (2: at five seeds and again
        up to :data:`SEED_CAP`); each look's interval is widened so the looks together keep the 5% rate.
    score : how the values were scored, when they come from runs (:data:`SCORES`).
    """
    d = _paired(a, b)
    if not d:
        raise ValueError("a claim needs at least one seed")
    if margin is not None and not margin >= 0:
        raise ValueError(f"margin: must be a number >= 0 or None; got {margin!r}")
    common = dict(claim=claim, seeds=len(d), converged=converged, values=tuple(d), paper=paper,
                  runs=tuple(tuple(r) for r in runs), score=score, margin=margin)
    if any(math.isnan(v) for v in d):
        return Verdict(verdict=INCONCLUSIVE, mean=math.nan, stderr=math.nan, reason=DIVERGED, **common)
    mean, se, low, high = _interval(d, look_level(looks))
    reason = _undecided(len(d), converged)
    if reason:
        return Verdict(verdict=INCONCLUSIVE, mean=mean, stderr=se, low=low, high=high, reason=reason, **common)
    outcome = int(_decide(low, high, 1.0 if higher else -1.0, margin))
    verdict, reason = [(HELD, ""), (NOT_HELD, REVERSED), (NOT_HELD, NO_DIFFERENCE), (INCONCLUSIVE, "")][outcome]
    return Verdict(verdict=verdict, mean=mean, stderr=se, low=low, high=high, reason=reason, **common)


def number(values: Sequence[float] | Mapping[int, float], claimed: float, claim: str = "", higher: bool = True,
           converged: bool = True, deterministic: bool = False, comparable: str | bool = True,
           paper: str = "") -> Verdict:
    """Judge a claimed number against our per-seed values.

    Parameters
    ----------
    values : our per-seed values (or one value with ``deterministic``).
    claimed : the paper's number, in the same unit.
    claim : the claim in a short phrase.
    higher : True when higher is better (accuracy, a gain), False for a cost (seconds, bytes, a ratio).
    converged : whether the runs behind the values passed the plateau test.
    deterministic : the values do not vary with the seed (a byte count, an exponent fitted to one sweep):
        judged on their mean, with no interval and no seed requirement.
    comparable : True when the claimed number means the same on our data; else the reason it does not (an
        absolute accuracy on another dataset): the verdict is then *not comparable*, with that reason.
    paper : the paper's figure as text (default: the claimed number).
    """
    v = _values(values)
    v = list(v.values()) if isinstance(v, dict) else v
    if not v:
        raise ValueError("a claim needs at least one value")
    if comparable is not True and not (isinstance(comparable, str) and comparable.strip()):
        raise ValueError("comparable: must be True or the reason the claimed number is not comparable")
    common = dict(claim=claim, seeds=len(v), claimed=float(claimed), converged=converged, values=tuple(v),
                  paper=paper or f"{float(claimed):.3g}")
    if comparable is not True:
        mean, se = _mean_se(v)
        return Verdict(verdict=NOT_COMPARABLE, mean=mean, stderr=se, reason=comparable, **common)
    if any(math.isnan(x) for x in v):
        return Verdict(verdict=INCONCLUSIVE, mean=math.nan, stderr=math.nan, reason=DIVERGED, **common)
    if deterministic:
        mean, se = _mean_se(v)
        low = high = mean
    else:
        mean, se, low, high = _interval(v, LEVEL)
    reason = _undecided(len(v), converged, required=not deterministic)
    if reason:
        return Verdict(verdict=INCONCLUSIVE, mean=mean, stderr=se, low=low, high=high, reason=reason, **common)
    ok = claimed <= high if higher else claimed >= low
    return Verdict(verdict=REACHED if ok else NOT_REACHED, mean=mean, stderr=se, low=low, high=high, **common)


# ------------------------------------------------------------------------------ convergence and scores

def _evaluated(curve: Sequence[float | None] | Mapping[int, float | None]) -> tuple[np.ndarray, np.ndarray]:
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
    rounds, values = _evaluated(curve)
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


def curve(h: "History", metric: str = "mean_client_accuracy") -> dict[int, float]:
    """A run's evaluated rounds: ``{round: metric}``."""
    return {int(r["round"]): float(r[metric]) for r in h.rounds if r.get(metric) is not None}


def _diverged(h: "History", metric: str) -> bool:
    """A run that stopped on a non-finite loss has no final value (None or NaN)."""
    final = h.final.get(metric)
    return final is None or math.isnan(float(final))


def client_scores(h: "History", protocol: str = LAST_FIFTH) -> np.ndarray:
    """Each client's test accuracy under a score protocol (:func:`score`), so that a table per client shows
    what the verdicts judge: the mean of its accuracies over the last fifth of the run's evaluated rounds
    (:data:`LAST_FIFTH`), its accuracy at the evaluated round where the clients' mean was best
    (:data:`BEST_ROUND`), or at the round where its own validation accuracy was best, the first such round
    (:data:`BEST_VALIDATION`, a run with ``validation_monitor``). NaN for every client of a run that diverged."""
    if protocol not in SCORES:
        raise ValueError(f"protocol: unknown value {protocol!r}; allowed: {', '.join(SCORES)}")
    rows = [r for r in h.rounds if r.get("mean_client_accuracy") is not None and r.get("client_accuracy") is not None]
    if protocol == BEST_VALIDATION:
        rows = [r for r in rows if r.get("client_validation_accuracy") is not None]
        if not rows:
            raise ValueError(f"protocol: {BEST_VALIDATION!r} needs a run with validation_monitor > 0; run "
                             f"{h.config.get('algorithm')!r} seed {h.config.get('seed')} has no validation scores")
    if _diverged(h, "mean_client_accuracy") or not rows:
        return np.full(len(h.final.get("client_accuracy") or ()), np.nan)
    test = np.array([r["client_accuracy"] for r in rows], dtype=float)              # (rounds, clients)
    if protocol == BEST_VALIDATION:
        val = np.array([r["client_validation_accuracy"] for r in rows], dtype=float)
        best = np.nanargmax(np.where(np.isnan(val), -np.inf, val), axis=0)           # (clients,)
        return test[best, np.arange(test.shape[1])]
    if protocol == BEST_ROUND:
        return test[int(np.argmax([r["mean_client_accuracy"] for r in rows]))]
    return test[-max(1, math.ceil(len(rows) / 5)):].mean(axis=0)


def score(h: "History", metric: str = "mean_client_accuracy", protocol: str = LAST_FIFTH) -> float:
    """One run's score: the mean of `metric` over the last fifth of its evaluated rounds (at least one), its
    best evaluated round (:data:`BEST_ROUND`), or (:data:`BEST_VALIDATION`, client accuracy only) the mean over
    clients of each client's test accuracy at the evaluated round where its validation accuracy was highest
    (the first such round); NaN for a run that diverged."""
    if protocol not in SCORES:
        raise ValueError(f"protocol: unknown value {protocol!r}; allowed: {', '.join(SCORES)}")
    if _diverged(h, metric):
        return math.nan
    if protocol == BEST_VALIDATION:
        if metric != "mean_client_accuracy":
            raise ValueError(f"metric: the best-validation-round score is a client accuracy; got {metric!r}")
        return float(np.nanmean(client_scores(h, protocol)))
    values = list(curve(h, metric).values())
    if not values:
        return math.nan
    if protocol == BEST_ROUND:
        return float(max(values))
    k = max(1, math.ceil(len(values) / 5))
    return float(np.mean(values[-k:]))


def seed_values(runs: Sequence["History"], metric: str = "mean_client_accuracy",
                protocol: str = LAST_FIFTH) -> dict[int, float]:
    """One run per seed -> ``{seed: the run's score}`` (:func:`score`; NaN where it diverged)."""
    out = {int(h.config["seed"]): score(h, metric, protocol) for h in runs}
    if len(out) != len(runs):
        raise ValueError(f"runs must have one seed each, got seeds {[h.config['seed'] for h in runs]}")
    return out


def truncated(h: "History", last_round: int) -> "History":
    """The run as it stood after `last_round` (its rounds up to it; the whole run if it stopped earlier), to
    judge runs of different lengths at an equal budget (e.g. equal local epochs in all). Its final values are
    those of its last evaluated round kept; the plateau test and the score then apply to the prefix."""
    if last_round < 1:
        raise ValueError(f"last_round must be at least 1, got {last_round}")
    rows = [r for r in h.rounds if r["round"] <= last_round]
    if len(rows) == len(h.rounds):
        return h
    evaluated = [r for r in rows if r.get("mean_client_accuracy") is not None]
    final = {k: v for k, v in (evaluated[-1] if evaluated else {}).items() if k != "round"}
    return dataclasses.replace(h, rounds=rows, final=final, meta={**h.meta, "truncated_at": last_round})


def runs_converged(runs: Sequence["History"], metric: str = "mean_client_accuracy") -> bool:
    """Whether every run's curve of `metric` passes the plateau test (:func:`plateaued`)."""
    return bool(runs) and all(plateaued(curve(h, metric)) for h in runs)


def beats(a: Sequence["History"], b: Sequence["History"], claim: str = "", metric: str = "mean_client_accuracy",
          higher: bool = True, paper: str = "", protocol: str = LAST_FIFTH, margin: float | None = MARGIN,
          looks: int = 1) -> Verdict:
    """:func:`order` on two methods' runs (one per seed, the same seeds), each scored by `protocol`;
    inconclusive (not converged) unless every run of both sides passes the plateau test."""
    return order(seed_values(a, metric, protocol), seed_values(b, metric, protocol), claim, higher,
                 runs_converged(a, metric) and runs_converged(b, metric), paper, runs=(a, b), margin=margin,
                 looks=looks, score=protocol)


def ranking(groups: Mapping[str, Sequence["History"]], setting: str = "", metric: str = "mean_client_accuracy",
            protocol: str = LAST_FIFTH) -> tuple["pd.DataFrame", list[Verdict]]:
    """Methods ranked by their mean score over seeds, and the rule's verdict on each step of the ranking.

    `groups` maps a method's name to its runs (one per seed, the same seeds for every method). Each run is
    scored by `protocol` (:func:`score`); a method's row gives its mean, the 95% interval of that mean over
    the seeds (``low``, ``high``), how many of its runs converged (``converged``, of ``seeds``), and the
    verdict on "it beats the method ranked next" with its evidence (:func:`beats`, so inconclusive unless
    both sides converged with at least :data:`MIN_SEEDS` seeds). A method whose runs diverged ranks last.
    Returns (the table, the verdicts of the steps, top first); a claim reads "`setting`: A beats B".
    """
    import pandas as pd

    values = {name: seed_values(runs, metric, protocol) for name, runs in groups.items()}
    means = {name: float(np.mean(list(v.values()))) for name, v in values.items()}
    order_ = sorted(groups, key=lambda name: (math.isnan(means[name]), -means[name] if not math.isnan(means[name])
                                              else 0.0))
    steps, rows = [], []
    for i, name in enumerate(order_):
        mean, _, low, high = _interval(list(values[name].values()), LEVEL)
        n_conv = sum(plateaued(curve(h, metric)) for h in groups[name])
        step = None
        if i + 1 < len(order_):
            below = order_[i + 1]
            step = beats(groups[name], groups[below], f"{setting + ': ' if setting else ''}{name} beats {below}",
                         metric, protocol=protocol)
            steps.append(step)
        rows.append({"rank": i + 1, "method": name, "mean": mean, "low": low, "high": high,
                     "converged": n_conv, "seeds": len(groups[name]),
                     "beats the next?": step.label if step else "—", "by": step.evidence if step else "—"})
    return pd.DataFrame(rows), steps


def ahead_over_rounds(a: Sequence["History"], b: Sequence["History"], claim: str = "",
                      metric: str = "mean_client_accuracy", paper: str = "", margin: float | None = MARGIN) -> Verdict:
    """:func:`order` on "a is ahead of b over the rounds" (a claim about curves, e.g. "converges faster" or
    "ahead at every round"): per seed, the mean of a - b over the rounds both runs evaluated, the area
    between the curves per round. Not the smallest lead, which one noisy round decides."""
    by_seed = {int(h.config["seed"]): h for h in b}
    lead = {}
    for h in a:
        seed = int(h.config["seed"])
        ca, cb = curve(h, metric), curve(by_seed[seed], metric)
        common = sorted(set(ca) & set(cb))
        diverged = any(_diverged(x, metric) for x in (h, by_seed[seed]))
        lead[seed] = math.nan if diverged or not common else float(np.mean([ca[r] - cb[r] for r in common]))
    return order(lead, {s: 0.0 for s in lead}, claim, True, runs_converged(a, metric) and runs_converged(b, metric),
                 paper, runs=(a, b), margin=margin, score="mean difference over the evaluated rounds")


# ------------------------------------------------------------------------------ the rule's error rates

@functools.lru_cache(maxsize=32)
def error_rates(effect: float = 0.0, seeds: int = MIN_SEEDS, sd: float = NOISE_SD, margin: float | None = MARGIN,
                looks: int = 1, noise: str = "normal", simulations: int = SIMULATIONS, seed: int = 0
                ) -> dict[str, float]:
    """How often the rule decides each way, by simulation of claims "A beats B" with a true mean difference
    `effect`.

    Parameters
    ----------
    effect : the true mean of d (0: no difference).
    seeds : the seeds of the first look.
    sd : the spread of d between seeds (:data:`NOISE_SD`: that of our converged runs).
    margin : the equivalence margin.
    looks : 1: one look at `seeds`; 2: a second look at :data:`SEED_CAP` seeds for claims the first left
        undecided, both at the widened level of :func:`look_level`.
    noise : "normal", or "heavy" for Student-t noise with 3 degrees of freedom scaled to the same spread
        (runs that now and then land far off).

    Returns ``{"held", "reversed", "no difference", "inconclusive"}`` shares, summing to one.
    """
    if noise not in ("normal", "heavy"):
        raise ValueError(f"noise: unknown value {noise!r}; allowed: normal, heavy")
    rng = np.random.default_rng(seed)
    n_max = SEED_CAP if looks > 1 else seeds
    if noise == "normal":
        draws = rng.standard_normal((simulations, n_max))
    else:
        draws = rng.standard_t(3, (simulations, n_max)) / math.sqrt(3)  # t(3) has variance 3
    d = effect + sd * draws
    level = look_level(looks)
    outcome = np.full(simulations, 3)
    for n in ((seeds, SEED_CAP) if looks > 1 else (seeds,)):
        open_ = outcome == 3
        x = d[open_, :n]
        mean, se = x.mean(1), x.std(1, ddof=1) / math.sqrt(n)
        half = _t_quantile(level, n - 1) * se
        outcome[open_] = _decide(mean - half, mean + half, 1.0, margin)
    shares = np.bincount(outcome, minlength=4) / simulations
    return dict(zip(("held", "reversed", "no difference", "inconclusive"), map(float, shares)))


@functools.lru_cache(maxsize=1)
def rule() -> str:
    """The rule as the book prints it, with its error rates computed by :func:`error_rates`."""
    null, power = error_rates(0.0), error_rates(2 * NOISE_SD)
    null2, power2 = error_rates(0.0, looks=2), error_rates(2 * NOISE_SD, looks=2)
    heavy = error_rates(0.0, noise="heavy")
    small = error_rates(0.0, sd=NOISE_SD / 4)
    pct = lambda x: f"{100 * x:.1f}%"
    return (
        f"**How a verdict is computed.** Each run is scored at convergence: the mean accuracy over the last fifth "
        f"of its evaluated rounds (a paper's own protocol where it states one, named with the verdict). A run "
        f"has converged when a line fitted to the last third of its evaluated rounds (at least "
        f"{MIN_EVALUATIONS} evaluations) moves by at most {100 * PLATEAU_RISE:.0f} point over that span. The "
        f"test bounds the rise over that span only, which early in a run is a few evaluations: a curve still "
        f"rising slowly can pass it on a flat stretch, so a run it stopped early may have had more to gain (a "
        f"known limit of the test). An "
        f"ordering claim (\"A beats B\") is judged on the paired per-seed differences d = A − B of the scores, by "
        f"the {LEVEL:.0%} Student-t interval of their mean: *held* if the interval lies wholly on the claimed side "
        f"of zero; *not held (reversed)* if wholly on the other side; *not held (no difference)* if wholly within "
        f"±{100 * MARGIN:.0f} accuracy point, a difference below the sampling error of an accuracy on our test "
        f"sets (about 1.3 points at 0.8 on 1,000 images); *inconclusive* otherwise, and always with fewer than "
        f"{MIN_SEEDS} seeds or when any run behind the claim has not converged (the reason is printed). "
        f"A claimed number is *reached* if it lies within our {LEVEL:.0%} interval or on its worse side, under "
        f"the same conditions; an absolute number from another dataset is *not comparable*. "
        f"**Error rates, simulated** ({SIMULATIONS:,} claims each, per-seed spread of d {100 * NOISE_SD:.0f} "
        f"point, {MIN_SEEDS} seeds): with no real difference the rule says *held* {pct(null['held'])} of the "
        f"time and *not held (reversed)* {pct(null['reversed'])}; with a real difference of two standard "
        f"deviations it says *held* {pct(power['held'])} of the time (its power). With heavy-tailed noise (t, 3 "
        f"degrees of freedom) the false *held* rate is {pct(heavy['held'])}. *No difference* needs a spread "
        f"well below the margin: at {100 * NOISE_SD:.0f} point it is decided {pct(null['no difference'])} of "
        f"the time under no difference, at {100 * NOISE_SD / 4:.2f} point {pct(small['no difference'])}. "
        f"A chapter may add seeds to an undecided claim, up to {SEED_CAP}, with a {look_level(2):.1%} interval "
        f"at each of the two looks: false *held* then {pct(null2['held'])} and false *reversed* "
        f"{pct(null2['reversed'])}, power {pct(power2['held'])}."
    )


# ------------------------------------------------------------------------------ a chapter's verdicts

@dataclass
class Verdicts:
    """The verdicts a chapter makes, in order: ``add`` one, then print, count or tabulate them."""

    items: list[Verdict] = field(default_factory=list)

    def add(self, verdict: Verdict) -> Verdict:
        self.items.append(verdict)
        return verdict

    def extend(self, verdicts: Iterable[Verdict]) -> None:
        self.items.extend(verdicts)

    def count(self, label: str | None = None) -> int:
        """How many verdicts, or how many with this outcome ("held"), category or full label ("not held
        (reversed)")."""
        return sum(1 for v in self.items if label is None or label in (v.verdict, v.category, v.label))

    def summary(self) -> str:
        """E.g. "12 verdicts: 3 held, 2 not held (reversed), 7 inconclusive (not converged)", by category."""
        labels = [v.category for v in self.items]
        order_ = {label: i for i, label in enumerate(OUTCOMES)}
        counts: dict[str, int] = {}
        for label in sorted(labels, key=lambda x: (order_.get(x, len(OUTCOMES)), x)):
            counts[label] = counts.get(label, 0) + 1
        parts = ", ".join(f"{n} {k}" for k, n in counts.items())
        return f"{len(self.items)} verdict{'s' if len(self.items) != 1 else ''}" + (f": {parts}" if parts else "")

    def findings(self) -> str:
        """What a page found, in Markdown, for its opening: how many claims the rule decided (a claim on
        training runs only when they converged, with at least :data:`MIN_SEEDS` seeds; a deterministic count
        or cost on its measurement), each decided claim with its outcome and our number, and the undecided
        ones counted by why."""
        decided = [v for v in self.items if v.decided]
        n = len(self.items)
        lines = [f"**What we found.** The rule decided {len(decided)} of the {n} claim{'s' if n != 1 else ''} "
                 f"judged on this page" + (f" (a claim on training runs only when they converged, with at least "
                                           f"{MIN_SEEDS} seeds):" if decided else ".")]
        if decided:
            lines += [""] + [f"- *{v.label}*: {v.claim} ({v.evidence})" for v in decided]
        undecided = Verdicts([v for v in self.items if not v.decided])
        if undecided.items:
            lines += ["", f"Undecided: {undecided.summary().partition(': ')[2]}."]
        return "\n".join(lines)

    def curves(self, metric: str = "mean_client_accuracy", ncols: int = 3, names: tuple[str, str] = ("A", "B")):
        """The accuracy curves behind every verdict judged on training runs: one panel per verdict, the claimed
        better side (solid) and the other (dashed), mean over seeds with a min-max band (where runs stopped at
        different rounds: over the seeds evaluated at that round); the panel's title is the claim and its
        verdict. Returns the figure, or None when no verdict carries runs."""
        import textwrap

        import matplotlib.pyplot as plt
        import pandas as pd

        shown = [(i, v) for i, v in enumerate(self.items, 1) if v.runs]
        if not shown:
            return None
        nrows = -(-len(shown) // ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), layout="constrained",
                                 squeeze=False)
        for ax, (i, v) in zip(axes.flat, shown):
            for runs, name, style in zip(v.runs, names, ("-", "--")):
                # rounds x seeds; a run that stopped once converged leaves NaN after its last round, and the
                # mean and band are over the seeds still running
                values = pd.DataFrame({k: pd.Series(curve(h, metric)) for k, h in enumerate(runs)}).sort_index()
                (line,) = ax.plot(values.index, values.mean(axis=1), style, marker=".", label=name)
                ax.fill_between(values.index, values.min(axis=1), values.max(axis=1), color=line.get_color(),
                                alpha=0.2, linewidth=0)
            ax.set_title(textwrap.fill(f"{i}. {v.claim}", 44) + f"\n{v.label}", fontsize=8)
            ax.set_xlabel("round", fontsize=8)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(shown):]:
            ax.set_visible(False)
        fig.supylabel(metric.replace("_", " "), fontsize=9)
        return fig

    def table(self) -> "pd.DataFrame":
        """One row per verdict: its number (the panel of :meth:`curves`), the claim, the paper's figure, ours,
        the verdict."""
        import pandas as pd
        return pd.DataFrame({"#": range(1, len(self.items) + 1), "claim": [v.claim for v in self.items],
                             "paper": [v.paper for v in self.items], "ours": [v.evidence for v in self.items],
                             "verdict": [v.label for v in self.items]})
