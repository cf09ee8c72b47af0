"""Verdicts on a paper's claims, computed from per-seed scores by one written rule with a stated error rate.

Every verdict in the book comes from this module; none is typed by hand.

**The score.** A run is scored at convergence, not on its last noisy round: by default the mean of the
metric over the last fifth of its evaluated rounds (:data:`LAST_FIFTH`); a paper's own protocol where it
states one, named in the verdict (:data:`BEST_ROUND`: the best evaluated round, DisTrans's Tables 5-6;
:data:`BEST_VALIDATION`: each client's test accuracy at its best round on a validation set held out of its
training data, FRAug's authors' code, for runs with ``RunConfig.validation_monitor``).

**The convergence test** (:func:`plateaued`, in :mod:`fedlab_core.convergence`): a line fitted by least
squares to the last third of the evaluated rounds rises or falls by at most :data:`PLATEAU_RISE` over that
span. A claim's side is tested on the mean of its runs' curves over the seeds (:func:`converged`; runs that
stopped at different rounds have no mean curve, and each must pass), since the verdict reads that mean: at our
curves' noise a single seed's fitted rise is uncertain by about as much as the tolerance, so a flat run fails
the test about one time in four, and the mean of five by well under half a point. It reads the clients'
accuracy on the validation share a run holds out of their training data (``RunConfig.validation_monitor``),
when the run has one, so the test set decides nothing but the score. A verdict on a side that fails it is
*inconclusive (not converged)*. The engine can stop a run as soon as
it passes (``RunConfig.stop_at_plateau``), with ``num_rounds`` as the cap.

**Degenerate runs** (:func:`degenerate`): a run that converged can still have learned nothing (near
chance, a constant answer per client, predictions blind to the input, a collapse from its peak). A verdict
resting on one is *inconclusive (degenerate: which run, why)*; so is one whose two arms were computed by
different code (*inconclusive (arms from different code)*: other pinned kernels, or, for runs computed before the
kernels were recorded, another code version), one resting on a run that stopped when
its *test* curve flattened (*stopped on the test curve*: the stop read the numbers it is judged on), and one
whose two arms trained for different numbers of rounds on a seed (*unequal budgets*; a run a chapter
truncated on purpose, :func:`truncated`, states its budget and a run that diverged has none).

**An ordering claim** ("A beats B") is judged on the paired per-seed differences ``d = A - B`` of the
scores (the same seeds: the same splits and initialisations), by the 95% Student-t interval of mean d:

- *held* when the interval lies wholly on the claimed side of zero;
- *not held (reversed)* when it lies wholly on the other side;
- *not held (no difference)* when it lies wholly inside the equivalence margin of the claim's quantity
  (:data:`QUANTITIES`: one point for accuracies; none for a loss gap);
- *inconclusive* otherwise, and always with fewer than :data:`MIN_SEEDS` seeds, with runs that have not
  converged or are degenerate, or with a run that diverged (the reason is printed with it).

"A beats every other" (:func:`beats_every`) is held only if A beats each rival (an intersection-union
test) and reversed only from intervals widened over the rivals (Bonferroni), never against a rival picked
by its mean on the same runs. A rival whose runs cannot decide (not converged, degenerate, other code) leaves
*held* undecided, but not a reversal that the other rivals show when A's own runs can decide.

Under no difference the interval misses zero on each side with probability 2.5%, so a false *held* and a
false *not held (reversed)* each happen at most 2.5% of the time; :func:`error_rates` measures it by
simulation, and the power against a real difference, and :func:`rule` prints both at a given spread. A
chapter may add seeds to an undecided claim, up to :data:`SEED_CAP`, by declaring two looks (``looks=2``):
each look then uses a 97.5% interval (Bonferroni). A claim so planned that its first look decided but Holm's
adjustment (below) did not gets the second look too (:meth:`Verdicts.second_looks`); its p counts both looks,
so the family keeps its rate (:func:`family_error_rates`).

**A claimed number** ("+11.2 points", "a 1.2% overhead") is judged only where it is comparable on our data.
With the quantity's tolerance t it is *reached* only if our interval's worse bound clears the claim less t,
*not reached* only if the whole interval misses the claim, and *inconclusive (consistent, undecided)*
otherwise. A number from another dataset, or one counting something else (a file size against tensor
bytes), is *not comparable*, with the reason. A deterministic measurement (a byte count, a fitted exponent)
is judged with ``deterministic=True``: one value, no interval, no family.

**Families** (:func:`holm`, applied by :class:`Verdicts`): the claims of one table or figure of a paper (the
source their claim starts with) form a family, the book's own claims on a page another; a decision stands
only if its Holm-adjusted p is below :data:`ALPHA`, else it is *inconclusive (multiplicity)*.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import numpy as np

from .convergence import MIN_EVALUATIONS, PLATEAU_RISE, VALIDATION, converged, last_fifth, metric_curve, plateau_rise, plateaued  # noqa: F401

if TYPE_CHECKING:
    import pandas as pd

    from .store import History

MIN_SEEDS = 5            # a decision stands on at least this many seeds
SEED_CAP = 10            # the most seeds a chapter may add to an undecided claim (a second look)
LEVEL = 0.95             # the interval that decides, over all looks together
ALPHA = 1 - LEVEL        # the error rate of one decision, and of a family of them after Holm's adjustment
MARGIN = 0.01            # the equivalence margin for accuracies: one point (see rule())
NOISE_SD = 0.025         # the median spread of paired per-seed differences over the book's accuracy claims
SIMULATIONS = 20_000     # simulated claims per rate printed by rule()
CHANCE_MARGIN = 0.02     # a run scoring within this of chance (one over the classes) learned nothing
COLLAPSE = 0.10          # a run whose score ends this far below its peak has collapsed
BLIND_SHARE = 0.9        # a model whose predictions stay this often the same on noise ignores its input


@dataclass(frozen=True)
class Quantity:
    """What a claim measures, and the two widths the rule needs for it: the equivalence margin of an
    ordering (None: never decided "no difference") and the tolerance of a claimed number (ours may be this
    much worse than the claim and still reach it)."""

    name: str
    margin: float | None
    tolerance: float
    unit: str


QUANTITIES = {q.name: q for q in (
    Quantity("accuracy", MARGIN, 0.01, "accuracy point"),        # below the sampling error of a test accuracy
    Quantity("silhouette", 0.02, 0.02, "silhouette"),              # on [-1, 1]
    Quantity("exponent", 0.05, 0.05, "exponent"),                  # a fitted power law's exponent
    Quantity("loss", None, 0.0, "loss"),                           # a gap between losses: no natural width
    Quantity("ratio", None, 0.05, "ratio"),                        # a cost ratio, 5% of it
    Quantity("count", None, 0.0, "count"),                         # bytes, parameters: exact
)}

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
DEGENERATE, MULTIPLICITY, CONSISTENT = "degenerate", "multiplicity", "consistent, undecided"
DIFFERENT_CODE = "arms from different code"
TEST_STOPPED, UNEQUAL_BUDGETS = "stopped on the test curve", "unequal budgets"
# the reasons a count groups by their first words (the rest of the reason says which run, which p)
GROUPED = (NOT_CONVERGED, DEGENERATE, MULTIPLICITY, DIFFERENT_CODE, TEST_STOPPED, UNEQUAL_BUDGETS)
# every label a verdict can print, in the order tables and charts list them
OUTCOMES = (HELD, REACHED, f"{NOT_HELD} ({REVERSED})", f"{NOT_HELD} ({NO_DIFFERENCE})", NOT_REACHED,
            f"{INCONCLUSIVE} ({MULTIPLICITY})", f"{INCONCLUSIVE} ({CONSISTENT})", f"{INCONCLUSIVE} ({DEGENERATE})",
            f"{INCONCLUSIVE} ({NOT_CONVERGED})", f"{INCONCLUSIVE} ({DIFFERENT_CODE})",
            f"{INCONCLUSIVE} ({TEST_STOPPED})", f"{INCONCLUSIVE} ({UNEQUAL_BUDGETS})",
            f"{INCONCLUSIVE} (fewer than {MIN_SEEDS} seeds)", INCONCLUSIVE,
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


def _sf(t: float, dof: int) -> float:
    """P(T > t) for Student's t with `dof` degrees of freedom."""
    from scipy import stats
    return float(stats.t.sf(t, dof))


