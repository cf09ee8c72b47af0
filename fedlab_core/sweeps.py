"""Many runs: grids of configs, sweeps in parallel processes or on a Ray cluster, and their summaries.

``sweep(configs)`` runs configs side by side (``backend="local"``: a process pool, one torch thread per
process; ``backend="ray"``: the cluster at ``$RAY_ADDRESS``), each through :func:`fedlab_core.runs.run`, so
cached and archived runs are read, not recomputed. :func:`grid` builds the configs of every combination of
labelled changes; :func:`summarize`, :func:`mean_std_table`, :func:`group_frames` and :func:`per_round_mean`
turn the results into the book's tables and frames.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch

from .parallel import end_with_parent
from .progress import Report
from .runs import RunConfig, is_measured, measured, resolve_device, run, run_many, stored, together
from .store import History
from .verdicts import mean_std, two_looks

if TYPE_CHECKING:  # pandas loads when a table is first asked for
    import pandas as pd

    from .verdicts import Verdict


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


def measured_groups(name: str, groups: Mapping[Any, list[RunConfig]], measure: Callable, *,
                    settings: Mapping[str, Any] | None = None, sources: tuple[str, ...] = (),
                    **sweep_kwargs) -> dict[Any, list[Any]]:
    """:func:`~fedlab_core.runs.measured` on every run of every group, grouped the same way. The runs not yet
    measured are first run side by side (:func:`sweep`, keeping their final states in the cache), so that
    nothing is trained twice; the measured ones need neither their state nor their run."""
    where = {k: sweep_kwargs[k] for k in ("cache_dir", "device") if k in sweep_kwargs}
    missing = [c for configs in groups.values() for c in configs
               if not is_measured(name, c, settings=settings, sources=sources, **where)]
    if missing:
        sweep(missing, keep_state=True, **sweep_kwargs)
    return {key: [measured(name, c, measure, settings=settings, sources=sources, **where) for c in configs]
            for key, configs in groups.items()}


UNCONVERGED_MARK = "†"   # mean_std_table's mark on a cell with a run that did not pass the convergence test


def mean_std_table(summary: pd.DataFrame, metric: str = "global_accuracy", rows=None, columns=None,
                   mark_unconverged: bool = False) -> pd.DataFrame:
    """A :func:`summarize` frame keyed by (row, column) labels as a table of ``"mean ± std"`` strings
    (:func:`~.verdicts.mean_std`).

    A cell without a number says why: "no global model" (global accuracy of a method that has none) or
    "diverged" (a run that stopped on a non-finite loss). With `mark_unconverged`, a cell whose runs did not
    pass the convergence test (their mean curve over the seeds) ends with :data:`UNCONVERGED_MARK`."""
    text = summary[metric].combine(summary[f"{metric}_std"], mean_std)
    if mark_unconverged:
        text = text.where(summary["converged"], text + " " + UNCONVERGED_MARK)
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
    accuracy), ``dh``, ``global_model`` (whether the method has one), ``seeds``, ``converged`` (whether the
    runs' client-accuracy curves, validation where monitored, pass the convergence test on their mean over the
    seeds: :func:`~fedlab_core.verdicts.runs_converged`).
    """
    import numpy as np

    from .verdicts import runs_converged

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
                       "global_model": runs[0].meta["global_model"], "seeds": len(runs),
                       "converged": runs_converged(runs)}
    import pandas as pd

    return pd.DataFrame.from_dict(rows, orient="index")


def second_look(judge: Callable[..., "Verdict"], *sides: Sequence[History] | Mapping[str, Sequence[History]],
                more_seeds: Iterable[int] = range(5, 10), looks: int = 2, **sweep_kwargs) -> "Verdict":
    """The rule's second look at a claim (:mod:`fedlab_core.verdicts`): ``judge(*sides, looks=2)`` on the runs
    given (five seeds); when only its interval left it undecided (:attr:`Verdict.straddles`), the same configs
    at `more_seeds` are run (or read from the archive) and the claim is judged again on every seed, still with
    two looks, so the two looks together keep the rule's error rate. A claim the first look decided carries that
    look as :attr:`Verdict.more`, taken by :meth:`Verdicts.second_looks` if Holm's adjustment over its family
    undoes the decision. A side is a method's runs, or a mapping of them (the rivals of
    :func:`~fedlab_core.verdicts.beats_every`). `judge` is e.g. ``functools.partial(verdicts.beats,
    claim="...")``; `sweep_kwargs` go to :func:`sweep`. ``looks=1``: one look, no seeds added
    (``judge(*sides)``), for a profile whose claims were planned without a second look."""
    more_seeds = list(more_seeds)

    def again() -> "Verdict":
        lists = [runs for side in sides for runs in (side.values() if isinstance(side, Mapping) else [side])]
        extra = [[RunConfig(**runs[0].config).replace(seed=s) for s in more_seeds] for runs in lists]
        added = iter(sweep([c for configs in extra for c in configs], **sweep_kwargs))
        grown = iter([[*runs, *(next(added) for _ in configs)] for runs, configs in zip(lists, extra)])
        return judge(*({name: next(grown) for name in side} if isinstance(side, Mapping) else next(grown)
                       for side in sides), looks=2)

    return two_looks(lambda looks: judge(*sides) if looks == 1 else judge(*sides, looks=looks), again, looks)


def _run_one_thread(config: RunConfig, kwargs: dict[str, Any]) -> History:
    torch.set_num_threads(1)
    return run(config, **kwargs, workers=1)  # a sweep's parallelism is its runs side by side: no nested pools


