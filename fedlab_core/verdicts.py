"""Verdicts on a paper's claims, computed from per-seed results by one written rule.

Every verdict in the book comes from this module; none is typed by hand. There are two kinds of claim.

An **ordering claim** ("A beats B", "A scales better than B") is judged on the paired per-seed
differences ``d = A - B`` (the same seeds, so the same splits and initialisations), in this order:

1. *inconclusive* if there are fewer than :data:`MIN_SEEDS` seeds, or ``|mean d|`` is within one standard
   error of ``d`` (``std(d) / sqrt(n)``, sample standard deviation);
2. *held* if every seed's ``d`` lies in the claimed direction;
3. *partly held* if the mean does but not every seed;
4. *not held* if the mean goes the other way.

A **claimed number** ("99% of the gap removed", "+11.2 points", "1.2% overhead") is reported beside our
mean and its 95% Student-t interval over seeds, and judged *reached* if the claimed value lies within the
interval or on its worse side (below it for a quantity where higher is better, above it for a cost), *not
reached* otherwise; with fewer than :data:`MIN_SEEDS` seeds it is *inconclusive*. A measured cost ratio is
a claimed number whose better side is lower. A deterministic measurement (a byte count, a fitted exponent)
is judged with ``deterministic=True``: one value, no interval, reached when it is on the claimed side.

A verdict whose runs have not converged (:func:`converged`: the mean accuracy over seeds rose by more than
:data:`CONVERGED_RISE` over the last fifth of rounds) carries "(not converged)": the claim was judged on
runs that were still learning.

With many three-seed comparisons, some will read *held* by chance alone: with three seeds and no real
difference, all three differences fall on the claimed side one time in four. :class:`Verdicts` counts
the verdicts a chapter makes so the chapter can say so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    import pandas as pd

    from .runs import History

MIN_SEEDS = 3            # a verdict stands on at least this many seeds
CONVERGED_RISE = 0.01    # a rise in mean accuracy over the last fifth of rounds above this: not converged
LEVEL = 0.95             # the interval beside a claimed number

ORDER_VERDICTS = ("held", "partly held", "not held", "inconclusive")
NUMBER_VERDICTS = ("reached", "not reached", "inconclusive")

RULE = (
    "**How a verdict is computed.** An ordering claim (\"A beats B\") is judged on the paired per-seed "
    "differences d = A − B (same seeds, same splits): *inconclusive* if fewer than {seeds} seeds or |mean d| "
    "is within one standard error of d; *held* if every seed's d is in the claimed direction; *partly held* if "
    "the mean is but not every seed; *not held* if the mean goes the other way. A claimed number is shown "
    "beside our mean and {level:.0%} interval and is *reached* if the claimed value lies within the interval or "
    "on its worse side. A verdict on runs whose mean accuracy still rose by more than {rise:.0f} point over the "
    "last fifth of rounds is marked *(not converged)*. With three seeds and no real difference, a comparison "
    "reads *held* one time in four by chance, so among many verdicts a few *held* are expected by chance."
).format(seeds=MIN_SEEDS, level=LEVEL, rise=CONVERGED_RISE * 100)


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


@dataclass(frozen=True)
class Verdict:
    """One judged claim.

    Attributes
    ----------
    claim : the claim in a short phrase.
    verdict : one of :data:`ORDER_VERDICTS` or :data:`NUMBER_VERDICTS`.
    mean : the mean paired difference (ordering) or our mean value (number).
    stderr : its standard error over seeds (NaN with one value).
    seeds : how many seeds it stands on.
    low, high : our 95% interval (numbers; NaN for orderings).
    claimed : the paper's number (numbers; None for orderings).
    converged : False when the runs behind it were still learning.
    values : the per-seed differences or values it was computed from.
    paper : the paper's figure for the claim, as text (e.g. "+0.189 on CIFAR-10"), for the tables.
    runs : for a claim judged on training runs, the runs of each side (claimed better first, one per seed),
        whose curves :meth:`Verdicts.curves` draws; empty otherwise.
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

    @property
    def label(self) -> str:
        """The verdict as printed: e.g. "held", "not reached (not converged)", "inconclusive (a run diverged)"."""
        if self.diverged:
            return self.verdict + " (a run diverged)"
        return self.verdict + ("" if self.converged else " (not converged)")

    @property
    def evidence(self) -> str:
        """Our numbers in one phrase: "d = +0.012 ± 0.004 (3 seeds)" or "0.91 [0.88, 0.94] (3 seeds)"."""
        seeds = f"{self.seeds} seed{'s' if self.seeds != 1 else ''}"
        if self.diverged:
            return f"{seeds}, a run diverged"
        if self.claimed is None:
            spread = "" if math.isnan(self.stderr) else f" ± {self.stderr:.3f}"
            return f"d = {self.mean:+.3f}{spread} ({seeds})"
        interval = "" if math.isnan(self.low) else f" [{self.low:.3g}, {self.high:.3g}]"
        return f"{self.mean:.3g}{interval} ({seeds}), claimed {self.claimed:.3g}"

    def __str__(self) -> str:
        return f"{self.label}: {self.evidence}"

    @property
    def diverged(self) -> bool:
        return any(math.isnan(v) for v in self.values)