def _p_beyond(mean: float, se: float, n: int, bound: float, above: bool) -> float:
    """The two-sided-equivalent p-value of "the mean lies above `bound`" (below with ``above`` False): the
    interval at level L lies wholly on that side of `bound` exactly when this p is below 1 - L."""
    if n < 2 or not se > 0:
        return 0.0 if (mean > bound if above else mean < bound) else 1.0
    t = (mean - bound) / se if above else (bound - mean) / se
    return min(1.0, 2 * _sf(t, n - 1))


def family_of(claim: str) -> str:
    """The family a claim is adjusted with: the paper's table or figure its claim starts with ("Table 1",
    "Fig. 2a", "Sec. 6", "Appendix Table 3"), else the book's own claims (:data:`BEYOND_THE_PAPER`)."""
    m = _SOURCE.match(claim or "")
    return m.group(1) if m else BEYOND_THE_PAPER


BEYOND_THE_PAPER = "the book's own claims"
_SOURCE = re.compile(r"^((?:Appendix )?(?:Table|Fig\.|Sec\.|Eq\.) ?[0-9]+[a-z]?)\b")


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
    reason : why a claim is not held (reversed, no difference) or undecided (not converged, degenerate, too
        few seeds, a run diverged, not significant after Holm's adjustment), or why a number is not
        comparable; printed in brackets after the outcome.
    score : how each run was scored (:data:`SCORES`), for claims judged on runs.
    margin : the equivalence margin of an ordering claim (None: no "no difference" decision).
    quantity : what the claim measures (a key of :data:`QUANTITIES`).
    p : the p-value of the decision the interval made (that of the nearest decision when it made none; NaN
        when the claim could not be tested: too few seeds, not converged, degenerate, a measurement).
    family : the family of claims it is adjusted with (:func:`family_of`).
    adjusted_p : its Holm-adjusted p within the family (NaN until :class:`Verdicts` adjusts it).
    family_size : how many tested claims the family holds (0 until adjusted).
    unadjusted : the verdict before Holm's adjustment (None: not adjusted).
    more : the second look not yet taken at a claim planned with two looks that its first look decided: a call
        that adds seeds and judges it again (:func:`fedlab_core.sweeps.second_look`), which
        :meth:`Verdicts.second_looks` makes when Holm's adjustment undoes the decision; None otherwise.
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
    quantity: str = "accuracy"
    p: float = math.nan
    family: str = ""
    adjusted_p: float = math.nan
    family_size: int = 0
    unadjusted: "Verdict | None" = field(default=None, compare=False, repr=False)
    more: "Callable[[], Verdict] | None" = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        """The verdict as printed: "held", "not held (reversed)", "inconclusive (not converged)", ..."""
        return self.verdict + (f" ({self.reason})" if self.reason else "")

    @property
    def category(self) -> str:
        """The label a count groups by (one of :data:`OUTCOMES`): the label, with a not comparable number's
        own reason left out and the reasons of :data:`GROUPED` by their first words."""
        if self.verdict == NOT_COMPARABLE:
            return NOT_COMPARABLE
        for reason in GROUPED:
            if self.reason.startswith(reason):
                return f"{INCONCLUSIVE} ({reason})"
        return self.label

    @property
    def straddles(self) -> bool:
        """Whether only the interval left the claim undecided: tested on converged, usable runs, with fewer than
        :data:`SEED_CAP` seeds, and neither decided nor held back for another reason (the claims a second look,
        :func:`fedlab_core.sweeps.second_look`, gives more seeds)."""
        return (self.verdict == INCONCLUSIVE and self.reason in ("", CONSISTENT) and self.converged
                and self.tested and self.seeds < SEED_CAP)

    @property
    def decided(self) -> bool:
        """Whether the rule decided the claim (held, not held, reached or not reached)."""
        return self.verdict not in (INCONCLUSIVE, NOT_COMPARABLE)

    @property
    def tested(self) -> bool:
        """Whether the claim was put to a test with an error rate (so counts in its family's adjustment)."""
        return not math.isnan(self.p)

    @property
    def evidence(self) -> str:
        """Our numbers in one phrase: "d = +0.012 [+0.004, +0.020] (5 seeds)" or "0.91 [0.88, 0.94] (5 seeds)",
        with the Holm-adjusted p of a decision that stood a family of more than one test."""
        seeds = f"{self.seeds} seed{'s' if self.seeds != 1 else ''}"
        if self.diverged:
            return f"{seeds}, a run diverged"
        if self.claimed is None:
            text = difference_text(self.mean, self.low, self.high, self.seeds, self.paper)
        else:
            interval = "" if math.isnan(self.low) or self.low == self.high else f" [{self.low:.3g}, {self.high:.3g}]"
            text = f"{self.mean:.3g}{interval} ({seeds}), claimed {self.claimed:.3g}"
        if self.decided and self.family_size > 1 and not math.isnan(self.adjusted_p):
            text += f"; Holm p = {self.adjusted_p:.2g} of {self.family_size}"
        return text

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


def mean_std(mean: float, std: float, spec: str = ".3f", std_spec: str | None = None) -> str:
    """``"0.741 ± 0.017"``, the book's mean ± standard deviation, with no-break spaces (U+00A0) around the ±:
    a table cell wraps before or after it, never inside it. `std_spec` defaults to `spec`."""
    return f"{mean:{spec}}\u00a0±\u00a0{std:{std_spec or spec}}"


def _undecided(n: int, converged: bool, required: bool = True) -> str:
    """The reason a claim cannot be decided before its interval is looked at ("" when it can)."""
    if required and n < MIN_SEEDS:
        return f"fewer than {MIN_SEEDS} seeds" if converged else f"{NOT_CONVERGED}; fewer than {MIN_SEEDS} seeds"
    return "" if converged else NOT_CONVERGED


def _quantity(quantity: str) -> Quantity:
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity: unknown value {quantity!r}; allowed: {', '.join(QUANTITIES)}")
    return QUANTITIES[quantity]


_DEFAULT = object()   # "the quantity's own margin or tolerance"


def _runs_reason(runs, metric: str) -> str:
    """Why the runs behind a claim cannot decide it whatever their interval: a degenerate run
    (:func:`degenerate`), or arms computed by different code versions; "" when they can."""
    for side in runs:
        for h in side:
            why = degenerate(h, metric)
            if why:
                return f"{DEGENERATE}: {_who(h)} {why}"
    for side in runs:
        for h in side:
            if stopped_on_test(h):
                return f"{TEST_STOPPED}: {_who(h)} stopped at round " \
                       f"{h.rounds[-1]['round']}: waits for the recompute"
    versions = [{_code(h) for h in side} for side in runs]
    if len(versions) == 2 and versions[0] != versions[1]:
        return f"{DIFFERENT_CODE} versions: waits for the recompute"
    if len(runs) == 2:
        budgets = [{h.config.get("seed"): budget(h) for h in side} for side in runs]
        for seed in sorted(set(budgets[0]) & set(budgets[1])):
            a, b = budgets[0][seed], budgets[1][seed]
            if a is not None and b is not None and a != b:
                return f"{UNEQUAL_BUDGETS}: seed {seed} trained {a} rounds on one side, {b} on the other"
    return ""


def _who(h: "History") -> str:
    """A run behind a claim in words: its method with its plug-in, and its seed ("fedavg+ot_align seed 0")."""
    augment = h.config.get("augment", "none")
    method = h.config.get("algorithm") + ("" if augment in (None, "none") else f"+{augment}")
    return f"{method} seed {h.config.get('seed')}"


def _code(h: "History") -> str:
    """What must match between the arms of a comparison: the kernels a run was computed with, as their canary's
    digest says (:func:`fedlab_core.kernels.canary`: under the pins every x86-64 CPU with AVX2 computes the same,
    whatever other flags it has; verification re-runs such runs under today's code, and a code change that moves
    their numbers makes them stale) on its device type, or, for a run computed before the kernels were recorded,
    its code version."""
    kernels = h.meta.get("kernels")
    if not kernels:
        return f"code {h.meta.get('code_version')}"
    return f"{h.meta.get('device', 'cpu')} {kernels.get('canary')}"


def stopped_on_test(h: "History") -> bool:
    """Whether a run stopped before its cap because its curve *on the test set* flattened: the engine's stop read
    the clients' (or the global) test accuracy of a run scored on that test set (not one scored on held-out
    training data, ``validation`` > 0). A run that trained to its cap spent its whole budget, whatever it says."""
    c = h.config
    stop = h.meta.get("stopped_at_plateau")
    return bool(stop and stop < c.get("num_rounds", math.inf)
                and c.get("plateau_metric", "mean_client_accuracy") != VALIDATION and not c.get("validation"))


def budget(h: "History") -> int | None:
    """The rounds a run trained, as a comparison's budget; None for a run a chapter truncated on purpose (the
    chapter states the budget, e.g. equal local steps) or one that diverged (its failure is its outcome)."""
    if "truncated_at" in h.meta or h.meta.get("diverged"):
        return None
    return int(h.rounds[-1]["round"]) if h.rounds else None


def _order_p(mean: float, se: float, n: int, sign: float, margin: float | None) -> tuple[float, float, float]:
    """The p-values of held (sign * d > 0), reversed (sign * d < 0) and no difference (|d| < margin)."""
    m = sign * mean
    held, reversed_ = _p_beyond(m, se, n, 0.0, True), _p_beyond(m, se, n, 0.0, False)
    same = (1.0 if margin is None else
            max(_p_beyond(m, se, n, -margin, True), _p_beyond(m, se, n, margin, False)))
    return held, reversed_, same


def two_looks(first: Callable[[int], Verdict], grown: Callable[[], Verdict], looks: int = 2) -> Verdict:
    """The rule's second look at one claim, whatever its values come from: ``first(looks)`` judges it on its first
    seeds; with two looks, a claim whose interval alone left it undecided (:attr:`Verdict.straddles`) is judged
    again by ``grown()``, on those seeds and more (up to :data:`SEED_CAP`, still with two looks), and a claim the
    first look decided carries ``grown`` as :attr:`Verdict.more`, for :meth:`Verdicts.second_looks` should Holm's
    adjustment undo it. ``looks=1``: the first look alone."""
    if looks == 1:
        return first(1)
    if looks != 2:
        raise ValueError(f"looks: 1 (no second look) or 2; got {looks!r}")
    verdict = first(2)
    if verdict.straddles:
        return grown()
    return dataclasses.replace(verdict, more=grown) if verdict.decided and verdict.seeds < SEED_CAP else verdict


def order(a: Sequence[float] | Mapping[int, float], b: Sequence[float] | Mapping[int, float], claim: str = "",
          higher: bool = True, converged: bool = True, paper: str = "",
          runs: tuple[Sequence["History"], Sequence["History"]] = (), margin: float | None = _DEFAULT,
          looks: int = 1, score: str = "", quantity: str = "accuracy", metric: str = "mean_client_accuracy"
          ) -> Verdict:
    """Judge "a beats b" from paired per-seed results.

    Parameters
    ----------
    a, b : per-seed results of the two sides (sequences in the same seed order, or mappings seed -> value).
    claim : the claim in a short phrase, starting with its source in the paper ("Table 1, DH 40%: ...") or
        with none for the book's own claims: its family for Holm's adjustment (:func:`family_of`).
    higher : True when the claim is that a is higher than b (accuracy), False when lower (loss, cost).
    converged : whether the runs behind both sides passed the plateau test (see :func:`converged`).
    paper : the paper's figure for the claim, as text.
    runs : the training runs behind a and b, when the values come from runs: their curves are drawn by
        :meth:`Verdicts.curves`, and a degenerate run (:func:`degenerate`) or arms computed by different code
        versions leave the claim undecided.
    margin : the equivalence margin in the unit of a and b (default: the quantity's, one point for
        accuracies); None: the claim is never decided as "no difference".
    looks : how many times the chapter may look at this claim as it adds seeds (2: at five seeds and again
        up to :data:`SEED_CAP`); each look's interval is widened so the looks together keep the 5% rate.
    score : how the values were scored, when they come from runs (:data:`SCORES`).
    quantity : what a and b measure (a key of :data:`QUANTITIES`).
    metric : the runs' metric the values come from (for :func:`degenerate`).
    """
    q = _quantity(quantity)
    margin = q.margin if margin is _DEFAULT else margin
    d = _paired(a, b)
    if not d:
        raise ValueError("a claim needs at least one seed")
    if margin is not None and not margin >= 0:
        raise ValueError(f"margin: must be a number >= 0 or None; got {margin!r}")
    common = dict(claim=claim, seeds=len(d), converged=converged, values=tuple(d), paper=paper,
                  runs=tuple(tuple(r) for r in runs), score=score, margin=margin, quantity=quantity,
                  family=family_of(claim))
    if any(math.isnan(v) for v in d):
        return Verdict(verdict=INCONCLUSIVE, mean=math.nan, stderr=math.nan, reason=DIVERGED, **common)
    mean, se, low, high = _interval(d, look_level(looks))
    reason = _runs_reason(runs, metric) or _undecided(len(d), converged)
    if reason:
        return Verdict(verdict=INCONCLUSIVE, mean=mean, stderr=se, low=low, high=high, reason=reason, **common)
    outcome = int(_decide(low, high, 1.0 if higher else -1.0, margin))
    ps = [min(1.0, looks * x) for x in _order_p(mean, se, len(d), 1.0 if higher else -1.0, margin)]
    verdict, reason = [(HELD, ""), (NOT_HELD, REVERSED), (NOT_HELD, NO_DIFFERENCE), (INCONCLUSIVE, "")][outcome]
    p = ps[outcome] if outcome < 3 else min(ps)
    return Verdict(verdict=verdict, mean=mean, stderr=se, low=low, high=high, reason=reason, p=p, **common)


def beats_every(a: Sequence["History"], rivals: Mapping[str, Sequence["History"]], claim: str = "",
                metric: str = "mean_client_accuracy", higher: bool = True, paper: str = "",
                protocol: str = LAST_FIFTH, margin: float | None = _DEFAULT, values=None,
                quantity: str = "accuracy", looks: int = 1) -> Verdict:
    """Judge "a beats every other method" without picking the rival on the runs that judge it.

    *Held* only if a beats each rival by the rule of :func:`order` (an intersection-union test: each
    comparison at the full level, so a false *held* stays within 2.5% however many rivals); *not held
    (reversed)* only if some rival beats a with a Bonferroni-widened interval (level 1 - 0.05 / k over k
    rivals: simultaneous, so the rival that looks best on these runs cannot make a false *reversed* likelier);
    *not held (no difference)* likewise when a is within the margin of some rival. The evidence printed is
    that against the rival closest to a (the best other by mean), whose runs the curves show.

    A rival whose runs cannot decide anything (not converged, degenerate, other code, unequal budgets) leaves
    *held* undecided, but not a refutation by the others: when a's own runs can decide, a reversal (or
    equivalence) shown against the rivals that can, still widened over all k, decides the claim, with the
    evidence against the closest of them.

    `values` : optional ``{name: {seed: value}}`` for a and each rival (``"a"`` for a) when the scores are
    not :func:`score` of the runs (best rounds of a table, silhouettes); the runs still decide convergence
    and degeneracy. `quantity` : what the values measure (:data:`QUANTITIES`). `looks` : as in :func:`order`
    (each p multiplied by it: Bonferroni over the looks).
    """
    if not rivals:
        raise ValueError("rivals: a claim against every other method needs at least one rival")
    k = len(rivals)
    scored = values or {"a": seed_values(a, metric, protocol),
                        **{name: seed_values(runs, metric, protocol) for name, runs in rivals.items()}}
    sign = 1.0 if higher else -1.0
    diffs = {name: _paired(scored["a"], scored[name]) for name in rivals}

    def nearest(names):   # the rival closest to a by mean (one whose runs diverged: last)
        return min(names, key=lambda name: sign * float(np.mean(diffs[name]))
                   if not any(map(math.isnan, diffs[name])) else -math.inf)

    def versus(name, converged):   # order() against one rival: the interval the verdict prints
        return order(scored["a"], scored[name], claim, higher, converged, paper, runs=(a, rivals[name]),
                     margin=margin, score=protocol if values is None else "", quantity=quantity, metric=metric,
                     looks=looks)

    done = {name: runs_converged(runs, metric) for name, runs in rivals.items()}
    a_done = runs_converged(a, metric)
    closest = nearest(diffs)
    base = versus(closest, a_done and all(done.values()))
    usable = [name for name, runs in rivals.items() if done[name] and not _runs_reason((a, runs), metric)]
    if 0 < len(usable) < k and a_done and not _runs_reason((a,), metric):
        against = versus(nearest(usable), True)
        if not (against.verdict == INCONCLUSIVE and against.reason):   # e.g. fewer than five seeds: nothing to read
            outcome, p = _every(np.array([diffs[name] for name in usable]), sign, against.margin, looks, rivals=k)
            if outcome in (1, 2):                 # refuted by the rivals that can decide, whatever the others
                reason = REVERSED if outcome == 1 else NO_DIFFERENCE
                return dataclasses.replace(against, verdict=NOT_HELD, reason=reason, p=float(p))
    if base.verdict == INCONCLUSIVE and base.reason:
        for name, runs in rivals.items():         # a degenerate rival or other code leaves the claim undecided too
            why = _runs_reason((a, runs), metric)
            if why:
                return dataclasses.replace(base, reason=why)
        return base
    for name, runs in rivals.items():
        why = _runs_reason((a, runs), metric)
        if why:
            return dataclasses.replace(base, verdict=INCONCLUSIVE, reason=why, p=math.nan)
    outcome, p = _every(np.array([diffs[name] for name in rivals]), sign, base.margin, looks)
    verdict, reason = [(HELD, ""), (NOT_HELD, REVERSED), (NOT_HELD, NO_DIFFERENCE), (INCONCLUSIVE, "")][int(outcome)]
    return dataclasses.replace(base, verdict=verdict, reason=reason, p=float(p))


def _every(d: np.ndarray, sign: float, margin: float | None, looks: int = 1, rivals: int | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """The decision of "beats every rival" from paired differences d (..., k rivals, n seeds): 0 held (each
    rival beaten at the full level: the largest p), 1 reversed or 2 no difference (some rival, Bonferroni over
    the k, or over `rivals` when d holds only some of them), 3 undecided; and the p of the decision (of the
    nearest one when undecided), every p multiplied by `looks`."""
    from scipy import stats

    k, n = rivals or d.shape[-2], d.shape[-1]
    m = sign * d.mean(-1)
    se = d.std(-1, ddof=1) / math.sqrt(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        def beyond(bound, above):   # vectorised _p_beyond
            t = (m - bound) / se if above else (bound - m) / se
            return np.minimum(1.0, 2 * stats.t.sf(np.where(se > 0, t, np.sign(t) * np.inf), n - 1))
        held = beyond(0.0, True).max(-1)
        reversed_ = np.minimum(1.0, k * beyond(0.0, False).min(-1))
        same = (np.ones_like(held) if margin is None else
                np.minimum(1.0, k * np.maximum(beyond(-margin, True), beyond(margin, False)).min(-1)))
    ps = np.minimum(1.0, looks * np.stack([held, reversed_, same], -1))
    best = ps.argmin(-1)
    p = np.take_along_axis(ps, best[..., None], -1)[..., 0]
    return np.where(p < ALPHA, best, 3), p


def number(values: Sequence[float] | Mapping[int, float], claimed: float, claim: str = "", higher: bool = True,
           converged: bool = True, deterministic: bool = False, comparable: str | bool = True,
           paper: str = "", quantity: str = "accuracy", tolerance: float = _DEFAULT,
           runs: tuple[Sequence["History"], ...] = ()) -> Verdict:
    """Judge a claimed number against our per-seed values, three ways.

    With the claimed value c and the quantity's tolerance t (one point for accuracies): *reached* only if our
    interval's worse bound clears c - t (c + t for a cost); *not reached* only if the whole interval misses c
    (lies below it; above it for a cost); otherwise *inconclusive (consistent, undecided)*. So "reached" is
    never said of an interval that also holds a value more than t worse than the claim.

    Parameters
    ----------
    values : our per-seed values (or one value with ``deterministic``).
    claimed : the paper's number, in the same unit.
    claim : the claim in a short phrase (its source first, as for :func:`order`).
    higher : True when higher is better (accuracy, a gain), False for a cost (seconds, bytes, a ratio).
    converged : whether the runs behind the values passed the plateau test.
    deterministic : the values do not vary with the seed (a byte count, an exponent fitted to one sweep):
        judged on their mean, with no interval and no seed requirement.
    comparable : True when the claimed number means the same on our data; else the reason it does not (an
        absolute accuracy on another dataset, a file size against a parameter count): the verdict is then
        *not comparable*, with that reason.
    paper : the paper's figure as text (default: the claimed number).
    quantity : what the number measures (a key of :data:`QUANTITIES`): its tolerance.
    tolerance : overrides the quantity's tolerance, in the unit of the values.
    runs : the training runs behind the values, checked by :func:`degenerate`.
    """
    q = _quantity(quantity)
    tol = q.tolerance if tolerance is _DEFAULT else float(tolerance)
    if not tol >= 0:
        raise ValueError(f"tolerance: must be a number >= 0; got {tolerance!r}")
    v = _values(values)
    v = list(v.values()) if isinstance(v, dict) else v
    if not v:
        raise ValueError("a claim needs at least one value")
    if comparable is not True and not (isinstance(comparable, str) and comparable.strip()):
        raise ValueError("comparable: must be True or the reason the claimed number is not comparable")
    common = dict(claim=claim, seeds=len(v), claimed=float(claimed), converged=converged, values=tuple(v),
                  paper=paper or f"{float(claimed):.3g}", quantity=quantity, family=family_of(claim),
                  runs=tuple(tuple(r) for r in runs))
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
    reason = _runs_reason(runs, "mean_client_accuracy") if runs else ""
    reason = reason or _undecided(len(v), converged, required=not deterministic)
    if reason:
        return Verdict(verdict=INCONCLUSIVE, mean=mean, stderr=se, low=low, high=high, reason=reason, **common)
    sign = 1.0 if higher else -1.0
    good, bad = sign * (low if higher else high), sign * (high if higher else low)   # worse and better bound
    c = sign * claimed
    if deterministic:
        p = math.nan       # a measurement: no sampling error, no family
    else:
        n, m = len(v), sign * mean
        p_reached, p_missed = _p_beyond(m, se, n, c - tol, True), _p_beyond(m, se, n, c, False)
    if good >= c - tol:
        verdict, reason = REACHED, ""
        p = p if deterministic else p_reached
    elif bad < c:
        verdict, reason = NOT_REACHED, ""
        p = p if deterministic else p_missed
    else:
        verdict, reason = INCONCLUSIVE, CONSISTENT
        p = p if deterministic else min(p_reached, p_missed)
    return Verdict(verdict=verdict, mean=mean, stderr=se, low=low, high=high, reason=reason, p=p, **common)


def blind_to_input(h: "History") -> bool:
    """Whether a run's final models ignore their input: at least :data:`BLIND_SHARE` of each client's predictions
    stay the same when its images are replaced by noise (``meta["unchanged_under_noise"]``, measured at the run's
    end); False where that was not measured."""
    blind = h.meta.get("unchanged_under_noise")
    return blind is not None and len(blind) > 0 and min(blind) >= BLIND_SHARE


def degenerate(h: "History", metric: str = "mean_client_accuracy") -> str:
    """Why a run cannot stand behind a verdict although it may pass the convergence test, or "" when it can.

    - *near chance*: its score (:func:`score`) of the client accuracy, or of `metric`, is within
      :data:`CHANCE_MARGIN` of one over the number of classes;
    - *constant predictions*: over the last fifth of its evaluated rounds (at least three), every client's
      accuracy stays exactly the same and is the same for every client, as a model that answers each
      client with one fixed class on its balanced test set (a model that reads the class from something
      other than the image);
    - *blind to its input*, where the run's final state was measured (``meta["unchanged_under_noise"]``,
      :func:`fedlab_core.runs.input_dependence`): at least :data:`BLIND_SHARE` of each client's predictions
      stay the same when its images are replaced by noise;
    - *collapsed*: its score ends more than :data:`COLLAPSE` below the best evaluated round.
    """
    counts = h.meta.get("class_counts") or [[]]
    classes = len(counts[0]) if counts and counts[0] else 0
    rows = [r for r in h.rounds if r.get("mean_client_accuracy") is not None]
    for m in dict.fromkeys(("mean_client_accuracy", metric)):
        if not m.endswith("accuracy") or _diverged(h, m) or not curve(h, m):
            continue
        s = score(h, m)
        if classes and s <= 1 / classes + CHANCE_MARGIN:
            return f"scores near chance ({m.replace('_', ' ')} {s:.3f} with {classes} classes)"
    k = max(3, math.ceil(len(rows) / 5))
    tail = [r.get("client_accuracy") for r in rows[-k:]]
    if len(rows) >= 3 and tail[0] and len(tail[0]) > 1 and all(t == tail[0] for t in tail) \
            and len(set(tail[0])) == 1:
        return (f"predicts a constant per client (every client scores {tail[0][0]:.3f} at each of its last {k} "
                f"evaluations)")
    if blind_to_input(h):
        return (f"ignores its input (at least {100 * min(h.meta['unchanged_under_noise']):.0f}% of each client's "
                f"predictions unchanged when its images are replaced by noise)")
    if not _diverged(h, metric) and curve(h, metric) and metric.endswith("accuracy"):
        peak, end = max(curve(h, metric).values()), score(h, metric)
        if peak - end > COLLAPSE:
            return f"collapsed ({metric.replace('_', ' ')} {end:.3f} at the end against a peak of {peak:.3f})"
    return ""


# ------------------------------------------------------------------------------ scores (the convergence test: .convergence)

def curve(h: "History", metric: str = "mean_client_accuracy") -> dict[int, float]:
    """A run's evaluated rounds: ``{round: metric}`` (`metric` may be :data:`VALIDATION`)."""
    return {r: float(v) for r, v in metric_curve(h.rounds, metric).items() if v is not None}


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
                             f"{_who(h)} has no validation scores")
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
    return last_fifth(values)


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


def convergence_curve(h: "History", metric: str = "mean_client_accuracy") -> dict[int, float]:
    """The curve the plateau test reads for a run judged on `metric`: the clients' validation accuracy
    (:data:`VALIDATION`) when the run monitors a validation share and is judged on an accuracy (the clients' or
    the global model's), so the test set never decides convergence; else `metric`'s own curve."""
    if metric in ("mean_client_accuracy", "global_accuracy") and any(r.get("client_validation_accuracy")
                                                                     for r in h.rounds):
        return curve(h, VALIDATION)
    return curve(h, metric)


def runs_converged(runs: Sequence["History"], metric: str = "mean_client_accuracy") -> bool:
    """Whether one side's runs (one per seed) pass the convergence test (:func:`converged`) on their curves
    (:func:`convergence_curve`): their mean curve over the seeds does."""
    return converged([convergence_curve(h, metric) for h in runs])


def beats(a: Sequence["History"], b: Sequence["History"], claim: str = "", metric: str = "mean_client_accuracy",
          higher: bool = True, paper: str = "", protocol: str = LAST_FIFTH, margin: float | None = MARGIN,
          looks: int = 1) -> Verdict:
    """:func:`order` on two methods' runs (one per seed, the same seeds), each scored by `protocol`;
    inconclusive (not converged) unless every run of both sides passes the plateau test."""
    return order(seed_values(a, metric, protocol), seed_values(b, metric, protocol), claim, higher,
                 runs_converged(a, metric) and runs_converged(b, metric), paper, runs=(a, b), margin=margin,
                 looks=looks, score=protocol, metric=metric)


def ranking(groups: Mapping[str, Sequence["History"]], setting: str = "", metric: str = "mean_client_accuracy",
            protocol: str = LAST_FIFTH, look: Callable[..., Verdict] | None = None
            ) -> tuple["pd.DataFrame", list[Verdict]]:
    """Methods ranked by their mean score over seeds, and the rule's verdict on each step of the ranking.

    `groups` maps a method's name to its runs (one per seed, the same seeds for every method). Each run is
    scored by `protocol` (:func:`score`); a method's row gives its mean, the 95% interval of that mean over
    the seeds (``low``, ``high``), whether its runs converged (``converged``, :func:`runs_converged`), the
    number of ``seeds``, and the
    verdict on "it beats the method ranked next" with its evidence (:func:`beats`, so inconclusive unless
    both sides converged with at least :data:`MIN_SEEDS` seeds) and its ``claim``. A method whose runs diverged
    ranks last. Returns (the table, the verdicts of the steps, top first); a claim reads "`setting`: A beats B".
    The steps are verdicts before Holm's adjustment: a page adds them to its :class:`Verdicts` and shows the
    table through :func:`adjusted_ranking`. `look`, called as ``look(judge, a_runs, b_runs)``, judges each step
    (``judge`` is :func:`beats` with the step's claim): e.g. the rule's second look
    (``partial(sweeps.second_look, looks=2)``), whose added seeds then stand behind that step's verdict only.
    """
    import pandas as pd

    values = {name: seed_values(runs, metric, protocol) for name, runs in groups.items()}
    means = {name: float(np.mean(list(v.values()))) for name, v in values.items()}
    order_ = sorted(groups, key=lambda name: (math.isnan(means[name]), -means[name] if not math.isnan(means[name])
                                              else 0.0))
    steps, rows = [], []
    for i, name in enumerate(order_):
        mean, _, low, high = _interval(list(values[name].values()), LEVEL)
        step = None
        if i + 1 < len(order_):
            below = order_[i + 1]
            judge = functools.partial(beats, claim=f"{setting + ': ' if setting else ''}{name} beats {below}",
                                      metric=metric, protocol=protocol)
            step = look(judge, groups[name], groups[below]) if look else judge(groups[name], groups[below])
            steps.append(step)
        rows.append({"rank": i + 1, "method": name, "mean": mean, "low": low, "high": high,
                     "converged": runs_converged(groups[name], metric), "seeds": len(groups[name]),
                     "beats the next?": step.label if step else "—", "by": step.evidence if step else "—",
                     "claim": step.claim if step else ""})
    return pd.DataFrame(rows), steps


def adjusted_ranking(table: "pd.DataFrame", items: Sequence[Verdict]) -> "pd.DataFrame":
    """:func:`ranking`'s table with each step's verdict and evidence as `items` hold them: the verdicts of a
    :class:`Verdicts` once every claim of the page is added, so after Holm's adjustment within each family. A step
    decided alone but not after the adjustment then reads *inconclusive (multiplicity)*, as the page's counts do.
    Raises ValueError when a step's claim is not among `items`."""
    by_claim = {v.claim: v for v in items}
    missing = [c for c in table["claim"] if c and c not in by_claim]
    if missing:
        raise ValueError(f"items: no verdict for the ranking's step {missing[0]!r}")
    out = table.copy()
    out["beats the next?"] = [by_claim[c].label if c else "—" for c in table["claim"]]
    out["by"] = [by_claim[c].evidence if c else "—" for c in table["claim"]]
    return out


def ranking_view(table: "pd.DataFrame") -> "pd.DataFrame":
    """:func:`ranking`'s table as a page shows it, in four columns that fit a phone: the rank; the method, marked
    where its runs have not converged ("FedProx (not converged)"); its mean with the 95%
    interval, unbroken, in brackets; the verdict on its step with the evidence ("inconclusive: d = ...")."""
    import pandas as pd

    def score(row) -> str:
        if math.isnan(row["mean"]):
            return "—"
        interval = "" if math.isnan(row["low"]) else f" [{row['low']:.3f},\u00a0{row['high']:.3f}]"
        return f"{row['mean']:.3f}{interval}"

    return pd.DataFrame({"rank": table["rank"],
                         "method": [m if c else f"{m} (not converged)"
                                    for m, c in zip(table["method"], table["converged"])],
                         "mean [95% interval]": [score(row) for _, row in table.iterrows()],
                         "beats the next?": [label if by == "—" else f"{label}: {by}"
                                             for label, by in zip(table["beats the next?"], table["by"])]})


def ahead_over_rounds(a: Sequence["History"], b: Sequence["History"], claim: str = "",
                      metric: str = "mean_client_accuracy", paper: str = "", margin: float | None = MARGIN,
                      looks: int = 1) -> Verdict:
    """:func:`order` on "a is ahead of b over the rounds" (a claim about curves, e.g. "converges faster" or
    "ahead at every round"): per seed, the mean of a - b over the rounds both runs evaluated, the area
    between the curves per round. Not the smallest lead, which one noisy round decides. `looks`: as in
    :func:`order` (2 for a claim that may take the second look)."""
    by_seed = {int(h.config["seed"]): h for h in b}
    lead = {}
    for h in a:
        seed = int(h.config["seed"])
        ca, cb = curve(h, metric), curve(by_seed[seed], metric)
        common = sorted(set(ca) & set(cb))
        diverged = any(_diverged(x, metric) for x in (h, by_seed[seed]))
        lead[seed] = math.nan if diverged or not common else float(np.mean([ca[r] - cb[r] for r in common]))
    return order(lead, {s: 0.0 for s in lead}, claim, True, runs_converged(a, metric) and runs_converged(b, metric),
                 paper, runs=(a, b), margin=margin, looks=looks, score="mean difference over the evaluated rounds",
                 metric=metric)


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


@functools.lru_cache(maxsize=32)
def every_error_rates(rivals: int, effect: float = 0.0, seeds: int = MIN_SEEDS, sd: float = NOISE_SD,
                      margin: float | None = MARGIN, simulations: int = SIMULATIONS, seed: int = 0) -> dict[str, float]:
    """How often :func:`beats_every` decides each way when a truly differs from every one of `rivals` equal
    rivals by `effect`, by simulation: each method's per-seed score is its mean plus independent noise of
    spread `sd` / sqrt(2) (so that one paired difference has spread `sd`), the differences against the
    rivals sharing a's noise. Returns ``{"held", "reversed", "no difference", "inconclusive"}`` shares."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((simulations, rivals + 1, seeds)) * sd / math.sqrt(2)
    d = effect + scores[:, :1, :] - scores[:, 1:, :]
    outcome, _ = _every(d, 1.0, margin)
    shares = np.bincount(outcome.astype(int), minlength=4) / simulations
    return dict(zip(("held", "reversed", "no difference", "inconclusive"), map(float, shares)))


def _holm_adjusted(p: np.ndarray) -> np.ndarray:
    """Holm's adjusted p-values along the last axis of `p` (each row a family): :func:`holm`'s, and the
    simulations'."""
    m = p.shape[-1]
    order_ = np.argsort(p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order_, -1)
    adjusted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * ranked), axis=-1)
    out = np.empty_like(adjusted)
    np.put_along_axis(out, order_, adjusted, -1)
    return out