class BudgetSpent(RuntimeError):
    """The time budget of a chunked computation ($FEDLAB_DEADLINE) ran out; finished runs are stored."""


def _on_gpu(configs: list[RunConfig], missing: list[int], results: list[History | None], deadline: float,
            run_kwargs: dict[str, Any]) -> list[History]:
    """:func:`sweep`'s missing runs on a GPU: the runs that can be trained together (:func:`run_many`'s groups: a
    grid's rates and seeds) trained as one batched program each, one group after another, in this process."""
    groups = together(configs, missing)
    report = Report(configs, missing, 1, lines=True, place="one GPU (priced from CPU runs until the first group ends)")
    for n, group in enumerate(groups):
        if time.time() >= deadline:
            raise BudgetSpent(f"FEDLAB_DEADLINE: the time budget ran out with {len(groups) - n} of {len(groups)} "
                              "groups of runs of this sweep left; the finished ones are stored, so the same command "
                              "continues")
        for i in group:
            report.start(i)
        for i, history in zip(group, run_many([configs[i] for i in group], **run_kwargs)):
            results[i] = history
            report.finish(i, share=1 / len(group))
    return results


def sweep(configs: Iterable[RunConfig], backend: str | None = None, max_workers: int | None = None,
          **run_kwargs) -> list[History]:
    """Run many configs in parallel; results come back in the order given.

    backend : "local" (a process pool, one torch thread per worker, `max_workers` defaulting to the
        number of cores) or "ray" (tasks of one CPU each on the cluster at $RAY_ADDRESS, or a local
        Ray instance when none is set); None: $FEDLAB_BACKEND, else "local".
    run_kwargs : passed to :func:`run` (cache_dir, device, ...). Runs the archive or the cache holds are read
        here, not re-run; the others are computed, and their progress reported as they go: the count and an
        estimate before they start, a bar on a terminal, elsewhere a line as each ends (:mod:`.progress`). A run that diverges
        is recorded with NaN metrics (``on_diverge="record"``) unless told otherwise.

    On a GPU (``device`` "cuda", or "auto" where CUDA is present) the runs are computed in this process, those that
    share a model, method and data (seeds, rates) trained together as one batched program (:func:`run_many`).

    With ``$FEDLAB_DEADLINE`` set (a Unix time), no run starts after it: the runs in flight finish (and are
    stored), then :class:`BudgetSpent` is raised, so a long computation proceeds in chunks.
    """
    from tqdm import tqdm

    configs = list(configs)
    backend = backend or os.environ.get("FEDLAB_BACKEND") or "local"
    if "workers" in run_kwargs:
        raise ValueError("workers: a sweep runs its configs side by side, one process each, and each run in its "
                         "process; give max_workers for the number of runs at a time")
    if backend not in ("local", "ray"):
        raise ValueError(f"backend: unknown value {backend!r}; allowed: local, ray")
    run_kwargs.setdefault("progress", False)
    run_kwargs.setdefault("on_diverge", "record")  # one diverging run must not sink the sweep
    results: list[History | None] = [None] * len(configs)
    if run_kwargs.get("use_cache", True):
        lookup = {k: run_kwargs[k] for k in ("cache_dir", "device", "keep_state") if k in run_kwargs}
        results = [stored(c, **lookup) for c in configs]
    missing = [i for i, h in enumerate(results) if h is None]
    if not missing:
        return results
    deadline = float(os.environ.get("FEDLAB_DEADLINE") or "inf")
    if resolve_device(run_kwargs.get("device", "auto")).type == "cuda":
        return _on_gpu(configs, missing, results, deadline, run_kwargs)
    bar = tqdm(total=len(missing), desc=f"computing {len(missing)} of {len(configs)} runs", unit="run",
               disable=None)  # on a terminal only; elsewhere (a notebook, a log) the report prints lines
    if backend == "ray":
        import ray

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        report = Report(configs, missing, int(ray.cluster_resources().get("CPU", 1)), lines=bar.disable)
        task = ray.remote(num_cpus=1)(_run_one_thread)
        pending = {task.remote(configs[i], run_kwargs): i for i in missing}
        for i in missing:
            report.start(i)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(done[0])
            results[i] = ray.get(done[0])
            report.finish(i)
            bar.update(1)
        bar.close()
        return results
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    workers = max_workers or os.cpu_count() or 1
    report = Report(configs, missing, workers, lines=bar.disable)
    queue = list(missing)
    # the workers end with this process: a chapter or sweep stopped by SIGTERM (or its kernel shut down) leaves no
    # run computing behind it
    with bar, ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"), initializer=end_with_parent,
                                  initargs=(os.getpid(),)) as pool:
        flying = {}
        try:
            while queue or flying:
                while queue and len(flying) < workers and time.time() < deadline:
                    i = queue.pop(0)
                    flying[pool.submit(_run_one_thread, configs[i], run_kwargs)] = i
                    report.start(i)
                if not flying:
                    raise BudgetSpent(f"FEDLAB_DEADLINE: the time budget ran out with {len(queue)} of {len(configs)} "
                                      "runs of this sweep left; the finished ones are stored, so the same command "
                                      "continues")
                done, _ = wait(flying, return_when=FIRST_COMPLETED)
                for future in done:
                    i = flying.pop(future)
                    results[i] = future.result()
                    report.finish(i)
                    bar.update(1)
        except KeyboardInterrupt:   # interrupted (SIGINT, a notebook's stop button): the runs in flight end now,
            for process in list(pool._processes.values()):   # not when they would have finished (the pool's own
                process.terminate()                          # shutdown waits for them)
            raise
    return results
