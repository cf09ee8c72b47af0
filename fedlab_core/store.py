"""The store of runs: their results, the local cache, checkpoints, and the archive of the book's runs.

A run's result is a :class:`History`. Three places keep results, all as plain JSON (a final state as
tensors, read as data only):

- the **cache** (:func:`default_cache_dir`): every finished run, keyed by :func:`cache_key`, a hash of the
  config, the device type, the library's code version and PyTorch's version, so any change of the code
  computes runs anew; with the **checkpoints** of unfinished runs, from which a killed run resumes;
- the **archive** (:class:`Archive`, ``book/runs/`` in the repository): the runs behind the book, keyed by
  :func:`archive_key`, a hash of the config, the device type and PyTorch's version but *not* of the code,
  each entry recording the code version that computed it. A run found there is read, not recomputed;
- :func:`verify` re-runs the first rounds of one archived run per distinct algorithm, augmentation, dataset,
  model and partition scheme (or every run in full) and requires its per-round numbers to be bit-identical to
  the stored ones, so a change of the library that moves numbers cannot leave the archive silently stale.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import pickle
import platform
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from . import __version__
from .engine import SimulationState

if TYPE_CHECKING:
    import pandas as pd

    from .runs import RunConfig

log = logging.getLogger("fedlab_core")

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE_DIR = ROOT / "book" / "runs"


@dataclass
class History:
    """The outcome of a run: its config, one log row per round, final metrics and metadata."""

    config: dict[str, Any]
    rounds: list[dict[str, Any]]
    final: dict[str, Any]
    meta: dict[str, Any]

    def frame(self) -> pd.DataFrame:
        """One row per round: accuracy, loss, bytes up/down, seconds (per-client lists left out)."""
        import pandas as pd

        rows = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in self.rounds]
        df = pd.DataFrame(rows)
        for key in ("algorithm", "augment", "partition", "seed"):
            df[key] = self.config[key]
        return df

    def to_json(self) -> str:
        return json.dumps(_finite(dataclasses.asdict(self)), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "History":
        return cls(**json.loads(text))


def _finite(obj: Any) -> Any:
    """NaN and infinities become None, so the JSON is standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def code_version() -> str:
    """The library version plus a digest of its source files: any code change invalidates the cache."""
    digest = hashlib.sha256(__version__.encode())
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:12]}"


# the libraries whose versions can move a number in the book
NUMERIC_LIBRARIES = ("torch", "torchvision", "numpy", "scipy", "POT", "scikit-learn", "umap-learn", "pynndescent",
                     "numba")


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    """Python's and :data:`NUMERIC_LIBRARIES`' installed versions ("absent" for one not installed); torch's
    as it reports itself, with its build (e.g. "+cpu")."""
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in NUMERIC_LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return {**out, "torch": torch.__version__}



# ---------------------------------------------------------------------------------------- the cache

