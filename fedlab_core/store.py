"""The store of runs: their results, the local cache, checkpoints, and the archive of the book's runs.

A run's result is a :class:`History`. Three places keep results, all as plain JSON (a final state as
tensors, read as data only):

- the **cache** (:func:`default_cache_dir`): every finished run, keyed by :func:`cache_key`, a hash of the
  config, the device type, the library's code version and PyTorch's version, so any change of the code
  computes runs anew; with the **checkpoints** of unfinished runs, from which a killed run resumes;
- the **archive** (:class:`Archive`, ``book/runs/`` in the repository): the runs behind the book, keyed by
  :func:`archive_key`, a hash of the config, the device type and PyTorch's version but *not* of the code,
  each entry recording the code version and the kernels (:func:`fedlab_core.kernels.signature`) that computed
  it, gzipped. A run found there is read, not recomputed, whatever device would compute it now (a run computed
  on a CPU is read on a GPU, and one computed on a GPU on a CPU: :meth:`Archive.key_of`);
- :func:`fedlab_core.verification.verify` re-runs the first rounds of one archived run per distinct algorithm,
  augmentation, dataset, model and partition scheme (or every run in full) and requires its per-round numbers to
  be bit-identical to the stored ones, so a change of the library that moves numbers cannot leave the archive
  silently stale (on the type of device that computed each: elsewhere it reports the run as not checkable);
- the **measurements** (:class:`Measurements`, ``book/measurements/``): what the book measured once and keeps,
  timings and what its figures draw from trained models, so that the archive keeps results, not models.
"""
from __future__ import annotations

import ast
import dataclasses
import datetime
import functools
import gzip
import hashlib
import io
import json
import logging
import math
import os
import pickle
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from . import __version__
from .engine import SimulationState
from .kernels import canary, check_pinned

if TYPE_CHECKING:
    import pandas as pd

    from .runs import RunConfig

log = logging.getLogger("fedlab_core")

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE_DIR = ROOT / "book" / "runs"
REFERENCES = "pinned"    # the archive's subfolder of reference runs (Archive.references)
DEVICE_TYPES = ("cpu", "cuda")   # the devices whose runs the archive holds, each read on the other too
# The PyTorch builds whose runs the archive holds (torch.__version__, build tag included; a test checks every
# entry's): a run is read under another build of the same release too (the pinned torch==2.14.1 installs as
# "+cu130" from PyPI, "+cpu" from PyTorch's CPU index), so a machine with either reads the archive
ARCHIVE_BUILDS = ("2.14.1+cu130",)


@dataclass
class History:
    """The outcome of a run: its config, one log row per round, final metrics and metadata."""

    config: dict[str, Any]
    rounds: list[dict[str, Any]]
    final: dict[str, Any]
    meta: dict[str, Any]

    def with_meta(self, **entries: Any) -> "History":
        """The same run with `entries` added to its meta."""
        return dataclasses.replace(self, meta={**self.meta, **entries})

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
    """The run's name in the cache: a hash of its config, the device type, the library's code version, the
    PyTorch version and, on a CPU, the kernels' canary (each shapes the numbers)."""
    payload = json.dumps({"config": config.to_dict(), "device": device.type, "code": code_version(),
                          "torch": torch.__version__, "kernels": canary() if device.type == "cpu" else None},
                         sort_keys=True, default=str)
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
        data = path.read_bytes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about the pickle protocol of foreign files
            saved = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
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
    """Save a state (a checkpoint, or a final state kept in the cache) as PyTorch's file."""
    buffer = io.BytesIO()
    torch.save({"key": key, "state": dataclasses.asdict(state)}, buffer)
    _atomic_write(path, lambda f: f.write(buffer.getvalue()))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else "") or type(err).__name__


# ---------------------------------------------------------------------------------------- the archive

def _defaults(config: "RunConfig") -> dict[str, Any]:
    """Every field of the config's class at its default, as JSON reads it back."""
    return _plain({f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                   for f in dataclasses.fields(config)})


