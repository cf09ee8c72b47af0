"""Runs: a frozen config, `run(config) -> History`, the result cache, checkpoints and sweeps.

A run is a pure function of its :class:`RunConfig` (seed included). Finished runs are cached as JSON,
keyed by a hash of the config, the device type and the library's code version, so a notebook re-run
reuses them. Checkpoints are written every few rounds; a killed run started again resumes from its
last checkpoint and ends with exactly the numbers of an uninterrupted run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd
import torch

from . import __version__
from .algorithms import ALGORITHMS, NonFiniteLossError, Training
from .augment import AUGMENTS
from .data import DATASETS, federate, load_dataset
from .data import partition as P
from .engine import INIT, Simulation, SimulationState, derive_seed
from .models import MODELS, build_model

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a federated run. Every field has a default.

    Construction validates every field and raises one ``ValueError`` naming the field and what is
    allowed, before any data is loaded or any cache is touched.
    """

    # what is trained
    algorithm: str = "fedavg"                       # a name in fedlab_core.algorithms.ALGORITHMS
    algorithm_params: Mapping[str, Any] = field(default_factory=dict)  # the algorithm's hyperparameters
    augment: str = "none"                           # a name in fedlab_core.augment.AUGMENTS
    augment_params: Mapping[str, Any] = field(default_factory=dict)    # the augmentation's parameters
    model: str = "auto"                             # a name in fedlab_core.models.MODELS, or "auto"
    # data and its split
    dataset: str = "fashion_mnist"                  # a name in fedlab_core.data.DATASETS
    dataset_params: Mapping[str, Any] = field(default_factory=dict)    # loader options (image_size, ...)
    max_train_samples: int = 0                      # 0: all; else a class-stratified subset of this size
    max_test_samples: int = 0                       # 0: all; else a class-stratified subset of this size
    partition: str = "iid"                          # a name in fedlab_core.data.partition.PARTITIONS
    alpha: float = 0.5                              # Dirichlet concentration (partition "dirichlet")
    dh: float | None = None                         # target DH in [0, 1] (partition "distrans")
    classes_per_client: int | None = None           # classes per client ("distrans", "pathological")
    beta: float = 0.5                               # client-size concentration (partition "quantity")
    min_size: int = 10                              # fewest training samples per client ("dirichlet", "quantity")
    num_clients: int = 10                           # clients in the federation
    # communication
    num_rounds: int = 20                            # communication rounds
    fraction: float = 1.0                           # fraction of clients sampled per round, in (0, 1]
    clients_per_round: int = 0                      # if > 0: sample exactly this many clients per round
    # local training
    local_epochs: int = 1                           # local passes over the data per round
    local_steps: int = 0                            # if > 0: local mini-batches per round instead of epochs
    batch_size: int = 32                            # local mini-batch size
    optimizer: str = "sgd"                          # "sgd" or "adam"
    lr: float = 0.05                                # local learning rate
    momentum: float = 0.0                           # local SGD momentum
    weight_decay: float = 0.0                       # local L2 penalty
    # evaluation and randomness
    eval_every: int = 1                             # evaluate every this many rounds (and after the last)
    seed: int = 0                                   # the run's seed: data split, model init, every client stream

    def __post_init__(self) -> None:
        for name in ("algorithm_params", "augment_params", "dataset_params"):
            object.__setattr__(self, name, dict(getattr(self, name)))
        validate(self)

    def replace(self, **changes) -> "RunConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def partition_options(self) -> dict[str, Any]:
        """The options of the chosen partition scheme, and only those."""
        return {
            "dirichlet": {"alpha": self.alpha, "min_size": self.min_size},
            "quantity": {"beta": self.beta, "min_size": self.min_size},
            "distrans": {"dh": self.dh, "classes_per_client": self.classes_per_client},
            "pathological": {"classes_per_client": self.classes_per_client or 2},
        }.get(self.partition, {})

    def training(self) -> Training:
        return Training(local_epochs=self.local_epochs, local_steps=self.local_steps, batch_size=self.batch_size,
                        optimizer=self.optimizer, lr=self.lr, momentum=self.momentum,
                        weight_decay=self.weight_decay)


