"""Many runs: grids of configs, sweeps in parallel processes or on a Ray cluster, and their summaries.

``sweep(configs)`` runs configs side by side (``backend="local"``: a process pool, one torch thread per
process; ``backend="ray"``: the cluster at ``$RAY_ADDRESS``), each through :func:`fedlab_core.runs.run`, so
cached and archived runs are read, not recomputed. :func:`grid` builds the configs of every combination of
labelled changes; :func:`summarize`, :func:`mean_std_table`, :func:`group_frames` and :func:`per_round_mean`
turn the results into the book's tables and frames.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch

from .runs import RunConfig, run
from .store import History

if TYPE_CHECKING:  # pandas loads when a table is first asked for
    import pandas as pd


def grid(base: RunConfig, axes: Mapping[str, Mapping[str, Mapping[str, Any]]], seeds: Iterable[int]
         ) -> dict[Any, list[RunConfig]]:
    """Configs for every combination of labelled changes, one per seed.

    ``axes`` maps an axis name to ``{label: changes to the config}``; the result maps the tuple of labels
    (a single label when there is one axis) to the configs of every seed. Later axes win on conflicts.
    """
    import itertools

    seeds = list(seeds)
    out: dict[Any, list[RunConfig]] = {}
    for combo in itertools.product(*(list(axis.items()) for axis in axes.values())):
        changes: dict[str, Any] = {}
        for _, change in combo:
            changes.update(change)
        label = tuple(name for name, _ in combo)
        out[label if len(label) > 1 else label[0]] = [base.replace(seed=s, **changes) for s in seeds]
    return out


def sweep_groups(groups: Mapping[Any, list[RunConfig]], **sweep_kwargs) -> dict[Any, list[History]]:
    """:func:`sweep` over every config of every group; the histories come back grouped the same way."""
    results = iter(sweep([c for configs in groups.values() for c in configs], **sweep_kwargs))
    return {key: [next(results) for _ in configs] for key, configs in groups.items()}


def mean_std_table(summary: pd.DataFrame, metric: str = "global_accuracy", rows=None, columns=None) -> pd.DataFrame:
    """A :func:`summarize` frame keyed by (row, column) labels as a table of ``"mean ± std"`` strings.

    A cell without a number says why: "no global model" (global accuracy of a method that has none) or
    "diverged" (a run that stopped on a non-finite loss)."""
    text = summary[metric].map("{:.3f}".format) + " ± " + summary[f"{metric}_std"].map("{:.3f}".format)
    missing = summary[metric].isna()
    why = summary["global_model"].map({True: "diverged", False: "no global model"}) if metric.startswith("global") \
        else summary["global_model"].map(lambda _: "diverged")
    text[missing] = why[missing]
    return text.unstack().reindex(index=rows, columns=columns).fillna("—")  # —: not run in this setting


def group_frames(groups: Mapping[str, list[History]]) -> dict[str, pd.DataFrame]:
    """``{label: one frame of every seed's rounds}``, the form the plotting helpers take."""
    import pandas as pd

    return {label: pd.concat([h.frame() for h in runs], ignore_index=True) for label, runs in groups.items()}


def per_round_mean(runs: Iterable[History], column: str) -> float:
    """The mean of a per-round log column (``bytes_up``, ``train_seconds``, ...) over every round of the runs."""
    import numpy as np

    return float(np.mean([r[column] for h in runs for r in h.rounds]))


def summarize(groups: Mapping[str, list[History]]) -> pd.DataFrame:
    """Final metrics per label over its seeds: mean, std (population), min and max, and the seed count.

    Columns: ``global_accuracy`` (mean/std/min/max; NaN for a method without a global model),
    ``mean_client_accuracy`` (mean/std), ``worst_client_accuracy`` (mean of each run's lowest client
    accuracy), ``dh``, ``global_model`` (whether the method has one), ``seeds``.
    """
    import numpy as np

    rows = {}
    for label, runs in groups.items():
        acc = np.array([h.final["global_accuracy"] for h in runs], dtype=float)
        client = np.array([h.final["mean_client_accuracy"] for h in runs], dtype=float)
        clients = [np.array(h.final["client_accuracy"], dtype=float) for h in runs]
        worst = [np.nanmin(a) if not np.isnan(a).all() else np.nan for a in clients]  # all NaN: diverged
        rows[label] = {"global_accuracy": acc.mean(), "global_accuracy_std": acc.std(),
                       "global_accuracy_min": acc.min(), "global_accuracy_max": acc.max(),
                       "mean_client_accuracy": client.mean(), "mean_client_accuracy_std": client.std(),
                       "worst_client_accuracy": float(np.mean(worst)), "dh": runs[0].meta["dh"],
                       "global_model": runs[0].meta["global_model"], "seeds": len(runs)}
    import pandas as pd

    return pd.DataFrame.from_dict(rows, orient="index")


def _run_one_thread(config: RunConfig, kwargs: dict[str, Any]) -> History:
    torch.set_num_threads(1)
    return run(config, **kwargs, workers=1)  # a sweep's parallelism is its runs side by side: no nested pools


def sweep(configs: Iterable[RunConfig], backend: str = "local", max_workers: int | None = None,
          **run_kwargs) -> list[History]:
    """Run many configs in parallel; results come back in the order given.

    backend : "local" (a process pool, one torch thread per worker, `max_workers` defaulting to the
        number of cores) or "ray" (tasks of one CPU each on the cluster at $RAY_ADDRESS, or a local
        Ray instance when none is set).
    run_kwargs : passed to :func:`run` (cache_dir, device, ...). Cached results are not re-run. A run
        that diverges is recorded with NaN metrics (``on_diverge="record"``) unless told otherwise.
    """
    configs = list(configs)
    if "workers" in run_kwargs:
        raise ValueError("workers: a sweep runs its configs side by side, one process each, and each run in its "
                         "process; give max_workers for the number of runs at a time")
    if backend not in ("local", "ray"):
        raise ValueError(f"backend: unknown value {backend!r}; allowed: local, ray")
    run_kwargs.setdefault("progress", False)
    run_kwargs.setdefault("on_diverge", "record")  # one diverging run must not sink the sweep
    if backend == "ray":
        import ray

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        task = ray.remote(num_cpus=1)(_run_one_thread)
        return ray.get([task.remote(c, run_kwargs) for c in configs])
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    workers = max_workers or os.cpu_count() or 1
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(_run_one_thread, configs, [run_kwargs] * len(configs)))