def settings(config: "RunConfig") -> dict[str, Any]:
    """The fields of `config` that differ from their defaults, as JSON reads them back: what names the run
    whatever fields later versions of the config add (at defaults that keep their numbers)."""
    defaults = _defaults(config)
    return {k: v for k, v in _plain(config.to_dict()).items() if k not in defaults or defaults[k] != v}


def archive_key(config: "RunConfig", device: torch.device | str, build: str | None = None) -> str:
    """A run's name in the archive: a hash of its config's :func:`settings`, the device type and PyTorch's
    version (`build`, default this process's); not of the library's code, so an archived run outlives code changes
    that do not move its numbers (:func:`verify` says which do), and not of the fields at their defaults, so it
    outlives new fields too."""
    payload = json.dumps({"config": settings(config), "device": getattr(device, "type", device),
                          "torch": build or torch.__version__}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


class Archive:
    """The book's runs, committed in the repository: ``<key>.json.gz`` per run (its :class:`History` as gzipped
    JSON, the code version and the kernels that computed it in ``meta["code_version"]`` and ``meta["kernels"]``).
    It keeps results, not trained models: what a figure draws from a trained model is stored as a measurement of
    the run (:func:`fedlab_core.runs.measured`, :class:`Measurements`), and final states stay in the cache.

    Writing is switched on by ``FEDLAB_ARCHIVE=write`` in the environment (the book's ``book`` profile
    sets it); reading is always on, so any run of a config the archive holds is read, not recomputed, on either
    type of device (:meth:`key_of`). The folder is ``book/runs/`` of the checkout, or ``$FEDLAB_ARCHIVE_DIR``.

    ``pinned/`` beside the entries holds *references* (:meth:`references`): runs recomputed with the pinned
    kernels whose configs the archive also holds as computed before the pins. The book reads the archive's
    entries, all computed by one set of kernels, so that no comparison mixes the two and no recomputed run
    changes a tuning choice the other runs were made with; verification re-runs the references, which hold
    bit for bit on every x86-64 CPU with AVX2, until the archive is recomputed once with the pinned kernels.
    """

    def __init__(self, folder: str | Path | None = None):
        self.folder = Path(folder or os.environ.get("FEDLAB_ARCHIVE_DIR") or ARCHIVE_DIR)

    @staticmethod
    def writing() -> bool:
        return os.environ.get("FEDLAB_ARCHIVE", "") == "write"

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json.gz"

    @staticmethod
    def read(path: Path) -> dict[str, Any]:
        """An entry's JSON document."""
        return json.loads(gzip.decompress(path.read_bytes()))

    @staticmethod
    def write(path: Path, doc: dict[str, Any]) -> None:
        """Write an entry's JSON document, gzipped with no timestamp (the same run gives the same bytes)."""
        text = json.dumps(_finite(doc), sort_keys=True).encode()
        _atomic_write(path, lambda f: f.write(gzip.compress(text, compresslevel=9, mtime=0)))

    def key_of(self, config: "RunConfig", device: torch.device) -> str | None:
        """The key of this run's entry: the entry computed on `device`'s type, else the one computed on the other type of :data:`DEVICE_TYPES` (a CPU's
        on a GPU, a GPU's on a CPU); by this PyTorch build, else by another build of its release that the archive
        holds (:data:`ARCHIVE_BUILDS`). So the book reads its runs wherever it is built, each history's meta
        saying where and with which build it was computed; None when there is none."""
        release = torch.__version__.split("+")[0]
        builds = [torch.__version__] + [b for b in ARCHIVE_BUILDS if b != torch.__version__ and b.split("+")[0] == release]
        for build in builds:
            for kind in sorted(DEVICE_TYPES, key=lambda kind: kind != device.type):
                key = archive_key(config, kind, build)
                if self.path(key).exists():
                    return key
        return None

    def get(self, config: "RunConfig", device: torch.device) -> History | None:
        """The archived result of this run, computed on `device`'s type or else on the other (:meth:`key_of`)."""
        key = self.key_of(config, device)
        if key is None:
            return None
        result = self.path(key)
        history = History(**self.read(result))
        if {**_defaults(config), **history.config} != _plain(config.to_dict()):
            raise ValueError(f"{result}: the archive entry holds another run's config; the archive is damaged")
        return history

    def add(self, history: History, config: "RunConfig", device: torch.device) -> Path:
        """Store a finished run; a CPU run only if its recorded kernels are the pinned ones
        (:func:`fedlab_core.kernels.check_pinned`), so that it verifies on every x86-64 machine with AVX2."""
        if device.type == "cpu":
            check_pinned(history.meta.get("kernels") or {})
        result = self.path(archive_key(config, device))
        self.write(result, dataclasses.asdict(history))
        return result

    def entries(self) -> Iterator[tuple[str, History]]:
        """(key, result) of every archived run, by key."""
        for path in sorted(self.folder.glob("*.json.gz")):
            yield path.name.removesuffix(".json.gz"), History(**self.read(path))

    def references(self) -> Iterator[tuple[str, History]]:
        """(key, result) of every run of ``pinned/``, by key (see the class)."""
        for path in sorted((self.folder / REFERENCES).glob("*.json.gz")):
            yield path.name.removesuffix(".json.gz"), History(**self.read(path))

    def size(self) -> int:
        """Bytes on disk, references included."""
        return sum(p.stat().st_size for p in self.folder.rglob("*") if p.is_file())

    def summary(self) -> dict[str, Any]:
        """How many runs it holds, their bytes, the hours they took to compute (their own timings), and the code
        versions that computed them (version -> runs)."""
        versions: dict[str, int] = {}
        runs = seconds = 0
        for _, h in self.entries():
            runs += 1
            seconds += h.meta.get("seconds") or 0.0
            version = h.meta.get("code_version", "?")
            versions[version] = versions.get(version, 0) + 1
        return {"runs": runs, "bytes": self.size(), "hours": seconds / 3600, "versions": versions}


# ---------------------------------------------------------------------------------------- measurements

MEASUREMENTS_DIR = ROOT / "book" / "measurements"
# the libraries whose versions can move a timing: their versions name a measurement (torch by its release)
TIMED_LIBRARIES = ("torch", "numpy", "scipy", "POT")


def source_digest(sources: tuple[str, ...]) -> dict[str, str]:
    """Each of the library's sources `sources` -> a digest of its text ("absent" for one the package no longer
    has): a file (its path inside the package), or one function or class of a file (``"runs.py::client_features"``,
    a method as ``"engine.py::Simulation.accuracy"``), so that a measurement names the code it runs and no other."""
    package = Path(__file__).resolve().parent
    out = {}
    for source in sources:
        name, _, definition = source.partition("::")
        path = package / name
        text = path.read_bytes() if path.is_file() else None
        if text is not None and definition:
            node: ast.AST | None = ast.parse(text)
            for part in definition.split("."):
                node = next((n for n in getattr(node, "body", ()) if getattr(n, "name", None) == part), None)
            text = ast.get_source_segment(text.decode(), node).encode() if node is not None else None
        out[source] = hashlib.sha256(text).hexdigest()[:12] if text is not None else "absent"
    return out


def measurement_key(name: str, settings: dict[str, Any], sources: tuple[str, ...],
                    libraries: tuple[str, ...] = TIMED_LIBRARIES) -> str:
    """A measurement's name in :class:`Measurements`: a hash of its name, its settings, the code that it runs
    (`sources`' digests) and the versions of `libraries` (by default :data:`TIMED_LIBRARIES`, for a timing)."""
    versions = {k: v.split("+")[0] for k, v in library_versions().items() if k in libraries}
    payload = json.dumps({"name": name, "settings": _plain(settings), "sources": source_digest(sources),
                          "libraries": versions}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def machine() -> dict[str, Any]:
    """The CPU that took a measurement (its model name, as the system reports it) and its cores."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count() or 1}


class Measurements:
    """What the book measures once and stores in the repository: ``<name>-<key>.json`` per measurement (its
    values and the settings, sources, libraries, machine and date that produced them).

    - The timings it judges cost claims on, so that a verdict does not move with the load of the machine that
      builds the page.
    - What its figures draw from a run's trained models (:func:`fedlab_core.runs.measured`: features, their
      2-D picture, offsets), so that the archive keeps results, not models; ``libraries=()``, since the run it
      measures is archived whatever the libraries' versions.

    The key (:func:`measurement_key`) names the settings, the digests of the code that runs (a file, or one
    function of it) and the keyed libraries' versions: changing any of them measures anew, and :meth:`stale`
    lists the stored measurements that the code or the libraries have left behind.

    As for the :class:`Archive`, writing is switched on by ``FEDLAB_ARCHIVE=write``; the folder is
    ``book/measurements/`` of the checkout, or ``$FEDLAB_MEASUREMENTS_DIR``.
    """

    def __init__(self, folder: str | Path | None = None):
        self.folder = Path(folder or os.environ.get("FEDLAB_MEASUREMENTS_DIR") or MEASUREMENTS_DIR)

    @staticmethod
    def check_name(name: str) -> None:
        """Raise ValueError unless `name` is lower-case letters, digits and underscores (it names a file, and the
        measurement's key follows it after a hyphen)."""
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_]+", name):
            raise ValueError(f"name: a measurement's name is lower-case letters, digits and underscores; got {name!r}")

    def path(self, name: str, key: str) -> Path:
        self.check_name(name)
        return self.folder / f"{name}-{key}.json"

    def find(self, name: str, settings: dict[str, Any], sources: tuple[str, ...],
             libraries: tuple[str, ...] = TIMED_LIBRARIES) -> dict[str, Any] | None:
        """The stored document of `name` under `settings` (as :meth:`get` returns it), or None; nothing is
        measured."""
        path = self.path(name, measurement_key(name, settings, sources, libraries))
        return {**json.loads(path.read_text()), "stored": True} if path.exists() else None

    def get(self, name: str, settings: dict[str, Any], measure, sources: tuple[str, ...],
            remeasure: bool = False, libraries: tuple[str, ...] = TIMED_LIBRARIES) -> dict[str, Any]:
        """The stored measurement of `name` under `settings`, else (or with `remeasure`) ``measure()``'s, stored
        when the archive is writable. Returns its document: ``values`` (what `measure` returned, as JSON reads it
        back), ``stored`` (whether it was read, not measured now), ``machine``, ``date`` and ``seconds``."""
        if not isinstance(remeasure, bool):
            raise ValueError(f"remeasure: expected True or False, got {remeasure!r}")
        found = None if remeasure else self.find(name, settings, sources, libraries)
        if found is not None:
            return found
        started = time.perf_counter()
        values = _plain(measure())
        doc = {"name": name, "settings": _plain(settings), "sources": list(sources), "values": values,
               "source_digests": source_digest(sources), "libraries": library_versions(),
               "keyed_libraries": list(libraries), "machine": machine(),
               "date": datetime.date.today().isoformat(), "seconds": time.perf_counter() - started}
        if Archive.writing():
            text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
            path = self.path(name, measurement_key(name, settings, sources, libraries))
            _atomic_write(path, lambda f: f.write(text.encode()))
        return {**doc, "stored": False}

    def stale(self) -> list[str]:
        """The stored measurements whose key the current code or libraries no longer give: one line each, naming
        the file and what changed."""
        out = []
        for path in sorted(self.folder.glob("*.json")):
            doc = json.loads(path.read_text())
            keyed = tuple(doc.get("keyed_libraries", TIMED_LIBRARIES))
            if path.name == self.path(doc["name"], measurement_key(doc["name"], doc["settings"],
                                                                    tuple(doc["sources"]), keyed)).name:
                continue
            now = source_digest(tuple(doc["sources"]))
            changed = [s for s in doc["sources"] if now[s] != doc["source_digests"].get(s)]
            changed += [k for k in keyed if doc["libraries"].get(k, "").split("+")[0]
                        != library_versions()[k].split("+")[0]]
            out.append(f"{path.name}: stale ({', '.join(changed) or 'its name'} changed since it was measured)")
        return out