@functools.lru_cache(maxsize=16)
def family_error_rates(claims: int = 20, real: int = 0, effect: float = 0.03, sd: float = NOISE_SD,
                       margin: float | None = MARGIN, multiplicity_look: bool = True,
                       simulations: int = SIMULATIONS, seed: int = 0) -> dict[str, float]:
    """How the rule does over one family of `claims` claims "A beats B", planned with two looks and adjusted by
    Holm's method, by simulation: `real` of them have a true difference `effect`, the others none.

    Each claim is judged at :data:`MIN_SEEDS` seeds; one whose interval straddles gets seeds up to
    :data:`SEED_CAP` (the second look). With `multiplicity_look`, so does one whose interval decided it but whose
    Holm-adjusted p did not (:meth:`Verdicts.second_looks`), again and again until no such claim is left. Every
    claim's p counts both looks (doubled), whichever it ends on, so it stays a valid p-value and Holm's
    adjustment keeps the family's error rate.

    Returns ``{"family-wise error"``: the share of families with at least one false decision that stands
    (held or reversed against the true sign, no difference against a true difference beyond the margin),
    ``"held"``: the share of the real claims held, ``"second looks"``: claims per family that took one``}``.
    """
    if not 0 <= real <= claims:
        raise ValueError(f"real: must lie between 0 and claims ({claims}); got {real!r}")
    rng = np.random.default_rng(seed)
    effects = np.r_[np.full(real, effect), np.zeros(claims - real)]
    d = effects[None, :, None] + sd * rng.standard_normal((simulations, claims, SEED_CAP))
    (first, p_first), (second, p_second) = (_every(d[:, :, None, :n], 1.0, margin, looks=2)
                                            for n in (MIN_SEEDS, SEED_CAP))
    looked = first == 3                                  # the interval straddles: the second look
    while True:
        outcome, p = np.where(looked, second, first), np.where(looked, p_second, p_first)
        adjusted = _holm_adjusted(p)
        undone = ~looked & (outcome < 3) & (adjusted >= ALPHA)
        if not multiplicity_look or not undone.any():
            break
        looked |= undone
    stands = (outcome < 3) & (adjusted < ALPHA)
    wrong = (((outcome == 0) & (effects <= 0)) | ((outcome == 1) & (effects >= 0))
             | ((outcome == 2) & (np.abs(effects) > (margin or 0.0))))
    return {"family-wise error": float((stands & wrong).any(-1).mean()),
            "held": float((stands & (outcome == 0))[:, :real].mean()) if real else math.nan,
            "second looks": float(looked.sum(-1).mean())}