def cache_key(config: "RunConfig", device: torch.device) -> str:
    """The run's name in the cache: a hash of its config, the device type, the library's code version and
    the PyTorch version (which shapes the numbers too)."""
    payload = json.dumps({"config": config.to_dict(), "device": device.type, "code": code_version(),
                          "torch": torch.__version__}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def default_cache_dir() -> Path:
    """$FEDLAB_CACHE_DIR, else `.fedlab_cache/` in the source checkout, else ~/.cache/fedlab_core/runs."""
    if os.environ.get("FEDLAB_CACHE_DIR"):
        return Path(os.environ["FEDLAB_CACHE_DIR"]).expanduser()
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").exists():
        return checkout / ".fedlab_cache"
    return Path.home() / ".cache" / "fedlab_core" / "runs"


def check_writable(folder: Path, field: str) -> None:
    """Raise ValueError, in one line naming `field` (the setting that chose the folder), unless a run can
    write its results and checkpoints into `folder` (made if missing)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        raise ValueError(f"{field}: cannot write the run cache in {folder}: {err.strerror or err}") from None


def _atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same folder and rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------- the cache's files

def _set_aside(path: Path, reason: str, tag: str = "damaged") -> Path:
    """Rename a cache file that cannot be used to ``<name>.<tag>`` (never deleted: it may be evidence),
    and say so in one line."""
    target = path.with_name(f"{path.name}.{tag}")
    n = 1
    while target.exists():
        target, n = path.with_name(f"{path.name}.{tag}.{n}"), n + 1
    os.replace(path, target)
    log.warning("%s %s; moved to %s, and the run is computed again", path, reason, target.name)
    return target


def _plain(obj: Any) -> Any:
    """`obj` as it reads back from JSON (tuples become lists, NaN becomes None)."""
    return json.loads(json.dumps(_finite(obj), default=str))


def _read_result(path: Path, config: "RunConfig", key: str) -> History | None:
    """The cached result at `path`, or None when there is none; one that is damaged or belongs to another
    config is set aside."""
    if not path.exists():
        return None
    try:
        history = History.from_json(path.read_text())
        if history.meta.get("key") != key or history.config != _plain(config.to_dict()):
            raise ValueError("it holds another run's result")
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as err:
        _set_aside(path, f"is not a readable result of this run ({_first_line(err)})")
        return None
    return history


def _read_state(path: Path, key: str, device: torch.device) -> SimulationState | None:
    """The simulation state saved at `path` (a checkpoint or a kept final state), or None when there is
    none. It is read as data only (tensors, numbers, strings, lists and dicts; no code runs): a file
    holding anything else is refused and set aside, and so is a damaged one or another run's."""
    if not path.exists():
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about the pickle protocol of foreign files
            saved = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        _set_aside(path, "holds objects other than tensors and plain values, so it was not loaded "
                         "(a crafted or foreign file)", tag="refused")
        return None
    except Exception as err:  # truncated, empty, not a torch file: what torch raises varies
        _set_aside(path, f"cannot be read ({_first_line(err)})")
        return None
    try:
        if not isinstance(saved, dict) or saved.get("key") != key:
            raise ValueError("it holds another run's state")
        return SimulationState(**saved["state"])
    except (ValueError, TypeError, KeyError) as err:
        _set_aside(path, f"is not a state of this run ({_first_line(err)})")
        return None


def _write_state(path: Path, key: str, state: SimulationState) -> None:
    _atomic_write(path, lambda f: torch.save({"key": key, "state": dataclasses.asdict(state)}, f))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else "") or type(err).__name__


# ---------------------------------------------------------------------------------------- the archive

def cpu_model() -> str:
    """The kind of CPU this process computes on (floats can differ between kinds, never within one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _defaults(config: "RunConfig") -> dict[str, Any]:
    """Every field of the config's class at its default, as JSON reads it back."""
    return _plain({f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                   for f in dataclasses.fields(config)})


def settings(config: "RunConfig") -> dict[str, Any]:
    """The fields of `config` that differ from their defaults, as JSON reads them back: what names the run
    whatever fields later versions of the config add (at defaults that keep their numbers)."""
    defaults = _defaults(config)
    return {k: v for k, v in _plain(config.to_dict()).items() if k not in defaults or defaults[k] != v}