def order(a: Sequence[float] | Mapping[int, float], b: Sequence[float] | Mapping[int, float], claim: str = "",
          higher: bool = True, converged: bool = True, paper: str = "",
          runs: tuple[Sequence["History"], Sequence["History"]] = ()) -> Verdict:
    """Judge "a beats b" from paired per-seed results.

    Parameters
    ----------
    a, b : per-seed results of the two sides (sequences in the same seed order, or mappings seed -> value).
    claim : the claim in a short phrase.
    higher : True when the claim is that a is higher than b (accuracy), False when lower (loss, cost).
    converged : whether the runs behind both sides converged (see :func:`converged`).
    paper : the paper's figure for the claim, as text.
    runs : the training runs behind a and b, when the values come from runs: their curves are drawn by
        :meth:`Verdicts.curves`.

    A NaN result (a run that diverged) makes the verdict *inconclusive*, labelled "(a run diverged)".
    """
    d = _paired(a, b)
    if not d:
        raise ValueError("a claim needs at least one seed")
    if any(math.isnan(v) for v in d):
        return Verdict(claim, "inconclusive", math.nan, math.nan, len(d), converged=converged, values=tuple(d),
                       paper=paper, runs=tuple(tuple(r) for r in runs))
    mean, se = _mean_se(d)
    sign = 1.0 if higher else -1.0
    if len(d) < MIN_SEEDS or abs(mean) <= se:
        verdict = "inconclusive"
    elif all(sign * v > 0 for v in d):
        verdict = "held"
    elif sign * mean > 0:
        verdict = "partly held"
    else:
        verdict = "not held"
    return Verdict(claim, verdict, mean, se, len(d), converged=converged, values=tuple(d), paper=paper,
                   runs=tuple(tuple(r) for r in runs))


def _t_quantile(level: float, dof: int) -> float:
    from scipy import stats
    return float(stats.t.ppf(0.5 + level / 2, dof))


def number(values: Sequence[float] | Mapping[int, float], claimed: float, claim: str = "", higher: bool = True,
           converged: bool = True, deterministic: bool = False) -> Verdict:
    """Judge a claimed number against our per-seed values.

    Parameters
    ----------
    values : our per-seed values (or one value with ``deterministic``).
    claimed : the paper's number, in the same unit.
    claim : the claim in a short phrase.
    higher : True when higher is better (accuracy, a gain), False for a cost (seconds, bytes, a ratio).
    converged : whether the runs behind the values converged.
    deterministic : the values do not vary with the seed (a byte count, an exponent fitted to one sweep):
        judged on their mean, with no interval and no seed requirement.
    """
    v = _values(values)
    v = list(v.values()) if isinstance(v, dict) else v
    if not v:
        raise ValueError("a claim needs at least one value")
    if any(math.isnan(x) for x in v):
        return Verdict(claim, "inconclusive", math.nan, math.nan, len(v), claimed=float(claimed),
                       converged=converged, values=tuple(v), paper=f"{float(claimed):.3g}")
    mean, se = _mean_se(v)
    if deterministic:
        low = high = mean
    elif len(v) >= 2:
        half = _t_quantile(LEVEL, len(v) - 1) * se
        low, high = mean - half, mean + half
    else:
        low = high = math.nan
    if not deterministic and len(v) < MIN_SEEDS:
        verdict = "inconclusive"
    else:
        ok = claimed <= high if higher else claimed >= low
        verdict = "reached" if ok else "not reached"
    return Verdict(claim, verdict, mean, se, len(v), low, high, float(claimed), converged, tuple(v),
                   f"{float(claimed):.3g}")


def converged(curves: Sequence[Sequence[float]] | Sequence[float], rise: float = CONVERGED_RISE) -> bool:
    """Whether accuracy curves have flattened: the mean over seeds rose by at most ``rise`` over the last
    fifth of rounds (at least one round).

    Parameters
    ----------
    curves : one accuracy curve (per round) or one per seed (all of the same length); None entries (rounds
        without an evaluation) are skipped.
    """
    import numpy as np
    a = np.asarray(curves, dtype=float)  # None -> NaN
    a = a[None] if a.ndim == 1 else a    # (seeds, rounds)
    mean = a[:, ~np.isnan(a).all(0)].mean(0)  # evaluated rounds only
    if len(mean) < 2:
        return False  # one evaluated round shows nothing about flattening
    k = max(1, round(len(mean) / 5))
    return bool(mean[-1] - mean[-1 - k] <= rise)