@functools.lru_cache(maxsize=32)
def number_error_rates(offset: float, seeds: int = MIN_SEEDS, sd: float = NOISE_SD, tolerance: float = 0.01,
                       simulations: int = SIMULATIONS, seed: int = 0) -> dict[str, float]:
    """How often :func:`number` says each thing of a claimed number (higher is better) when our true value
    lies `offset` from it (-0.03: three points below), by simulation at per-seed spread `sd`. Returns
    ``{"reached", "not reached", "consistent"}`` shares."""
    rng = np.random.default_rng(seed)
    v = offset + sd * rng.standard_normal((simulations, seeds))
    mean, se = v.mean(1), v.std(1, ddof=1) / math.sqrt(seeds)
    half = _t_quantile(LEVEL, seeds - 1) * se
    reached = mean - half >= -tolerance
    missed = ~reached & (mean + half < 0)
    return {"reached": float(reached.mean()), "not reached": float(missed.mean()),
            "consistent": float(1 - reached.mean() - missed.mean())}


@functools.lru_cache(maxsize=8)
def rule(sd: float = NOISE_SD) -> str:
    """The rule as the book prints it, with its error rates simulated at a per-seed spread `sd` of the paired
    differences (a chapter passes the spread its own claims show: :meth:`Verdicts.rule`)."""
    sd = float(sd)
    null, power2, power3 = error_rates(0.0, sd=sd), error_rates(0.02, sd=sd), error_rates(0.03, sd=sd)
    null2, power2_2 = error_rates(0.0, sd=sd, looks=2), error_rates(0.02, sd=sd, looks=2)
    heavy = error_rates(0.0, sd=sd, noise="heavy")
    family_null, family_real = family_error_rates(sd=sd), family_error_rates(real=10, sd=sd)
    family_plain = family_error_rates(real=10, sd=sd, multiplicity_look=False)
    every = every_error_rates(4, sd=sd)
    below = number_error_rates(-0.03, sd=sd)
    pct = lambda x: f"{100 * x:.1f}%"
    return (
        f"**How a verdict is computed.** Each run is scored at convergence: the mean accuracy over the last fifth "
        f"of its evaluated rounds (a paper's own protocol where it states one, named with the verdict). A method's "
        f"runs have converged when a line fitted to the last third of the evaluated rounds (at least "
        f"{MIN_EVALUATIONS} evaluations) of their mean curve over the seeds moves by at most "
        f"{100 * PLATEAU_RISE:.0f} point over that span (each run's own curve where they stopped at different "
        f"rounds), read on the validation set its clients hold where it has one, never on the test "
        f"set; a curve still rising slowly can pass it on a flat stretch (a known limit of the test). A run that "
        f"stopped before its last round because its *test* curve looked flat decides nothing (the stop read the "
        f"numbers it is judged on), and neither do two arms that trained for different numbers of rounds on a "
        f"seed (*unequal budgets*). A run that converged "
        f"can still have learned nothing: one that scores within {100 * CHANCE_MARGIN:.0f} points of chance, "
        f"whose every client scores the same constant at each of its last evaluations (a model that answers "
        f"each client with one class whatever the image), whose predictions stay the same when its images are "
        f"replaced by noise (measured where its final state is kept), or whose score ends more than "
        f"{100 * COLLAPSE:.0f} points below its peak is *degenerate*, and no verdict rests on it. "
        f"An ordering claim (\"A beats B\") is judged on the paired per-seed differences d = A − B of the "
        f"scores, by the {LEVEL:.0%} Student-t interval of their mean: *held* if the interval lies wholly on the "
        f"claimed side of zero; *not held (reversed)* if wholly on the other side; *not held (no difference)* "
        f"if wholly within the quantity's margin (±{100 * MARGIN:.0f} accuracy point; silhouettes and exponents "
        f"have their own; a loss gap none); *inconclusive* otherwise, and always with fewer than {MIN_SEEDS} "
        f"seeds, with a run that has not converged or is degenerate, or with arms computed by different code "
        f"(the reason is printed). \"A beats every other\" is *held* only if A beats each rival so, "
        f"and *reversed* only if some rival beats A with intervals widened over the rivals (Bonferroni), so "
        f"the rival that looks best on these runs cannot decide it alone; a rival whose runs cannot decide "
        f"(not converged, degenerate) leaves *held* undecided, but not a reversal shown by the others. A claimed "
        f"number c is *reached* only if our interval's worse bound clears c less the quantity's tolerance (one "
        f"accuracy point), *not reached* only if the whole interval misses c, and *inconclusive (consistent, undecided)* otherwise; "
        f"a number that means something else on our data (another dataset, a file size against a parameter "
        f"count) is *not comparable*. **Families.** The claims of one table or figure of a paper form a family, "
        f"and the book's own claims on a page another; the p-values of a family's decisions are adjusted by "
        f"Holm's method, and a decision stands only if its adjusted p is below {ALPHA:.2f} (otherwise "
        f"*inconclusive (multiplicity)*), so each family errs at most {ALPHA:.0%} of the time in all. "
        f"**Error rates, simulated** ({SIMULATIONS:,} claims each, {MIN_SEEDS} seeds, per-seed spread of d "
        f"{100 * sd:.1f} points): with no real difference the rule says *held* {pct(null['held'])} of the time "
        f"and *not held (reversed)* {pct(null['reversed'])} ({pct(heavy['held'])} held with heavy-tailed "
        f"noise, t with 3 degrees of freedom); with a real difference of 2 points it says *held* "
        f"{pct(power2['held'])} of the time, of 3 points {pct(power3['held'])} (its power). Against four equal "
        f"rivals, \"beats every other\" is falsely held {pct(every['held'])} and falsely reversed "
        f"{pct(every['reversed'])} of the time. A true value 3 points below a claimed number is called "
        f"*reached* {pct(below['reached'])} of the time. A chapter may add five seeds to a claim whose interval "
        f"alone left it undecided, up to {SEED_CAP}, with a {look_level(2):.1%} interval at each of the two looks "
        f"(the second look): false *held* then "
        f"{pct(null2['held'])}, power at 2 points {pct(power2_2['held'])}. It does the same for a claim its "
        f"interval decided but Holm's adjustment did not; every claim's p counts both of its looks, so over a "
        f"family of 20 claims with no real difference some false decision stands in {pct(family_null['family-wise error'])} "
        f"of families, and when 10 of the 20 differ by 3 points {pct(family_real['held'])} of those 10 are held "
        f"({pct(family_plain['held'])} without this look)."
    )