def archive_key(config: "RunConfig", device: torch.device | str) -> str:
    """A run's name in the archive: a hash of its config's :func:`settings`, the device type and PyTorch's
    version; not of the library's code, so an archived run outlives code changes that do not move its numbers
    (:func:`verify` says which do), and not of the fields at their defaults, so it outlives new fields too."""
    payload = json.dumps({"config": settings(config), "device": getattr(device, "type", device),
                          "torch": torch.__version__}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


class Archive:
    """The book's runs, committed in the repository: ``<key>.json`` per run (its :class:`History`, the code
    version that computed it in ``meta["code_version"]``), and ``<key>.final`` for the few runs whose final
    state a figure needs (read as data only).

    Writing is switched on by ``FEDLAB_ARCHIVE=write`` in the environment (the book's ``book`` profile
    sets it); reading is always on, so any run of a config the archive holds is read, not recomputed. The
    folder is ``book/runs/`` of the checkout, or ``$FEDLAB_ARCHIVE_DIR``.
    """

    def __init__(self, folder: str | Path | None = None):
        self.folder = Path(folder or os.environ.get("FEDLAB_ARCHIVE_DIR") or ARCHIVE_DIR)

    @staticmethod
    def writing() -> bool:
        return os.environ.get("FEDLAB_ARCHIVE", "") == "write"

    def paths(self, key: str) -> tuple[Path, Path]:
        return self.folder / f"{key}.json", self.folder / f"{key}.final"

    def get(self, config: "RunConfig", device: torch.device, with_state: bool = False) -> History | None:
        """The archived result of this run (and only if `with_state`, when its final state is archived too)."""
        result, final = self.paths(archive_key(config, device))
        if not result.exists() or (with_state and not final.exists()):
            return None
        history = History.from_json(result.read_text())
        if {**_defaults(config), **history.config} != _plain(config.to_dict()):
            raise ValueError(f"{result}: the archive entry holds another run's config; the archive is damaged")
        return history

    def state(self, config: "RunConfig", device: torch.device) -> SimulationState | None:
        """The archived final state of this run, or None."""
        key = archive_key(config, device)
        return _read_state(self.paths(key)[1], key, device)

    def add(self, history: History, config: "RunConfig", device: torch.device,
            state: SimulationState | None = None) -> Path:
        """Store a finished run (and its final state, when given)."""
        key = archive_key(config, device)
        result, final = self.paths(key)
        if state is not None:
            _write_state(final, key, state)
        _atomic_write(result, lambda f: f.write(json.dumps(_finite(dataclasses.asdict(history)), sort_keys=True,
                                                           indent=None).encode()))
        return result

    def entries(self) -> Iterator[tuple[str, History]]:
        """(key, result) of every archived run, by key."""
        for path in sorted(self.folder.glob("*.json")):
            yield path.stem, History.from_json(path.read_text())

    def size(self) -> int:
        """Bytes on disk."""
        return sum(p.stat().st_size for p in self.folder.glob("*") if p.is_file())

    def summary(self) -> dict[str, Any]:
        """How many runs it holds, their bytes, the hours they took to compute (their own timings), how many keep
        a final state, and the code versions that computed them (version -> runs)."""
        versions: dict[str, int] = {}
        runs = seconds = 0
        for _, h in self.entries():
            runs += 1
            seconds += h.meta.get("seconds") or 0.0
            version = h.meta.get("code_version", "?")
            versions[version] = versions.get(version, 0) + 1
        return {"runs": runs, "bytes": self.size(), "hours": seconds / 3600, "versions": versions,
                "with_state": sum(1 for _ in self.folder.glob("*.final"))}


@dataclass
class Check:
    """The outcome of re-running one archived run: the rounds compared and the first that differs."""

    key: str
    label: str
    rounds: int
    first_difference: int | None = None      # the round, None when identical
    largest_difference: float = 0.0           # over every number compared
    same_cpu: bool = True

    @property
    def ok(self) -> bool:
        return self.first_difference is None or not self.same_cpu

    def __str__(self) -> str:
        if self.first_difference is None:
            return f"{self.key} ({self.label}): rounds 1-{self.rounds} bit-identical"
        where = f"differs from round {self.first_difference} (largest difference {self.largest_difference:.3g})"
        if not self.same_cpu:
            return f"{self.key} ({self.label}): {where}, computed on another kind of CPU, so reported, not failed"
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


def _rerun_one(rerun: Callable[..., list[dict[str, Any]]], item: tuple[int, History, int]
               ) -> tuple[int, list[dict[str, Any]]]:
    """One re-run in a process of :func:`verify`'s pool, itself on one process (the pool holds the cores)."""
    i, history, rounds = item
    return i, rerun(history, rounds, workers=1)


def verify(rerun: Callable[[History, int | None], list[dict[str, Any]]], archive: Archive | None = None,
           rounds: int | None = 2, every: bool = False, progress: bool | None = None,
           journal: str | Path | None = None, workers: int = 1) -> list[Check]:
    """Re-run archived runs and compare their per-round numbers with the stored ones, bit for bit.

    Parameters
    ----------
    rerun : ``rerun(history, k)`` re-runs the history's config for its first `k` rounds (all with None) and
        returns the fresh per-round rows (:func:`fedlab_core.runs.rerun`); with `workers`, it also takes
        ``workers=1``.
    rounds : how many first rounds to re-run (None: all).
    every : every archived run (in full when `rounds` is None); else the cheapest run of each distinct
        :func:`group_of`.
    journal : a file each finished check is appended to (one JSON line); checks it already holds for the same
        run, rounds and code version are read from it, not re-run, so a long verification resumes where it was
        stopped.
    workers : processes that re-run side by side (each run computes with one thread, so its numbers are the
        same whatever the count).

    On another kind of CPU than the one that computed a run (``meta["cpu"]``), floats may differ: the check
    reports the largest difference instead of failing.
    """
    from tqdm import tqdm

    archive = archive or Archive()
    entries = list(archive.entries())
    if not every:  # the cheapest run (seconds per round) of each group
        chosen: dict[tuple, tuple[str, History]] = {}
        for key, h in sorted(entries, key=lambda kh: -(kh[1].meta.get("seconds") or 0.0) / max(len(kh[1].rounds), 1)):
            chosen[group_of(h)] = (key, h)
        entries = sorted(chosen.values(), key=lambda kh: kh[0])
    here, version = cpu_model(), code_version()
    done: dict[tuple, Check] = {}
    if journal is not None and Path(journal).exists():
        for line in Path(journal).read_text().splitlines():
            record = json.loads(line)
            where = (record.pop("key_"), record.pop("rounds_"), record.pop("code"))
            done[where] = Check(**record)
    planned = [(key, h, len(h.rounds) if rounds is None else min(rounds, len(h.rounds))) for key, h in entries]
    # the longest first (by the run's own seconds per round), so that no long run is left for the end
    todo = sorted(((key, h, k) for key, h, k in planned if (key, k, version) not in done),
                  key=lambda t: -(t[1].meta.get("seconds") or 0.0) / max(len(t[1].rounds), 1) * t[2])
    with contextlib.ExitStack() as stack:
        if workers > 1 and len(todo) > 1:
            import multiprocessing

            pool = stack.enter_context(multiprocessing.get_context("fork").Pool(min(workers, len(todo))))
            fresh = pool.imap_unordered(functools.partial(_rerun_one, rerun), [(i, h, k) for i, (_, h, k) in enumerate(todo)])
        else:
            fresh = ((i, rerun(h, k)) for i, (_, h, k) in enumerate(todo))
        bar = tqdm(fresh, total=len(todo), desc="verifying the archive", unit="run", disable=progress is False)
        for i, rows in bar:
            key, h, k = todo[i]
            first, largest = _compare(h.rounds[:k], rows)
            done[(key, k, version)] = Check(key, " / ".join(group_of(h)) + f", seed {h.config['seed']}", k, first,
                                            largest, h.meta.get("cpu", here) == here)
            if journal is not None:
                Path(journal).parent.mkdir(parents=True, exist_ok=True)
                with open(journal, "a") as f:
                    f.write(json.dumps({**dataclasses.asdict(done[(key, k, version)]), "key_": key, "rounds_": k,
                                        "code": version}) + "\n")
    return [done[(key, k, version)] for key, _, k in planned]
