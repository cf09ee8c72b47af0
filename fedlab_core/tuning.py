"""Equal tuning for every method: one learning-rate grid per method and benchmark, chosen on validation data.

The papers each tuned their own method; a fair comparison tunes every method the same way. For a
benchmark (a dataset and partition scheme at the book's scale, e.g. the DisTrans split of
Fashion-MNIST at DH 0.8, or the feature-skew domains) and a method, the candidates come from one of two
grids, and a method with a second rate of its own (DisTrans's offset rate, pFedHN's server rate) tries
every pair:

- **relative** (``rates=None``): the method's paper rate (``paper_training.lr``) times each factor of
  :data:`GRID`, the second rate's paper value times its factors (:data:`SECOND_RATES`); scored at the last
  round. Its ceilings differ by method: a method whose paper rate is small can never reach the rates
  another method tries.
- **absolute** (``rates=RATES``): every method tries the same rates, :data:`RATES`, a half-decade grid
  from 0.003 to 0.3, and the second rates their grids of :data:`SECOND_RATE_GRIDS`; each candidate is
  evaluated every tenth of its rounds and scored by :func:`~fedlab_core.verdicts.score` (the mean of the
  last fifth of its evaluated rounds, which one noisy round cannot decide). A method whose choice lies at
  the edge of the rates it tried gets the next rate beyond that edge (the grid's own step), up to
  ``widen`` times per rate, so no method is capped by the grid.

Every candidate is run on each tuning seed (``seeds``: seeds no chapter evaluates on, :data:`SEEDS`), at the
rounds given (the horizon the chapters' runs use), and evaluated on a validation split carved from the
clients' training data (``RunConfig.validation``), never the test set. Its score is the mean over the seeds.
**The one-standard-error rule** chooses: of the candidates whose mean lies within one standard error (over
the seeds) of the best mean, the smallest rates, the more stable choice (a rate one grid step below a collapse
scores well on one seed and collapses on the next). With one seed there is no standard error and the best
score wins (ties: the rate closer to the paper's). A candidate with a degenerate seed (one the verdicts could not
stand on: near chance, constant answers per client, blind to its input, collapsed; see
:func:`~fedlab_core.verdicts.degenerate`) is never chosen while one without remains: under one class per client
a model that answers every image with its client's class is such a run, and tuning must not pick it.

**Converging rates first** (``converging=True``, absolute grid): a rate small enough to be stable may also be
too small to finish learning in the rounds given, and its runs then cannot decide anything. So among the
candidates within one standard error of the best, those whose tuning runs converge at the horizon (the mean of
their validation curves over the seeds passes the convergence test, :func:`~fedlab_core.convergence.plateaued`)
come first, then the smallest rates. A rate that converges but scores worse than that is never chosen (a rate
that learns nothing converges too); where no candidate near the best converges, the choice is the plain rule's,
and :meth:`Tuning.table` and :meth:`Tuning.convergence` say that it does not converge.

Every candidate is an ordinary cached run, so each chapter that asks for the same benchmark gets the
same choice without training again. :func:`tuned_configs` applies the choice with the precedence the
book prints beside every table: a value the chapter sets on purpose, then the tuned rate, then the
paper's default; :func:`settings_table` is that table.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from .algorithms import ALGORITHMS, Training
from .convergence import mean_curve, plateaued
from .runs import RunConfig
from .sweeps import sweep

if TYPE_CHECKING:
    import pandas as pd

GRID = (1 / 3, 1.0, 3.0, 10.0)   # factors of the paper's rate; 10x: the book trains for far fewer rounds
# A method's own second rate, tuned alongside its lr: the parameter and the factors of its paper value tried.
# DisTrans's paper offset rate (1e-3) moves an offset by about 1e-4 of its size in ten rounds at the book's
# scale (an offset's gradient is that of a batch-mean loss with respect to one input, tiny per pixel), so
# its offsets would stay the noise they start as; its grid spans four decades upwards instead.
SECOND_RATES = {"distrans": ("offset_lr", (1.0, 1e2, 1e3, 1e4)), "pfedhn": ("server_lr", GRID)}
RATES = (0.003, 0.01, 0.03, 0.1, 0.3)   # the absolute grid: every method's learning rate, half a decade apart
# The absolute grids of the second rates: DisTrans's offset rate a decade apart (its useful range spans four
# decades, see above), pFedHN's server rate on the learning rates' grid.
SECOND_RATE_GRIDS = {"distrans": ("offset_lr", (0.01, 0.1, 1.0, 10.0)), "pfedhn": ("server_lr", RATES)}
EVALUATIONS = 10                  # absolute grid: evaluations per candidate run
VALIDATION = 0.2                  # the share of each client's training data held out for tuning
METRIC = "mean_client_accuracy"   # every method has it: each client's own prediction rule on its own data
SEEDS = (100, 101, 102)           # tuning seeds: no chapter evaluates on them (their seeds start at 0)


@dataclass
class Tuning:
    """The outcome of :func:`tune`: every candidate's validation score and the choice per method.

    Attributes
    ----------
    grid : one row per (method, candidate): the rounds its runs trained, the rates tried, the factor of the paper's
        rate, the validation score (the mean over the seeds) and its standard error (``validation_se``, NaN with
        one seed), whether the mean validation curve converges (``converges``; absolute grid only), why a seed is
        degenerate (``degenerate``; "" when none is), the seconds its runs took when they ran, whether it was chosen.
    chosen : method label -> the rates it uses (``{"lr": ..., "offset_lr": ...}``).
    rounds, seeds, validation : how the candidates were run (`rounds`: those of a method whose changes set none).
    absolute : whether the grid was :data:`RATES` (with widening) or factors of the paper rates.
    converging : whether converging candidates came first among those near the best (see the module docstring).
    names : the rates tuned, the learning rate first, then the second rates (:func:`second_rate_grids`).
    """

    grid: "pd.DataFrame"
    chosen: dict[str, dict[str, float]]
    rounds: int
    seeds: tuple[int, ...]
    validation: float
    absolute: bool = False
    converging: bool = False
    names: tuple[str, ...] = ("lr",)

    def by_rate(self) -> "pd.DataFrame":
        """Method x learning rate tried (absolute grid) or factor of its paper rate (relative grid): the best
        validation score there (over a second rate); NaN where the method did not try it."""
        return self.grid.pivot_table(index="method", columns="lr" if self.absolute else "factor",
                                     values="validation", aggfunc="max", sort=False, dropna=False).sort_index(axis=1)

    def diverged(self) -> "pd.DataFrame":
        """:meth:`by_rate`'s table of where a method tried a rate and has no score there: a seed of every candidate
        at that rate diverged. True there, False elsewhere (a rate not tried included)."""
        table = self.by_rate()
        tried = (self.grid.assign(tried=True)
                 .pivot_table(index="method", columns="lr" if self.absolute else "factor", values="tried",
                              aggfunc="any", sort=False)
                 .reindex(index=table.index, columns=table.columns))
        return tried.fillna(False).astype(bool) & table.isna()

    def curves(self) -> "pd.DataFrame":
        """Per method and learning rate tried: the validation score's mean over the seeds and its standard error,
        and whether it was chosen: a method's curve of score against rate, to see how sharp each choice is. Where a
        method has a second rate, each learning rate shows its best candidate over the second rate, as
        :meth:`by_rate` does (the chosen one at the chosen rate)."""
        import pandas as pd

        rows = []
        for method, group in self.grid.groupby("method", sort=False):
            for lr, at in group.groupby("lr", sort=True):
                best = at[at["chosen"]] if at["chosen"].any() else at.sort_values("validation", ascending=False,
                                                                                  na_position="last")
                r = best.iloc[0]
                rows.append({"method": method, "lr": lr, "validation": r["validation"],
                             "validation_se": r["validation_se"], "chosen": bool(r["chosen"])})
        return pd.DataFrame(rows)

    def convergence(self) -> str:
        """A sentence for the page: the methods whose chosen rate's tuning runs do not converge (``converging``)."""
        if not self.converging:
            return "The tuning does not test whether its runs converge."
        chosen = self.grid[self.grid["chosen"]]
        stalled = chosen[~chosen["converges"].astype(bool)]
        if stalled.empty:
            return "Every method's chosen rate converged in the tuning."
        none = list(stalled["method"])
        horizons = sorted({int(r) for r in stalled["rounds"]})
        return (f"For {', '.join(none)}, no rate within one standard error of the best converged in the tuning's "
                f"{' or '.join(map(str, horizons))} rounds: {'it runs' if len(none) == 1 else 'they run'} at the "
                "plain rule's choice.")

    def unsound(self) -> dict[str, str]:
        """The methods none of whose candidates is sound, so that no rate could be chosen for them: every
        candidate had a seed diverge (no score) or degenerate (:func:`~fedlab_core.verdicts.degenerate`).
        Method -> why, for the page (how many candidates, and the first's reason)."""
        out: dict[str, str] = {}
        if self.grid.empty:
            return out
        for method, group in self.grid.groupby("method", sort=False):
            if not (group["validation"].isna() | (group["degenerate"] != "")).all():
                continue
            diverged = int(group["validation"].isna().sum())
            first = next((why for why in group["degenerate"] if why), "")
            parts = [f"{diverged} diverged"] if diverged else []
            if len(group) > diverged:
                parts.append(f"{len(group) - diverged} degenerate" + (f" (e.g. {first})" if first else ""))
            rounds = int(group["rounds"].iloc[0])
            out[method] = (f"all {len(group)} of its candidates in the {rounds}-round tuning failed: "
                           + ", ".join(parts))
        return out

    def table(self) -> "pd.DataFrame":
        """One row per method: its paper rate(s), the chosen ones, the factor and the validation score."""
        import pandas as pd

        rows = {}
        for method, group in self.grid.groupby("method", sort=False):
            best = group[group["chosen"]].iloc[0]
            row = {"paper lr": best["lr"] / best["factor"], "chosen lr": best["lr"], "factor": best["factor"],
                   "validation": best["validation"]}
            for name in self.names[1:]:
                if name in group and not pd.isna(best.get(name)):
                    row[f"chosen {name}"] = best[name]
            if self.absolute:
                row["lr tried"] = f"{group['lr'].min():g} to {group['lr'].max():g}"
                row["at an edge"] = ", ".join(edges(group, self.chosen[method])) or "no"
            if self.converging:
                row["converges"] = "yes" if best["converges"] else "no"
            rows[method] = row
        return pd.DataFrame.from_dict(rows, orient="index")