# ------------------------------------------------------------------------------ from runs

def seed_values(runs: Sequence["History"], metric: str = "mean_client_accuracy") -> dict[int, float]:
    """One run per seed -> ``{seed: the run's final value of metric}`` (NaN where it diverged)."""
    out = {}
    for h in runs:
        value = h.final.get(metric)
        out[int(h.config["seed"])] = math.nan if value is None else float(value)
    if len(out) != len(runs):
        raise ValueError(f"runs must have one seed each, got seeds {[h.config['seed'] for h in runs]}")
    return out


def runs_converged(runs: Sequence["History"], metric: str = "mean_client_accuracy") -> bool:
    """:func:`converged` on the runs' per-round curves of metric (one run per seed)."""
    return converged([[r.get(metric) for r in h.rounds] for h in runs])


def beats(a: Sequence["History"], b: Sequence["History"], claim: str = "", metric: str = "mean_client_accuracy",
          higher: bool = True, paper: str = "") -> Verdict:
    """:func:`order` on two methods' runs (one per seed, the same seeds), judged on the final `metric`,
    marked "(not converged)" unless both sides' curves flattened."""
    return order(seed_values(a, metric), seed_values(b, metric), claim, higher,
                 runs_converged(a, metric) and runs_converged(b, metric), paper, runs=(a, b))


def ahead_throughout(a: Sequence["History"], b: Sequence["History"], claim: str = "",
                     metric: str = "mean_client_accuracy", paper: str = "") -> Verdict:
    """:func:`order` on "a is ahead of b at every evaluated round" (a convergence claim): per seed, the
    smallest difference a - b over the rounds both runs evaluated, against zero; held when that lead is
    positive for every seed."""
    def curve(h: "History") -> dict[int, float]:
        return {r["round"]: float(r[metric]) for r in h.rounds if r.get(metric) is not None}

    by_seed = {int(h.config["seed"]): h for h in b}
    lead = {}
    for h in a:
        seed = int(h.config["seed"])
        ca, cb = curve(h), curve(by_seed[seed])
        common = sorted(set(ca) & set(cb))
        lead[seed] = min(ca[r] - cb[r] for r in common) if common else math.nan
    return order(lead, {s: 0.0 for s in lead}, claim, True, runs_converged(a, metric) and runs_converged(b, metric),
                 paper, runs=(a, b))


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
        """How many verdicts, or how many with this verdict (e.g. "held")."""
        return sum(1 for v in self.items if label is None or v.verdict == label)

    def summary(self) -> str:
        """E.g. "12 verdicts: 3 held, 2 partly held, 5 not held, 2 inconclusive"."""
        counts = {k: self.count(k) for k in dict.fromkeys(ORDER_VERDICTS + NUMBER_VERDICTS)}
        parts = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
        return f"{len(self.items)} verdict{'s' if len(self.items) != 1 else ''}" + (f": {parts}" if parts else "")

    def curves(self, metric: str = "mean_client_accuracy", ncols: int = 3, names: tuple[str, str] = ("A", "B")):
        """The accuracy curves behind every verdict judged on training runs: one panel per verdict, the claimed
        better side (solid) and the other (dashed), mean over seeds with a min-max band; the panel's title is
        the claim and its verdict. Returns the figure, or None when no verdict carries runs."""
        import textwrap

        import matplotlib.pyplot as plt
        import numpy as np

        shown = [(i, v) for i, v in enumerate(self.items, 1) if v.runs]
        if not shown:
            return None
        nrows = -(-len(shown) // ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), layout="constrained",
                                 squeeze=False)
        for ax, (i, v) in zip(axes.flat, shown):
            for runs, name, style in zip(v.runs, names, ("-", "--")):
                rounds = [r["round"] for r in runs[0].rounds if r.get(metric) is not None]
                values = np.array([[r[metric] for r in h.rounds if r.get(metric) is not None] for h in runs],
                                  dtype=float)  # (seeds, evaluated rounds)
                (line,) = ax.plot(rounds, values.mean(0), style, marker=".", label=name)
                ax.fill_between(rounds, values.min(0), values.max(0), color=line.get_color(), alpha=0.2, linewidth=0)
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
        return pd.DataFrame({"#": range(1, len(self.items) + 1), "claim": [v.claim for v in self.items], "paper": [v.paper for v in self.items],
                             "ours": [v.evidence for v in self.items], "verdict": [v.label for v in self.items]})
