"""What a sweep says while it computes: how many runs, how long they should take, which are computing, and the
time left, where a progress bar cannot be seen (a notebook executing under papermill or the book's build, a log).

Estimates come from the archive: every archived run records its own seconds, so a run to compute is priced at the
median rate (seconds per image-epoch of local training) of archived runs of the same method, model and dataset,
falling back to the same method, then to every run. The lines start with ``runs:``, so the book's build can show
them on its terminal and keep them off the pages.
"""
from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .store import Archive

if TYPE_CHECKING:
    from .runs import RunConfig

PREFIX = "runs: "
SETUP = 5.0   # seconds a run spends outside training: its process, its data, its model


def _work(config: dict[str, Any], train: float) -> float:
    """Image-epochs of local training a run of `config` does per round, given its training images."""
    if config.get("local_steps"):
        return (config.get("num_clients") or 10) * config["local_steps"] * (config.get("batch_size") or 32)
    return train * (config.get("local_epochs") or 1)   # None: the method's own, one epoch in most


def _groups(config: dict[str, Any]) -> tuple[tuple, ...]:
    """The keys a run's rate is looked up under, most specific first."""
    method = (config.get("algorithm", "fedavg"), config.get("augment", "none"))
    return (*((method, config.get("model", "auto"), config.get("dataset", "fashion_mnist")),), (method,), ())


@functools.lru_cache(maxsize=4)
def _rates(folder: Path, stamp: float) -> tuple[dict[tuple, float], dict[str, float]]:
    """(group -> median seconds per image-epoch, dataset -> median training images) over the archived runs in
    `folder`; `stamp` (the folder's modification time) renews the cache when runs are added."""
    rates: dict[tuple, list[float]] = {}
    images: dict[str, list[float]] = {}
    for _, h in Archive(folder).entries():
        train, rounds, seconds = h.meta.get("samples", {}).get("train"), len(h.rounds), h.meta.get("seconds")
        if not (train and rounds and seconds):
            continue
        config = {**h.config, "max_train_samples": train}
        images.setdefault(config.get("dataset", "fashion_mnist"), []).append(train)
        for group in _groups(config):
            rates.setdefault(group, []).append(seconds / (rounds * _work(config, train)))
    return ({g: statistics.median(r) for g, r in rates.items()},
            {d: statistics.median(n) for d, n in images.items()})


def estimate(configs: Sequence["RunConfig"], archive: Archive | None = None) -> list[float]:
    """Seconds each run should take on one core (to its round cap), priced from the archive's runs (see the
    module) plus :data:`SETUP`; 60 seconds a run when the archive holds none."""
    folder = (archive or Archive()).folder
    rates, images = _rates(folder, folder.stat().st_mtime) if folder.is_dir() else ({}, {})
    out = []
    for c in configs:
        config = c.to_dict()
        train = c.max_train_samples or images.get(c.dataset) or 10_000
        rate = next((rates[g] for g in _groups(config) if g in rates), None)
        out.append(60.0 if rate is None else SETUP + rate * c.num_rounds * _work(config, train))
    return out


def duration(seconds: float) -> str:
    """A duration in words a reader takes in at a glance: "40 s", "9 min", "2.5 hours"."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} hours"


def label(c: "RunConfig") -> str:
    """A run in a few words: method, split and seed ("fedavg+fedrdn, dirichlet(0.1), seed 3")."""
    option = {"dirichlet": c.alpha, "distrans": c.dh, "quantity": c.beta}.get(c.partition)
    split = c.partition if option is None else f"{c.partition}({option:g})"
    method = c.algorithm + (f"+{c.augment}" if c.augment != "none" else "")
    return f"{method}, {split}, seed {c.seed}"


class Report:
    """The lines a sweep prints: one before it starts (how many runs, the estimate), then, where no progress
    bar shows (``lines=True``), one as each run finishes: how many are done and left, the time left, and
    which runs are computing. In a notebook they go to its output; elsewhere to stderr, as progress does."""

    def __init__(self, configs: Sequence["RunConfig"], todo: Sequence[int], workers: int, lines: bool,
                 place: str | None = None):
        """`place`: where the runs compute, in words, when not on `workers` processes (a GPU: the estimate is
        then priced from CPU runs until the first runs end, and corrected by their pace)."""
        self.configs, self.todo, self.workers, self.lines = configs, list(todo), max(1, min(workers, len(todo))), lines
        self.estimates = dict(zip(self.todo, estimate([configs[i] for i in self.todo])))
        self.started: dict[int, float] = {}
        self.done: set[int] = set()
        self.began = time.perf_counter()
        self.spent = self.priced = 0.0
        capped = any(configs[i].stop_at_plateau for i in self.todo)
        self._say(f"computing {len(self.todo)} of {len(configs)} runs ({len(configs) - len(self.todo)} from the "
                  f"archive or cache), {'at most ' if capped else ''}about "
                  f"{duration(sum(self.estimates.values()) / self.workers)} on "
                  + (place or f"{self.workers} process{'es' if self.workers > 1 else ''}"))

    def _say(self, text: str) -> None:
        ipython = sys.modules.get("IPython")
        in_kernel = ipython is not None and "ipykernel" in sys.modules and ipython.get_ipython() is not None
        print(PREFIX + text, file=sys.stdout if in_kernel else sys.stderr, flush=True)

    def start(self, i: int) -> None:
        self.started[i] = time.perf_counter()

    def finish(self, i: int, share: float = 1.0) -> None:
        """Run `i` has ended; `share`: the part of its time that was its own (1/n for n runs trained together)."""
        self.spent += (time.perf_counter() - self.started.pop(i)) * share
        self.priced += self.estimates[i]
        self.done.add(i)
        if not self.lines:
            return
        pace = self.spent / self.priced   # the runs so far against their estimates
        now = time.perf_counter()
        queued = sum(e for j, e in self.estimates.items() if j not in self.done and j not in self.started)
        flying = sum(max(pace * self.estimates[j] - (now - t), 0.0) for j, t in self.started.items())
        names = [label(self.configs[j]) for j in self.started]
        if len(names) > 3:
            names = [*names[:3], f"{len(names) - 3} more"]
        computing = "; computing " + "; ".join(names) if names else ""
        if len(self.done) == len(self.todo):
            self._say(f"{len(self.todo)} of {len(self.todo)} done in {duration(now - self.began)}")
        else:
            self._say(f"{len(self.done)} of {len(self.todo)} done, about "
                      f"{duration((pace * queued + flying) / self.workers)} left{computing}")