def edges(group: "pd.DataFrame", chosen: Mapping[str, float]) -> list[str]:
    """The rates of `chosen` that lie at the lowest or highest value tried for them in `group` (one method's
    rows of a tuning grid), as ``"lr low"``, ``"offset_lr high"``..."""
    out = []
    for name, value in chosen.items():
        tried = group[name].dropna()
        if len(set(tried)) > 1 and value in (tried.min(), tried.max()):
            out.append(f"{name} {'low' if value == tried.min() else 'high'}")
    return out


def beyond(values: list[float], side: str) -> float:
    """The next rate past the `side` ("low" or "high") edge of a grid, one step of the grid's own rhythm
    beyond it: the ratio two steps in from that edge (0.003, 0.01, 0.03 -> 0.001; 0.03, 0.1, 0.3 -> 1)."""
    v = sorted(values)
    if len(v) < 3:
        ratio = v[-1] / v[0] if len(v) == 2 else 10.0
    else:
        ratio = v[2] / v[1] if side == "low" else v[-2] / v[-3]
    return float(f"{(v[0] / ratio if side == 'low' else v[-1] * ratio):.6g}")


def _default(config: RunConfig, name: str) -> float:
    """The rate `name` the method of `config` uses when nothing overrides it."""
    if name == "lr":
        return config.training().lr
    params = dict(ALGORITHMS[config.algorithm](training=config.training()).__dict__)
    return float(params[name])


