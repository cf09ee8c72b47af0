"""The archive re-run against the code: every stored number must come back bit for bit.

:func:`verify` re-runs the first rounds of one archived run per distinct algorithm, augmentation, dataset, model
and partition scheme (or every run in full), preferring the archive's references computed with the pinned kernels
(:meth:`fedlab_core.store.Archive.references`), and compares their per-round numbers with the stored ones. Where
this process computes with the kernels that computed a run (the same :func:`fedlab_core.kernels.signature`
canary: on every x86-64 CPU with AVX2, once pinned), any difference fails, naming the run and the round. Where
the kernels differ (another architecture, a CPU without AVX2, a run computed before the kernels were pinned),
floats may differ for that reason alone: the check reports the largest difference, and why, without failing.
A run is re-run only on the type of device that computed it: one computed on a GPU, on a machine without one, is
reported in one line as not checkable here (:func:`checkable`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .kernels import describe, signature
from .parallel import fork_is_safe
from .runs import rerun as rerun_run
from .runs import resolve_device
from .store import REFERENCES, Archive, History, _plain, code_version


@dataclass
class Check:
    """The outcome of re-running one archived run: the rounds compared and the first that differs."""

    key: str
    label: str
    rounds: int
    first_difference: int | None = None      # the round, None when identical
    largest_difference: float = 0.0           # over every number compared
    same_kernels: bool = True                 # computed with the kernels this process computes with
    computed_with: str = ""                   # the run's kernels, in words, when they are not these
    unavailable: str = ""                     # the device type that computed it, when this machine has none

    @property
    def ok(self) -> bool:
        return self.first_difference is None or not self.same_kernels

    def __str__(self) -> str:
        if self.unavailable:
            return (f"{self.key} ({self.label}): not checkable on this machine, which has no {self.unavailable} "
                    f"device (the run was computed on one); not re-run")
        if self.first_difference is None:
            return f"{self.key} ({self.label}): rounds 1-{self.rounds} bit-identical"
        where = f"differs from round {self.first_difference} (largest difference {self.largest_difference:.3g})"
        if not self.same_kernels:
            return (f"{self.key} ({self.label}): {where}; reported, not failed: its kernels give other floats than "
                    f"this machine's (computed with {self.computed_with}; here {describe(signature())})")
        return f"{self.key} ({self.label}): {where}"


NUMBERS_SKIPPED = ("seconds",)   # per-round keys that are timings, never compared


def _compare(stored: list[dict[str, Any]], fresh: list[dict[str, Any]]) -> tuple[int | None, float]:
    """The first round whose numbers differ, and the largest absolute difference over every number."""
    first, largest = None, 0.0
    for a, b in zip(stored, fresh):
        keys = [k for k in a if not k.endswith(NUMBERS_SKIPPED)]
        va, vb = _plain({k: a[k] for k in keys}), _plain({k: b.get(k) for k in keys})
        if va != vb:
            first = a["round"] if first is None else first
            largest = max(largest, _largest(va, vb))
    if len(fresh) < len(stored) and first is None:
        first = stored[len(fresh)]["round"]
    return first, largest


def _largest(a: Any, b: Any) -> float:
    if isinstance(a, dict):
        return max((_largest(a[k], b.get(k)) for k in a), default=0.0)
    if isinstance(a, list):
        return max((_largest(x, y) for x, y in zip(a, b or [])), default=0.0) if len(a) == len(b or []) else math.inf
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b))
    return 0.0 if a == b else math.inf


def group_of(history: History) -> tuple[str, ...]:
    """What :func:`verify` verifies one run of: algorithm, augmentation, dataset, model, partition scheme."""
    c = history.config
    return (c["algorithm"], c["augment"], c["dataset"], c["model"], c["partition"])


def validation_group_of(history: History) -> tuple[str, ...] | None:
    """The monitored validation set a run draws (:class:`~fedlab_core.runs.RunConfig`'s ``validation_monitor``
    and ``validation_source``), per dataset and partition scheme: :func:`verify` also checks one run of each, so
    every way of drawing a validation set is re-run bit for bit; None for a run without one."""
    c = history.config
    if not c.get("validation_monitor"):
        return None
    return (c["dataset"], c["partition"], f"validation {c.get('validation_source', 'share')}")


def label(history: History) -> str:
    """The run in a few words, for a check's line: its :func:`group_of` and its seed."""
    return " / ".join(group_of(history)) + f", seed {history.config['seed']}"


def checkable(history: History) -> bool:
    """Whether this machine has the type of device that computed the run, the only one it is re-run on."""
    try:
        resolve_device(history.meta.get("device", "cpu"))
    except ValueError:
        return False
    return True


def same_kernels(history: History) -> bool:
    """Whether this process computes with the kernels that computed the run (a GPU run: the same device type)."""
    if history.meta.get("device", "cpu") != "cpu":
        return True
    return (history.meta.get("kernels") or {}).get("canary") == signature()["canary"]