def holm(items: Sequence[Verdict]) -> list[Verdict]:
    """The verdicts with Holm's adjustment applied within each family (:func:`family_of`), from each verdict as
    it was before any adjustment (so adjusting again, with more claims, starts afresh).

    A family's size m counts every claim in it that was put to a test or could not be (too few seeds, not
    converged, degenerate: counted with p = 1, as a test that cannot reject); not a measurement without
    sampling error, nor a number that is not comparable. A decision whose adjusted p is at least
    :data:`ALPHA` becomes *inconclusive (multiplicity)*, saying what it was before."""
    raw = [v.unadjusted or v for v in items]
    out = list(raw)
    families: dict[str, list[int]] = {}
    for i, v in enumerate(raw):
        if v.verdict != NOT_COMPARABLE and (v.tested or not v.decided):
            families.setdefault(v.family or family_of(v.claim), []).append(i)
    for family, idx in families.items():
        m = len(idx)
        ps = _holm_adjusted(np.array([raw[i].p if raw[i].tested else 1.0 for i in idx]))
        for i, running in zip(idx, map(float, ps)):
            v = raw[i]
            if not v.tested:
                continue
            adjusted = dataclasses.replace(v, adjusted_p=running, family_size=m, family=family, unadjusted=v)
            if v.decided and running >= ALPHA:
                scope = f"the book's own {m} claims" if family == BEYOND_THE_PAPER else f"the {m} claims of {family}"
                adjusted = dataclasses.replace(
                    adjusted, verdict=INCONCLUSIVE,
                    reason=f"{MULTIPLICITY}: {v.label} before Holm's adjustment, adjusted p = {running:.2g} "
                           f"over {scope}")
            out[i] = adjusted
    return out