def candidates(config: RunConfig, grid=GRID, rates=None, second_rates=None) -> list[dict[str, float]]:
    """The rates to try for the method of `config`: its paper rate times each factor of `grid`, paired with
    its second rate's paper value times each of that rate's factors (:data:`SECOND_RATES`); or, with `rates`,
    those learning rates paired with the second rate's absolute grid (:data:`SECOND_RATE_GRIDS`, or
    `second_rates`, the same mapping as :func:`second_rate_grids` returns it)."""
    if rates is not None:
        second = SECOND_RATE_GRIDS if second_rates is None else second_rates
        axes = [("lr", tuple(rates))] + ([second[config.algorithm]] if config.algorithm in second else [])
    else:
        axes = [(name, tuple(_default(config, name) * f for f in factors))
                for name, factors in [("lr", grid)] + ([SECOND_RATES[config.algorithm]]
                                                       if config.algorithm in SECOND_RATES else [])]
    out = [{}]
    for name, values in axes:
        out = [{**c, name: v} for c in out for v in values]
    return out


def second_rate_grids(extra: Mapping[str, Sequence[Any]] | None = None) -> dict[str, tuple[str, tuple[float, ...]]]:
    """The absolute grids of the second rates: :data:`SECOND_RATE_GRIDS` with `extra`'s entries added or replacing
    theirs. `extra` maps an algorithm to ``(parameter, values)``, e.g. ``{"pfedme": ("personal_lr", (0.01, 0.03,
    0.09))}`` (pFedMe's inner rate, which its paper value of 0.09 leaves unstable on curved losses); checked before
    any run: the algorithm must exist, the parameter be one of its rates, and the values distinct and in its range.
    Raises a ValueError that starts with ``second_rates``."""
    out = dict(SECOND_RATE_GRIDS)
    for algorithm, entry in (extra or {}).items():
        if algorithm not in ALGORITHMS:
            raise ValueError(f"second_rates: unknown algorithm {algorithm!r}; choose from {', '.join(sorted(ALGORITHMS))}")
        if not (isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) == 2
                and isinstance(entry[0], str) and isinstance(entry[1], Sequence) and not isinstance(entry[1], str)):
            raise ValueError(f"second_rates: {algorithm}'s entry must be (parameter, [values]); got {entry!r}")
        name, values = entry[0], tuple(entry[1])
        rates = [n for n, c in ALGORITHMS[algorithm].constraints.items() if n.endswith("lr")]
        if name == "lr" or name not in rates:
            raise ValueError(f"second_rates: {algorithm} has no second rate {name!r}; its rates: "
                             + (", ".join(rates) or "none"))
        if not values or len(set(values)) != len(values):
            raise ValueError(f"second_rates: {algorithm}'s {name} needs one or more distinct values; got {list(values)}")
        for v in values:
            ALGORITHMS[algorithm].check_params({name: v}, "second_rates")
        out[algorithm] = (name, tuple(float(v) for v in values))
    return out