def _allowed(field_name: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = sorted(allowed)
    if value not in allowed:
        raise ValueError(f"{field_name}: unknown value {value!r}; allowed: {', '.join(allowed)}")


def _accepts(field_name: str, cls: type, params: Mapping[str, Any], skip: tuple[str, ...]) -> None:
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self",) + skip]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"{field_name}: {cls.name!r} has no parameter {unknown[0]!r}; "
                         f"it accepts: {', '.join(accepted) or 'none'}")


def validate(c: RunConfig) -> None:
    """Raise ValueError, naming the field, for the first invalid value of a config."""
    _allowed("algorithm", c.algorithm, ALGORITHMS)
    _allowed("augment", c.augment, AUGMENTS)
    _allowed("dataset", c.dataset, DATASETS)
    _allowed("partition", c.partition, P.PARTITIONS)
    _allowed("optimizer", c.optimizer, OPTIMIZERS)
    if c.model != "auto":
        _allowed("model", c.model, MODELS)
    _accepts("algorithm_params", ALGORITHMS[c.algorithm], c.algorithm_params, ("training",))
    _accepts("augment_params", AUGMENTS[c.augment], c.augment_params, ())
    positive_ints = {"num_clients": 1, "num_rounds": 1, "batch_size": 1, "eval_every": 1, "local_epochs": 1,
                     "local_steps": 0, "clients_per_round": 0, "max_train_samples": 0, "max_test_samples": 0,
                     "min_size": 0, "seed": 0}
    for name, low in positive_ints.items():
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
    if not (isinstance(c.lr, (int, float)) and c.lr > 0 and math.isfinite(c.lr)):
        raise ValueError(f"lr: must be a finite number > 0, got {c.lr!r}")
    for name in ("momentum", "weight_decay"):
        if not getattr(c, name) >= 0:
            raise ValueError(f"{name}: must be >= 0, got {getattr(c, name)!r}")
    if not 0.0 < c.fraction <= 1.0:
        raise ValueError(f"fraction: must lie in (0, 1], got {c.fraction!r}")
    if c.clients_per_round > c.num_clients:
        raise ValueError(f"clients_per_round: must be <= num_clients ({c.num_clients}), got {c.clients_per_round}")
    if c.partition == "dirichlet" and not c.alpha > 0:
        raise ValueError(f"alpha: must be > 0, got {c.alpha!r}")
    if c.partition == "quantity" and not c.beta > 0:
        raise ValueError(f"beta: must be > 0, got {c.beta!r}")
    info = DATASETS[c.dataset]
    if c.partition == "distrans":
        if (c.dh is None) == (c.classes_per_client is None):
            raise ValueError("dh: partition 'distrans' needs exactly one of dh or classes_per_client")
        if c.dh is not None:
            if not 0.0 <= c.dh <= 1.0:
                raise ValueError(f"dh: must lie in [0, 1], got {c.dh!r}")
            try:
                P.classes_for_dh(c.dh, info.num_classes, c.num_clients)
            except ValueError as err:
                raise ValueError(f"dh: {err}") from None
    if c.partition in ("distrans", "pathological") and c.classes_per_client is not None:
        if not 1 <= c.classes_per_client <= info.num_classes:
            raise ValueError(f"classes_per_client: must lie in [1, {info.num_classes}], got {c.classes_per_client}")
    if c.partition == "domain" and not info.has_domains:
        raise ValueError(f"partition: 'domain' needs a dataset with domains "
                         f"({', '.join(n for n, i in DATASETS.items() if i.has_domains)}), got {c.dataset!r}")
    available = min(x for x in (info.num_train, c.max_train_samples or None) if x) if info.num_train else None
    if available is not None:
        needed = c.num_clients * (c.min_size if c.partition in ("dirichlet", "quantity") else 1)
        if needed > available:
            raise ValueError(f"num_clients: {c.num_clients} clients need at least {needed} training samples, "
                             f"but {c.dataset!r} provides {available}")