def _rerun_one(rerun: Callable[..., list[dict[str, Any]]], item: tuple[int, History, int]
               ) -> tuple[int, list[dict[str, Any]]]:
    """One re-run in a process of :func:`verify`'s pool, itself on one process (the pool holds the cores)."""
    i, history, rounds = item
    return i, rerun(history, rounds, workers=1)


def verify(rerun: Callable[..., list[dict[str, Any]]] = rerun_run, archive: Archive | None = None,
           rounds: int | None = 2, every: bool = False, progress: bool | None = None,
           journal: str | Path | None = None, workers: int = 1) -> list[Check]:
    """Re-run archived runs and compare their per-round numbers with the stored ones, bit for bit.

    Parameters
    ----------
    rerun : ``rerun(history, k)`` re-runs the history's config for its first `k` rounds (all with None) and
        returns the fresh per-round rows (:func:`fedlab_core.runs.rerun`); with `workers`, it also takes
        ``workers=1``.
    rounds : how many first rounds to re-run (None: all).
    every : every archived run and reference (in full when `rounds` is None); else one run of each distinct
        :func:`group_of`, and of each :func:`validation_group_of`, among the archive's runs and its references
        (:meth:`Archive.references`): the cheapest (seconds per round) of those computed with this process's
        kernels, else the cheapest.
    journal : a file each finished check is appended to (one JSON line); checks it already holds for the same
        run, rounds and code version are read from it, not re-run, so a long verification resumes where it was
        stopped.
    workers : processes that re-run side by side (each run computes with one thread, so its numbers are the
        same whatever the count).
    """
    from tqdm import tqdm

    archive = archive or Archive()
    entries = list(archive.entries()) + [(f"{REFERENCES}/{key}", h) for key, h in archive.references()]
    if not every:  # per group, a run this machine can re-run and these kernels verify strictly first, then the cheapest
        chosen: dict[tuple, tuple[str, History]] = {}
        for key, h in sorted(entries, key=lambda kh: (checkable(kh[1]), same_kernels(kh[1]),
                                                      -(kh[1].meta.get("seconds") or 0.0) / max(len(kh[1].rounds), 1))):
            chosen[group_of(h)] = (key, h)
            if validation_group_of(h) is not None:
                chosen[validation_group_of(h)] = (key, h)
        entries = sorted(dict(chosen.values()).items())   # a run chosen for both kinds of group is checked once
    version = code_version()
    done: dict[tuple, Check] = {}
    if journal is not None and Path(journal).exists():
        for line in Path(journal).read_text().splitlines():
            record = json.loads(line)
            where = (record.pop("key_"), record.pop("rounds_"), record.pop("code"))
            done[where] = Check(**record)
    planned = [(key, h, len(h.rounds) if rounds is None else min(rounds, len(h.rounds))) for key, h in entries]
    for key, h, k in planned:  # computed on a device this machine lacks: reported, neither re-run nor journaled
        if not checkable(h):
            done.setdefault((key, k, version), Check(key, label(h), k, unavailable=h.meta["device"]))
    # the longest first (by the run's own seconds per round), so that no long run is left for the end
    todo = sorted(((key, h, k) for key, h, k in planned if (key, k, version) not in done),
                  key=lambda t: -(t[1].meta.get("seconds") or 0.0) / max(len(t[1].rounds), 1) * t[2])
    with contextlib.ExitStack() as stack:
        if workers > 1 and len(todo) > 1:
            import multiprocessing

            method = "fork" if fork_is_safe() else "spawn"  # see fedlab_core.parallel
            pool = stack.enter_context(multiprocessing.get_context(method).Pool(min(workers, len(todo))))
            fresh = pool.imap_unordered(functools.partial(_rerun_one, rerun), [(i, h, k) for i, (_, h, k) in enumerate(todo)])
        else:
            fresh = ((i, rerun(h, k)) for i, (_, h, k) in enumerate(todo))
        bar = tqdm(fresh, total=len(todo), desc="verifying the archive", unit="run", disable=progress is False)
        for i, rows in bar:
            key, h, k = todo[i]
            first, largest = _compare(h.rounds[:k], rows)
            same = same_kernels(h)
            done[(key, k, version)] = Check(key, label(h), k, first, largest, same, "" if same else
                                            f"{describe(h.meta.get('kernels'))}, on {h.meta.get('cpu', 'an unrecorded CPU')}")
            if journal is not None:
                Path(journal).parent.mkdir(parents=True, exist_ok=True)
                with open(journal, "a") as f:
                    f.write(json.dumps({**dataclasses.asdict(done[(key, k, version)]), "key_": key, "rounds_": k,
                                        "code": version}) + "\n")
    return [done[(key, k, version)] for key, _, k in planned]