def tune(base: RunConfig, methods: Mapping[str, Mapping[str, Any]], rounds: int, seeds: Sequence[int] = (0,),
         grid=GRID, validation: float = VALIDATION, metric: str = METRIC, rates=None, widen: int = 2,
         eval_every: int | None = None, converging: bool = False,
         second_rates: Mapping[str, Sequence[Any]] | None = None, **sweep_kwargs) -> Tuning:
    """Tune every method of a benchmark on its validation split.

    Parameters
    ----------
    base : the benchmark's config as the chapters run it (dataset, split, model, scale), rate unset; its
        other training fields, where set, are kept (the chapter's deliberate choices, e.g. local epochs).
    methods : label -> the config changes that make the method (``{"algorithm": "fedprox"}``); a method whose
        changes set ``num_rounds`` is tuned at that horizon instead of `rounds` (a chapter that gives some of its
        cells a longer horizon tunes them there).
    rounds : rounds of every candidate run (the horizon of the chapters' runs).
    seeds : the tuning seeds, each a run per candidate (:data:`SEEDS`: none a chapter evaluates on).
    grid, validation, metric : see the module docstring.
    eval_every : evaluate every this many rounds (None: every tenth of the rounds with `rates`, else only the
        last round).
    rates : the absolute grid (e.g. :data:`RATES`); None: the relative `grid`.
    widen : with `rates`, how many times a rate chosen at an edge of the values tried is answered with the next
        value beyond it.
    converging : among the candidates within one standard error of the best, those whose mean validation curve
        converges come first (needs `rates`: its runs are evaluated :data:`EVALUATIONS` times).
    second_rates : with `rates`, second rates tuned beside those of :data:`SECOND_RATE_GRIDS`: algorithm ->
        ``(parameter, values)`` (:func:`second_rate_grids`); each tried with every learning rate.
    sweep_kwargs : for :func:`~fedlab_core.sweeps.sweep` (``max_workers``, ``cache_dir``...).
    """
    import pandas as pd

    from .verdicts import degenerate, score

    if base.lr is not None:
        raise ValueError(f"lr: a tuned benchmark leaves the rate to the tuning; got {base.lr!r}")
    if converging and rates is None:
        raise ValueError("converging: the convergence test needs a curve; tune on the absolute grid (rates=RATES)")
    if second_rates and rates is None:
        raise ValueError("second_rates: absolute grids of second rates need the absolute grid (rates=RATES)")
    second = second_rate_grids(second_rates)
    seeds = tuple(seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: give one or more distinct tuning seeds; got {list(seeds)}")
    horizons = {label: changes.get("num_rounds", rounds) for label, changes in methods.items()}
    configs = {label: base.replace(**{**changes, "num_rounds": horizons[label]}, seed=seeds[0], validation=validation,
                                   eval_every=eval_every or (horizons[label] if rates is None
                                                             else max(1, horizons[label] // EVALUATIONS)))
               for label, changes in methods.items()}
    todo = [(label, c) for label, config in configs.items() for c in candidates(config, grid, rates, second)]
    names = ("lr", *dict.fromkeys(n for _, c in todo for n in c if n != "lr"))
    rows: list[dict[str, Any]] = []
    for _ in range(1 + (widen if rates is not None else 0)):
        histories = iter(sweep([_with_rates(configs[label], c).replace(seed=s) for label, c in todo for s in seeds],
                               **sweep_kwargs))
        for label, c in todo:
            runs = [next(histories) for _ in seeds]
            values = np.array([(h.final[metric] if rates is None else score(h, metric)) for h in runs], dtype=float)
            rows.append({"method": label, "rounds": horizons[label], **c,
                         "factor": c["lr"] / _default(configs[label].replace(lr=None), "lr"),
                         "validation": float(values.mean()),
                         "validation_se": float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1
                         else math.nan,
                         "converges": rates is not None and _mean_curve_converges(runs, metric),
                         "degenerate": next((f"seed {h.config['seed']} {why}" for h in runs
                                             if (why := degenerate(h, metric))), ""),
                         "seconds": sum(h.meta["seconds"] for h in runs)})
        frame = pd.DataFrame(rows)
        chosen = _choose(frame, names, converging)
        if rates is None:
            break
        todo = []
        for label, group in frame.groupby("method", sort=False):
            for edge in edges(group, chosen[label]):
                name, side = edge.split()
                c = {**chosen[label], name: beyond(list(group[name].dropna().unique()), side)}
                todo.append((label, c))
        if not todo:
            break
    frame["chosen"] = [all(r[k] == chosen[r["method"]][k] for k in chosen[r["method"]]) for _, r in frame.iterrows()]
    return Tuning(frame, chosen, rounds, seeds, validation, absolute=rates is not None, converging=converging,
                  names=names)


def _mean_curve_converges(runs: Sequence[Any], metric: str) -> bool:
    """Whether the mean over seeds of the runs' `metric` curves passes the convergence test (False when a run
    diverged or their evaluated rounds differ)."""
    from .verdicts import curve

    mean = mean_curve([curve(h, metric) for h in runs])
    return mean is not None and plateaued(mean)


def _choose(frame: "pd.DataFrame", names: Sequence[str] = ("lr",), converging: bool = False
            ) -> dict[str, dict[str, float]]:
    """Per method, the one-standard-error rule: of the candidates whose mean validation score lies within one
    standard error of the best mean, the smallest learning rate, then the smallest second rate (the rates are the
    columns `names`, in that order). With one seed (no standard error): the best score; ties go to the rate nearest
    the paper's (|log factor| smallest), then the smaller rate. A candidate with a diverged seed (NaN) is never chosen while another is not, nor one with a
    degenerate seed (column ``degenerate``: :func:`~fedlab_core.verdicts.degenerate`, e.g. a model answering each
    client with its own class) while a candidate without one remains. With `converging`, the candidates that
    converge (column ``converges``) come first among those within one standard error of the best."""
    import pandas as pd

    chosen = {}
    for label, group in frame.groupby("method", sort=False):
        sound = group[group["degenerate"] == ""] if "degenerate" in group else group
        group = sound if len(sound) else group
        order = group.assign(distance=group["factor"].map(lambda f: abs(math.log(f))),
                             stalls=~group["converges"].astype(bool) if converging else False)
        order = order.sort_values(["validation", "distance", "lr"], ascending=[False, True, True], na_position="last")
        best = order.iloc[0]
        if not pd.isna(best["validation_se"]):
            near = order[order["validation"] >= best["validation"] - best["validation_se"]]
            best = near.sort_values(["stalls", *(n for n in names if n in near)]).iloc[0]
        chosen[label] = {name: float(best[name]) for name in names if name in group and not pd.isna(best[name])}
    return chosen


def _with_rates(config: RunConfig, rates: Mapping[str, float]) -> RunConfig:
    """`config` with the rates set: ``lr`` as a field, a second rate as an algorithm parameter."""
    params = {k: v for k, v in rates.items() if k != "lr"}
    return config.replace(**({"lr": rates["lr"]} if "lr" in rates else {}),
                          algorithm_params={**config.algorithm_params, **params})


def flow_label(key: tuple[str, str]) -> str:
    """The tuning label of an (algorithm, flow) key, e.g. ``("fedavg", "+ FedRDN")`` -> ``"fedavg | + FedRDN"``."""
    return f"{key[0]} | {key[1]}"


def per_flow(algorithms: Mapping[str, Mapping[str, Any]], flows: Mapping[str, Mapping[str, Any]]
             ) -> dict[str, dict[str, Any]]:
    """Every (algorithm, flow) pair as a method of its own, for :func:`tune`: label (:func:`flow_label`) -> the
    config changes of both. A flow that changes the inputs' scale changes the rate an algorithm needs (inputs
    standardised per channel are about three times those in [0, 1]), so each flow is tuned on its own; apply
    the choice with ``tuned_configs(configs, tuning, method_of=flow_label)`` on configs keyed (algorithm, flow)."""
    return {flow_label((a, f)): {**changes, **flow} for a, changes in algorithms.items() for f, flow in flows.items()}


def with_horizons(algorithms: Mapping[str, Mapping[str, Any]], horizons: Mapping[str, int]
                  ) -> dict[str, Mapping[str, Any]]:
    """The config changes of each algorithm, with ``num_rounds`` set where `horizons` (algorithm -> rounds) gives
    it a longer horizon: :func:`tune` then tunes it there, and every flow of it (:func:`per_flow`) alike."""
    return {a: {**changes, "num_rounds": horizons[a]} if a in horizons else changes for a, changes in algorithms.items()}


def horizon_label(method: str, rounds: int | None = None) -> str:
    """The label :func:`at_horizons` tunes `method` under at a longer horizon of `rounds` (None: its own)."""
    return method if rounds is None else f"{method} at {rounds} rounds"


def at_horizons(methods: Mapping[str, Mapping[str, Any]], horizons: Mapping[Any, int]) -> dict[str, Mapping[str, Any]]:
    """The methods to tune where some cells of a page (`horizons`: cell -> rounds, e.g. a DH level) train for longer:
    each method as given, and once more for each distinct horizon, labelled :func:`horizon_label` and with
    ``num_rounds`` set, so that :func:`tune` tunes it there and a cell takes the rates of its own horizon
    (``method_of`` of :func:`tuned_configs`: ``horizon_label(method, horizons.get(cell))``)."""
    return {**methods, **{horizon_label(m, rounds): {**changes, "num_rounds": rounds}
                          for rounds in sorted(set(horizons.values())) for m, changes in methods.items()}}


def tuned_configs(configs: Mapping[Any, Any], tuning: Tuning, method_of=lambda key: key,
                  regimes: Mapping[str, Tuning] | None = None) -> tuple[dict[Any, Any], dict[Any, set[str]]]:
    """Apply the tuned rates to each config, except those its chapter set on purpose.

    Parameters
    ----------
    configs : key -> a config, or a list of configs (e.g. one per seed, as :func:`~fedlab_core.sweeps.grid`
        makes them); ``method_of(key)`` names the method in ``tuning.chosen`` (a method that was not tuned
        keeps its paper rates).
    regimes : :func:`regime` -> the tuning of that regime: a config whose regime is here takes that tuning's
        choice instead of `tuning`'s (e.g. one class per client tuned on its own benchmark,
        :func:`one_class_per_client`).

    Returns (the configs, key -> the names of the settings that came from the tuning).
    """
    unknown = set(regimes or {}) - set(REGIMES)
    if unknown:
        raise ValueError(f"regimes: unknown regime {sorted(unknown)[0]!r}; choose from {', '.join(map(repr, REGIMES))}")
    out, tuned = {}, {}
    for key, value in configs.items():

        def apply(config: RunConfig) -> RunConfig:
            chosen = (regimes or {}).get(regime(config), tuning).chosen.get(method_of(key), {})
            rates = {name: rate for name, rate in chosen.items()
                     if (config.lr is None if name == "lr" else name not in config.algorithm_params)}
            tuned[key] = set(rates)
            return _with_rates(config, rates)
        out[key] = [apply(c) for c in value] if isinstance(value, list) else apply(value)
    return out, tuned


def unsound_cells(configs: Mapping[Any, Any], tuning: Tuning, method_of=lambda key: key,
                  regimes: Mapping[str, Tuning] | None = None) -> dict[Any, str]:
    """The cells to drop before any evaluation run, decided on the tuning alone: key -> why, for each key of
    `configs` (as :func:`tuned_configs` takes them) whose method has no sound candidate in its regime's tuning
    (:meth:`Tuning.unsound`). Its runs could only decide a claim on a rate known to fail, so they are not run;
    a method that was not tuned is kept."""
    out = {}
    for key, value in configs.items():
        first = value[0] if isinstance(value, list) else value
        tuning_here = (regimes or {}).get(regime(first), tuning)
        why = tuning_here.unsound().get(method_of(key))
        if why is not None:
            out[key] = f"{method_of(key)} ({regime(first)}): {why}"
    return out


def label_skew(model: str, num_clients: int, max_train_samples: int, max_test_samples: int, local_epochs: int | None,
               batch_size: int | None, dataset: str = "fashion_mnist") -> RunConfig:
    """The label-skew benchmark as the chapters run it: the DisTrans split at DH 0.8 (the level it is tuned
    at; the chapters change the partition), every method's rate left to the tuning.

    `local_epochs` and `batch_size` are the book's protocol, the same for every method (its compute per
    round); each method keeps its paper's optimiser, momentum and weight decay.
    """
    return RunConfig(dataset=dataset, model=model, num_clients=num_clients, max_train_samples=max_train_samples,
                     max_test_samples=max_test_samples, partition="distrans", dh=0.8, local_epochs=local_epochs,
                     local_steps=0 if local_epochs else None, batch_size=batch_size)


def one_class_per_client(model: str, num_clients: int, max_train_samples: int, max_test_samples: int,
                         local_epochs: int | None, batch_size: int | None, dataset: str = "fashion_mnist") -> RunConfig:
    """The one-class-per-client benchmark: :func:`label_skew`'s with every client holding one class (positive
    labels). Its tuning's validation data, like its test data, hold as many negatives as positives
    (:func:`~fedlab_core.data.federation.hold_out`), so a model answering every image with its client's class
    scores 0.5 there and is degenerate (:func:`tune` passes over it)."""
    return label_skew(model, num_clients, max_train_samples, max_test_samples, local_epochs, batch_size,
                      dataset).replace(partition="one_class", dh=None)


REGIMES = ("label skew", "feature skew", "one class per client")   # the regimes a tuning is per


def regime(config: RunConfig) -> str:
    """The regime of :data:`REGIMES` a config's split belongs to: one class per client (scheme ``one_class``),
    feature skew (the domain split), else label skew."""
    return {"one_class": "one class per client", "domain": "feature skew"}.get(config.partition, "label skew")


def feature_skew(model: str, samples_per_domain: int, test_per_domain: int, local_epochs: int | None,
                 batch_size: int | None, dataset: str = "fashion_mnist_domains",
                 dataset_params: Mapping[str, Any] | None = None, num_clients: int = 5) -> RunConfig:
    """The feature-skew benchmark as the chapters run it: one client per domain (five synthetic styles of
    Fashion-MNIST, `samples_per_domain` training images each, or a folder dataset with `dataset_params` and
    as many clients as it has domains), every method's rate left to the tuning; the protocol fields as in
    :func:`label_skew`."""
    params = dict(dataset_params) if dataset_params is not None else \
        {"samples_per_domain": samples_per_domain, "test_per_domain": test_per_domain}
    return RunConfig(dataset=dataset, dataset_params=params, partition="domain", num_clients=num_clients, model=model,
                     max_train_samples=0, max_test_samples=0, local_epochs=local_epochs,
                     local_steps=0 if local_epochs else None, batch_size=batch_size)


#: The book's named settings: the benchmark each belongs to, and its changes from that benchmark's base config
#: (:func:`label_skew` or :func:`feature_skew`).
SETTINGS = {"IID": ("label skew", {"partition": "iid", "dh": None}),
            "Dir(0.5)": ("label skew", {"partition": "dirichlet", "alpha": 0.5, "dh": None}),
            "Dir(0.1)": ("label skew", {"partition": "dirichlet", "alpha": 0.1, "dh": None}),
            "DH 0.8": ("label skew", {}),
            "feature skew": ("feature skew", {})}


def named_settings(field: str, names: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """The settings of :data:`SETTINGS` a chapter's parameter `field` names, in its order; an unknown name
    fails before any work, in one line naming the field."""
    for name in names:
        if name not in SETTINGS:
            raise ValueError(f"{field}: unknown setting {name!r}; choose from {', '.join(map(repr, SETTINGS))}")
    return {name: SETTINGS[name] for name in names}


def settings_table(configs: Mapping[Any, RunConfig], tuned: Mapping[Any, set[str]] | None = None) -> "pd.DataFrame":
    """The exact local training and method parameters of each config, and where each value comes from.

    One row per key, four columns: the rate, the local work per round (epochs or steps, batch size), the
    optimiser (with its momentum and weight decay) and the method's own parameters. Every value is
    followed by its source: "chapter" (set in the config on purpose), "tuned" (chosen by :func:`tune`) or
    "paper" (the method's paper default); "chapter/paper" where the fields of one column come from both.
    """
    import pandas as pd

    rows = {}
    for key, config in configs.items():
        from_tuning = (tuned or {}).get(key, set())
        t = config.training()

        def source(*names: str) -> str:
            kinds = {"tuned" if n in from_tuning else "chapter" if getattr(config, n) is not None else "paper"
                     for n in names}
            return "/".join(sorted(kinds, key=["chapter", "tuned", "paper"].index))

        work = f"{t.local_steps} steps" if t.local_steps else f"{t.local_epochs} epoch{'s' * (t.local_epochs != 1)}"
        transform = "" if t.train_transform == "none" else f", {t.train_transform.replace('_', ' and ')}"
        optimiser = t.optimizer + (f", momentum {t.momentum:g}" if t.momentum else "") + \
            (f", weight decay {t.weight_decay:g}" if t.weight_decay else "")
        params = ", ".join(f"{k}={v:g} ({'tuned' if k in from_tuning else 'chapter'})" if isinstance(v, float)
                           else f"{k}={v} (chapter)" for k, v in config.algorithm_params.items())
        rows[key] = {"lr": f"{t.lr:g} ({source('lr')})",
                     "local work per round": f"{work}, batch {t.batch_size}{transform} "
                                             f"({source('local_epochs', 'local_steps', 'batch_size', 'train_transform')})",
                     "optimiser": f"{optimiser} ({source('optimizer', 'momentum', 'weight_decay')})",
                     "method parameters": params or "paper defaults"}
    return pd.DataFrame.from_dict(rows, orient="index")