# ---------------------------------------------------------------------------------------- results

@dataclass
class History:
    """The outcome of a run: its config, one log row per round, final metrics and metadata."""

    config: dict[str, Any]
    rounds: list[dict[str, Any]]
    final: dict[str, Any]
    meta: dict[str, Any]

    def frame(self) -> pd.DataFrame:
        """One row per round: accuracy, loss, bytes up/down, seconds (per-client lists left out)."""
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


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cache_key(config: RunConfig, device: torch.device) -> str:
    payload = json.dumps({"config": config.to_dict(), "device": device.type, "code": code_version()},
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


# ---------------------------------------------------------------------------------------- run

def build(config: RunConfig, device: torch.device, progress: bool | None = None) -> Simulation:
    """Load the data, split it, build the model, the algorithm and the augmentation."""
    data = load_dataset(config.dataset, max_train=config.max_train_samples, max_test=config.max_test_samples,
                        seed=config.seed, **config.dataset_params)
    federation = federate(data, config.partition, config.num_clients, config.seed,
                          **config.partition_options()).to(device)
    model_name = config.model if config.model != "auto" else DATASETS[config.dataset].default_model(data.input_shape)
    torch.manual_seed(derive_seed(config.seed, 0, INIT))  # model initialisation has its own stream
    model = build_model(model_name, data.input_shape, data.num_classes).to(device)
    algorithm = ALGORITHMS[config.algorithm](training=config.training(), **config.algorithm_params)
    augment = AUGMENTS[config.augment](**config.augment_params)
    return Simulation(algorithm, federation, model, seed=config.seed, num_rounds=config.num_rounds,
                      fraction=config.fraction, clients_per_round=config.clients_per_round,
                      eval_every=config.eval_every, augment=augment, progress=progress)


def run(config: RunConfig, *, cache_dir: str | Path | None = None, use_cache: bool = True,
        checkpoint_every: int = 5, device: str | torch.device = "auto", progress: bool | None = None,
        keep_state: bool = False, on_diverge: str = "raise") -> History:
    """Run a federated experiment, or return its cached result.

    Parameters
    ----------
    config : the experiment.
    cache_dir : where results and checkpoints live (default :func:`default_cache_dir`).
    use_cache : read and write the result cache and checkpoints.
    checkpoint_every : write a checkpoint every this many rounds (0: never).
    device : "auto" (CUDA when present), "cpu", "cuda", ...
    progress : show a progress bar (None: only on a terminal).
    keep_state : also keep the final state (models, offsets, client states) in the cache, for
        :func:`trained`; a cached result without it is run again.
    on_diverge : "raise" (a NaN training loss raises :class:`NonFiniteLossError`) or "record": the run
        ends there and its history, with NaN final metrics and ``meta["diverged"]`` saying where, is the
        result (cached like any other: a divergence is deterministic).
    """
    if on_diverge not in ("raise", "record"):
        raise ValueError(f"on_diverge: unknown value {on_diverge!r}; allowed: raise, record")
    device = resolve_device(device)
    key = cache_key(config, device)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    result_path, ckpt_path, final_path = folder / f"{key}.json", folder / f"{key}.ckpt", folder / f"{key}.final"
    if use_cache and result_path.exists() and (final_path.exists() or not keep_state):
        return History.from_json(result_path.read_text())
    started = time.perf_counter()
    sim = build(config, device, progress)
    state = None
    if use_cache and ckpt_path.exists():
        state = SimulationState(**torch.load(ckpt_path, map_location=device, weights_only=False))
    resumed_from = 0 if state is None else state.next_round - 1

    latest = {"state": state}

    def checkpoint(s: SimulationState) -> None:
        latest["state"] = s
        done = s.next_round - 1
        if use_cache and checkpoint_every and done % checkpoint_every == 0 and done < config.num_rounds:
            _atomic_write(ckpt_path, lambda f: torch.save(dataclasses.asdict(s), f))

    diverged = None
    try:
        state = sim.run(state, on_round_end=checkpoint)
    except NonFiniteLossError as err:
        if on_diverge == "raise":
            raise
        diverged, state = str(err), latest["state"]
    fed = sim.federation
    rows = state.rows if state is not None else []
    if diverged is None:
        last = rows[-1]
        final = {k: last[k] for k in ("global_accuracy", "global_loss", "mean_client_accuracy", "client_accuracy")}
    else:
        nan = float("nan")
        final = {"global_accuracy": nan, "global_loss": nan, "mean_client_accuracy": nan,
                 "client_accuracy": [nan] * fed.num_clients}
    history = History(
        config=config.to_dict(),
        rounds=rows,
        final=final,
        meta={"key": key, "device": device.type, "code_version": code_version(), "dh": fed.dh,
              "class_counts": fed.class_counts.tolist(), "seconds": time.perf_counter() - started,
              "setup_bytes": list(state.setup_bytes) if state is not None else [0, 0],
              "resumed_from_round": resumed_from, "diverged": diverged},
    )
    history = History.from_json(history.to_json())  # the same normalised form a cache hit returns
    if use_cache:
        if keep_state and state is not None:
            _atomic_write(final_path, lambda f: torch.save(dataclasses.asdict(state), f))
        _atomic_write(result_path, lambda f: f.write(history.to_json().encode()))
        ckpt_path.unlink(missing_ok=True)
    return history


def trained(config: RunConfig, *, cache_dir: str | Path | None = None, device: str | torch.device = "auto",
            progress: bool | None = None) -> tuple[Simulation, SimulationState]:
    """The run's simulation and final state, ready to look inside the trained models.

    The run comes from the cache when its final state was kept, and is run (and kept) otherwise.
    """
    device = resolve_device(device)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    run(config, cache_dir=folder, device=device, progress=progress, keep_state=True)
    state = SimulationState(**torch.load(folder / f"{cache_key(config, device)}.final", map_location=device,
                                         weights_only=False))
    sim = build(config, device, progress)
    sim.resume_state(state)
    return sim, state


@torch.no_grad()
def client_features(sim: Simulation, state: SimulationState, per_client: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Representations of each client's test images under the trained model, as the client sees them.

    Returns (Z (n, D), labels (n,), client ids (n,)); ``per_client`` > 0 keeps the first that many
    test images of each client.
    """
    zs, ys, cs = [], [], []
    for cid, data in enumerate(sim.federation.clients):
        x, y = data.x_test, data.y_test
        if per_client:
            x, y = x[:per_client], y[:per_client]
        x = sim.augment.eval_input(x, cid)
        zs.append(sim.algorithm.embed(state.server, state.clients[cid], x).cpu())
        ys.append(y.cpu())
        cs.append(torch.full_like(y.cpu(), cid))
    return torch.cat(zs), torch.cat(ys), torch.cat(cs)


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
    """A :func:`summarize` frame keyed by (row, column) labels as a table of ``"mean ± std"`` strings."""
    text = summary[metric].map("{:.3f}".format) + " ± " + summary[f"{metric}_std"].map("{:.3f}".format)
    return text.unstack().reindex(index=rows, columns=columns)


def group_frames(groups: Mapping[str, list[History]]) -> dict[str, pd.DataFrame]:
    """``{label: one frame of every seed's rounds}``, the form the plotting helpers take."""
    return {label: pd.concat([h.frame() for h in runs], ignore_index=True) for label, runs in groups.items()}


def summarize(groups: Mapping[str, list[History]]) -> pd.DataFrame:
    """Final metrics per label over its seeds: mean, std (population), min and max, and the seed count.

    Columns: ``global_accuracy`` (mean/std/min/max), ``mean_client_accuracy`` (mean/std),
    ``worst_client_accuracy`` (mean of each run's lowest client accuracy), ``dh``, ``seeds``.
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
                       "seeds": len(runs)}
    return pd.DataFrame.from_dict(rows, orient="index")


# ---------------------------------------------------------------------------------------- sweeps

def _run_one_thread(config: RunConfig, kwargs: dict[str, Any]) -> History:
    torch.set_num_threads(1)
    return run(config, **kwargs)


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