def _summary(items: Sequence[Verdict]) -> str:
    """E.g. "3 held, 2 not held (reversed), 7 inconclusive (not converged)", by category in the order of
    :data:`OUTCOMES`."""
    order_ = {label: i for i, label in enumerate(OUTCOMES)}
    counts: dict[str, int] = {}
    for label in sorted((v.category for v in items), key=lambda x: (order_.get(x, len(OUTCOMES)), x)):
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())


# ------------------------------------------------------------------------------ a chapter's verdicts

@dataclass
class Verdicts:
    """The verdicts a chapter makes, in order: ``add`` one, then print, count or tabulate them.

    ``items`` are the verdicts after Holm's adjustment within each family (:func:`holm`), recomputed as each
    verdict is added: a verdict :meth:`add` returned may change as its family grows, so counts and prose
    read ``items`` once every claim is added."""

    items: list[Verdict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._raw = [v.unadjusted or v for v in self.items]
        self.items = holm(self._raw)

    def add(self, verdict: Verdict) -> Verdict:
        self.extend([verdict])
        return self.items[-1]

    def extend(self, verdicts: Iterable[Verdict]) -> None:
        """Add these verdicts; a claim already judged here is refused (Holm's adjustment would count it twice)."""
        new, seen = list(verdicts), {v.claim for v in self._raw}
        for v in new:
            if v.claim and v.claim in seen:
                raise ValueError(f"claim: already judged on this page, so Holm's adjustment would count it twice: "
                                 f"{v.claim!r}")
            seen.add(v.claim)
        self._raw.extend(new)
        self.items = holm(self._raw)

    def second_looks(self) -> int:
        """The second look at every claim its interval decided but Holm's adjustment within its family did not
        (*inconclusive (multiplicity)*), where it was planned with two looks (:attr:`Verdict.more`): its seeds
        grow to :data:`SEED_CAP` and it is judged again, until no such claim is left (a claim that looks again
        changes its family's adjustment). Each claim's p counts both of its looks, so the family keeps its error
        rate (:func:`family_error_rates`). Call it once every claim of the page is added. Returns how many
        claims looked again."""
        grown = 0
        while True:
            undone = [i for i, v in enumerate(self.items)
                      if v.reason.startswith(MULTIPLICITY) and self._raw[i].more is not None]
            if not undone:
                return grown
            for i in undone:
                self._raw[i] = self._raw[i].more()
            self.items = holm(self._raw)
            grown += len(undone)

    def spread(self) -> float:
        """The median per-seed spread (standard deviation) of the paired differences of this page's ordering
        claims on accuracies with two seeds or more; :data:`NOISE_SD` when there is none."""
        sds = [float(np.std(v.values, ddof=1)) for v in self.items
               if v.claimed is None and v.quantity == "accuracy" and len(v.values) > 1 and not v.diverged]
        return float(np.median(sds)) if sds else NOISE_SD

    def rule(self) -> str:
        """:func:`rule` with its error rates at this page's own spread (:meth:`spread`), rounded to a tenth of a
        point."""
        return rule(round(self.spread(), 3))

    def count(self, label: str | None = None) -> int:
        """How many verdicts, or how many with this outcome ("held"), category or full label ("not held
        (reversed)")."""
        return sum(1 for v in self.items if label is None or label in (v.verdict, v.category, v.label))

    def summary(self) -> str:
        """E.g. "12 verdicts: 3 held, 2 not held (reversed), 7 inconclusive (not converged)", by category."""
        parts = _summary(self.items)
        return f"{len(self.items)} verdict{'s' if len(self.items) != 1 else ''}" + (f": {parts}" if parts else "")

    def findings(self) -> str:
        """What a page found, in Markdown, for its opening: how many claims the rule decided (a claim on
        training runs only when they converged, with at least :data:`MIN_SEEDS` seeds; a deterministic count
        or cost on its measurement), each decided claim with its outcome and our number, and the undecided
        ones counted by why."""
        decided = [v for v in self.items if v.decided]
        n = len(self.items)
        lines = [f"**What we found.** The rule decided {len(decided)} of the {n} claim{'s' if n != 1 else ''} "
                 f"judged on this page" + (f" (after Holm's adjustment within each table or figure; a claim on "
                                           f"training runs only when they converged, none degenerate, with at "
                                           f"least {MIN_SEEDS} seeds):" if decided else ".")]
        if decided:
            lines += [""] + [f"- *{v.label}*: {v.claim} ({v.evidence})" for v in decided]
        undecided = [v for v in self.items if not v.decided]
        if undecided:
            lines += ["", f"Undecided: {_summary(undecided)}."]
        return "\n".join(lines)

    def table(self) -> "pd.DataFrame":
        """One row per verdict: its number (the panel of :func:`~fedlab_core.viz.verdict_curves`), the claim, the paper's figure, ours,
        the verdict."""
        import pandas as pd
        return pd.DataFrame({"#": range(1, len(self.items) + 1), "claim": [v.claim for v in self.items],
                             "paper": [v.paper for v in self.items], "ours": [v.evidence for v in self.items],
                             "verdict": [v.label for v in self.items]})
