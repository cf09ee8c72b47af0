"""Runs: a frozen config and `run(config) -> History`.

A run is a pure function of its :class:`RunConfig` (seed included). :func:`run` reads a run the archive holds,
else the cache (:mod:`fedlab_core.store`), else computes it, writing checkpoints every few rounds: a killed
run started again resumes from its last checkpoint and ends with exactly the numbers of an uninterrupted run.
Sweeps of many runs are in :mod:`fedlab_core.sweeps`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
import typing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from .algorithms import ALGORITHMS, NonFiniteLossError, Training
from .algorithms.base import local_samples
from .augment import AUGMENTS
from .data import (DATASETS, check_dataset_params, federate, hold_out, load_dataset, monitor_unused,
                   unused_domain_images, unused_training)
from .data.transforms import TRAIN_TRANSFORMS
from .data import partition as P
from .convergence import VALIDATION
from .engine import EXECUTORS, INIT, Simulation, SimulationState, derive_seed, timing
from .engine import run_together as engine_run_together
from .kernels import cpu_model, cuda_determinism, deterministic, signature
from .models import MODELS, build_model, meta_model
from .parallel import available_cores
from .params import OneOf, Range, check_value
from .store import (Archive, History, Measurements, _atomic_write, _read_result, _read_state, _write_state, cache_key,
                    check_writable, code_version, default_cache_dir, library_versions)
from .store import settings as run_settings

log = logging.getLogger("fedlab_core")

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a federated run. Every field has a default.

    The local-training fields default to None: the method's own setting, its paper's
    (``ALGORITHMS[algorithm].paper_training``), so that changing the algorithm of a config never carries
    another method's rate along; a value given here overrides it (see :meth:`training`).

    Construction validates every field and raises one ``ValueError`` naming the field and what is
    allowed, before any data is loaded or any cache is touched.

    ``executor`` is part of the config because the floats differ: the batched executor
    (:mod:`fedlab_core.batched`) computes the loop's maths in another order. By default ("auto") a run is
    batched on a GPU, where the method and model allow it, and trains in the loop on a CPU; the run's meta
    says which executor computed it (``meta["executor"]``).
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
    validation: float = 0.0                         # > 0: evaluate on this held-out share of each client's training data
    validation_monitor: float = 0.0                 # > 0: also score a validation set at every evaluation (best round)
    validation_source: str = "share"                # its images: "share" holds validation_monitor of each client's
                                                    # training data out; "unused" draws validation_monitor times its
                                                    # test set from the training images no client holds
                                                    # (the domain split: fashion_mnist_domains' left-out images)
    # communication
    num_rounds: int = 20                            # communication rounds
    fraction: float = 1.0                           # fraction of clients sampled per round, in (0, 1]
    clients_per_round: int = 0                      # if > 0: sample exactly this many clients per round
    # local training (None: the method's own, its paper's setting)
    local_epochs: int | None = None                # local passes over the data per round (at most 1000)
    local_steps: int | None = None                  # if > 0: local mini-batches per round instead of epochs
    batch_size: int | None = None                   # local mini-batch size
    optimizer: str | None = None                    # "sgd" or "adam"
    lr: float | None = None                         # local learning rate
    momentum: float | None = None                   # local SGD momentum
    weight_decay: float | None = None               # local L2 penalty
    train_transform: str | None = None              # "flip_rotate": random flips and rotations of training images
    # how a round's clients are computed
    executor: str = "auto"                          # "loop" (clients one by one), "batched" (vectorised together;
                                                    # other floats) or "auto" (batched on a GPU, else the loop)
    # evaluation and randomness
    eval_every: int = 1                             # evaluate every this many rounds (and after the last)
    stop_at_plateau: bool = False                   # stop once the accuracy curve has converged (num_rounds: the cap)
    plateau_metric: str = "mean_client_accuracy"    # the curve stop_at_plateau tests ("global_accuracy", "validation_accuracy")
    patience: int = 1                               # stop_at_plateau: evaluations in a row that must pass the test
    seed: int = 0                                   # the run's seed: data split, model init, every client stream

    def __post_init__(self) -> None:
        validate(self)

    def replace(self, **changes) -> "RunConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def partition_options(self) -> dict[str, Any]:
        """The options of the chosen partition scheme, and only those (the others are at their defaults:
        :func:`validate` resets every option the scheme ignores, so one split has one cache key)."""
        return {
            "dirichlet": {"alpha": self.alpha, "min_size": self.min_size},
            "quantity": {"beta": self.beta, "min_size": self.min_size},
            "distrans": {"dh": self.dh, "classes_per_client": self.classes_per_client},
            "pathological": {"classes_per_client": self.classes_per_client or 2},
        }.get(self.partition, {})

    def training(self) -> Training:
        """The local training the run uses: the method's paper settings, with every field given here
        (not None) in their place."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(Training) if getattr(self, f.name) is not None}
        return dataclasses.replace(ALGORITHMS[self.algorithm].paper_training, **given)

    def model_name(self) -> str:
        """The model a run builds: ``model``, or for "auto" the dataset's default for its image size."""
        info = DATASETS[self.dataset]
        return self.model if self.model != "auto" else info.default_model(info.input_shape(self.dataset_params))


FINITE = math.inf  # an open upper bound at infinity: "finite"

# The partition options and the schemes that read them; validate() resets an option its scheme ignores.
PARTITION_OPTIONS = {"alpha": ("dirichlet",), "beta": ("quantity",), "min_size": ("dirichlet", "quantity"),
                     "dh": ("distrans",), "classes_per_client": ("distrans", "pathological")}

# The ranges and allowed values of RunConfig's fields; their types are the field annotations.
FIELD_CONSTRAINTS = {
    "algorithm": OneOf(*sorted(ALGORITHMS)), "augment": OneOf(*sorted(AUGMENTS)), "model": OneOf("auto", *sorted(MODELS)),
    "dataset": OneOf(*sorted(DATASETS)), "partition": OneOf(*sorted(P.PARTITIONS)), "optimizer": OneOf(*OPTIMIZERS),
    "max_train_samples": Range(0), "max_test_samples": Range(0), "alpha": Range(0, FINITE, True, True),
    "dh": Range(0, 1), "classes_per_client": Range(1), "beta": Range(0, FINITE, True, True), "min_size": Range(0),
    "num_clients": Range(1), "validation": Range(0, 1, high_open=True), "validation_monitor": Range(0, 1), "num_rounds": Range(1),
    "validation_source": OneOf("share", "unused"),
    "fraction": Range(0, 1, low_open=True),
    "clients_per_round": Range(0), "local_epochs": Range(1, 1000), "local_steps": Range(0), "batch_size": Range(1),
    "lr": Range(0, FINITE, True, True), "momentum": Range(0, 1, high_open=True), "weight_decay": Range(0, FINITE, high_open=True),
    "eval_every": Range(1), "seed": Range(0), "train_transform": OneOf(*TRAIN_TRANSFORMS),
    "plateau_metric": OneOf("mean_client_accuracy", "global_accuracy", VALIDATION), "patience": Range(1, 100),
    "executor": OneOf(*EXECUTORS),
}


def validate(c: RunConfig) -> None:
    """Check every field of `c` and normalise it in place (e.g. ``lr=1`` becomes ``1.0``).

    In order: each field's type and range; the algorithm's, augmentation's and dataset loader's own
    parameters, each against its declaration (:mod:`fedlab_core.params`); the combinations (partition
    options, clients against samples); then the model, built on the meta device (no memory, no data):
    that it takes the dataset's images and that the algorithm and augmentation can act on it (FedBN
    refuses a model without batch norm). Raises one ValueError whose message starts with the field.
    """
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        value = check_value(f"{f.name}:", getattr(c, f.name), hints[f.name], FIELD_CONSTRAINTS.get(f.name))
        object.__setattr__(c, f.name, dict(value) if isinstance(value, Mapping) else value)
    object.__setattr__(c, "algorithm_params", ALGORITHMS[c.algorithm].check_params(c.algorithm_params, "algorithm_params"))
    object.__setattr__(c, "augment_params", AUGMENTS[c.augment].check_params(c.augment_params, "augment_params"))
    object.__setattr__(c, "dataset_params", check_dataset_params(c.dataset, c.dataset_params))
    for name, schemes in PARTITION_OPTIONS.items():
        if c.partition not in schemes:  # ignored by this scheme: its default, so the cache key does not carry it
            object.__setattr__(c, name, RunConfig.__dataclass_fields__[name].default)
    if c.validation and c.validation_monitor:
        raise ValueError("validation_monitor: must be 0 when validation is set (the run is already scored on held-out "
                         f"training data); got {c.validation_monitor}")
    if c.validation_source == "share" and c.validation_monitor == 1:
        raise ValueError("validation_monitor: a share of each client's training data must be below 1; got 1.0")
    if c.validation_source == "unused":
        if not c.validation_monitor:
            raise ValueError("validation_source: 'unused' draws validation_monitor times the test set from unused "
                             "training images; set validation_monitor > 0 (e.g. 1.0)")
        if c.partition == "domain" and (c.dataset != "fashion_mnist_domains"
                                        or not c.dataset_params.get("samples_per_domain")):
            raise ValueError("validation_source: 'unused' under the domain split needs the embedded benchmark "
                             "'fashion_mnist_domains' with samples_per_domain (the images its domains leave out); got "
                             f"dataset {c.dataset!r}, samples_per_domain {c.dataset_params.get('samples_per_domain')}")
        if c.partition != "domain" and not c.max_train_samples:
            raise ValueError("validation_source: 'unused' needs a class split of a training subset (max_train_samples "
                             f"> 0) or the domain split of the embedded benchmark; got partition {c.partition!r}, "
                             f"max_train_samples {c.max_train_samples}")
    if c.plateau_metric == VALIDATION and not c.validation_monitor:
        raise ValueError(f"plateau_metric: {VALIDATION!r} reads the monitored validation shares; set validation_monitor "
                         "> 0 (e.g. 0.1)")
    if c.clients_per_round > c.num_clients:
        raise ValueError(f"clients_per_round: must be <= num_clients ({c.num_clients}); got {c.clients_per_round}")
    info = DATASETS[c.dataset]
    if c.partition == "distrans":
        if (c.dh is None) == (c.classes_per_client is None):
            raise ValueError("dh: partition 'distrans' needs exactly one of dh or classes_per_client")
        if c.dh is not None:
            try:
                P.classes_for_dh(c.dh, info.num_classes, c.num_clients)
            except ValueError as err:
                raise ValueError(f"dh: {err}") from None
    if c.partition in ("distrans", "pathological") and c.classes_per_client is not None:
        if not c.classes_per_client <= info.num_classes:
            raise ValueError(f"classes_per_client: must lie in [1, {info.num_classes}]; got {c.classes_per_client}")
    if c.partition == "domain" and not info.has_domains:
        raise ValueError(f"partition: 'domain' needs a dataset with domains "
                         f"({', '.join(n for n, i in DATASETS.items() if i.has_domains)}); got {c.dataset!r}")
    available = min(x for x in (info.num_train, c.max_train_samples or None) if x) if info.num_train else None
    if available is not None:
        needed = c.num_clients * (c.min_size if c.partition in ("dirichlet", "quantity") else 1)
        if needed > available:
            source = (f"max_train_samples keeps {available}" if available == c.max_train_samples
                      else f"{c.dataset!r} provides {available}")
            raise ValueError(f"num_clients: {c.num_clients} clients need at least {needed} training samples, "
                             f"but {source}")
    _check_model(c)


def _check_model(c: RunConfig) -> None:
    """The model takes the dataset's images, and the algorithm and augmentation can act on it."""
    info, name = DATASETS[c.dataset], c.model_name()
    shape = info.input_shape(c.dataset_params)
    try:
        model = meta_model(name, shape, info.num_classes)
    except ValueError as err:
        raise ValueError(f"model: {name!r} cannot take {c.dataset!r} images of shape {shape}: {err}") from None
    required = getattr(MODELS.get(name), "required_file", None)   # e.g. resnet18_imagenet's weights
    if required is not None and not required().is_file():
        raise FileNotFoundError(f"model: {name!r} needs its weights file {required()}, which is absent; weights are "
                                f"never downloaded: on a machine with internet save torchvision's ImageNet weights "
                                f"there (torchvision.models.resnet18(weights='IMAGENET1K_V1').state_dict())")
    for field_name, make in (("algorithm_params", lambda: ALGORITHMS[c.algorithm](training=c.training(),
                                                                                    **c.algorithm_params)),
                             ("augment_params", lambda: AUGMENTS[c.augment](**c.augment_params))):
        try:
            method = make()  # the constructor's own checks of combinations (e.g. OT alignment's variant and solver)
        except ValueError as err:
            raise ValueError(f"{field_name}: {err}") from None
        try:
            method.check_model(model)
        except ValueError as err:
            raise ValueError(f"model: {name!r} cannot be used here: {err}") from None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """The torch device a run uses: "auto" is CUDA when PyTorch sees a GPU, else the CPU.

    Raises ValueError naming ``device`` for an unknown device, or one this machine does not have.
    """
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {str(device)!r} asked for, but PyTorch sees no CUDA GPU on this machine; "
                             f"use cpu (or auto)")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"device: {str(device)!r} asked for, but this machine has "
                             f"{torch.cuda.device_count()} CUDA GPU(s), numbered from 0")
    elif d.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError("device: 'mps' asked for, but PyTorch sees no Apple GPU here; use cpu (or auto)")
    elif d.type != "cpu":
        raise ValueError(f"device: {str(device)!r} is not supported; use auto, cpu, cuda or cuda:N")
    return d


# ---------------------------------------------------------------------------------------- run

def resolve_workers(workers: int | None, device: torch.device) -> int:
    """The number of worker processes a run uses: `workers`, or by default every core on a CPU run and one
    on a GPU. Raises ValueError naming ``workers`` for a value that cannot be used."""
    if workers is None:
        return available_cores() if device.type == "cpu" else 1
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers: must be an integer >= 1; got {workers!r}")
    if workers > 1 and device.type != "cpu":
        raise ValueError(f"workers: more than one worker process needs a CPU run; got {workers} on {device}")
    return workers


@contextlib.contextmanager
def one_thread():
    """Torch runs with one thread inside the block (restored after): a run's numbers then never depend on
    the caller's thread count, and its parallelism comes from worker processes (see :mod:`.parallel`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build(config: RunConfig, device: torch.device, progress: bool | None = None, workers: int = 1) -> Simulation:
    """Load the data, split it, build the model, the algorithm and the augmentation."""
    data = load_dataset(config.dataset, max_train=config.max_train_samples, max_test=config.max_test_samples,
                        seed=config.seed, **config.dataset_params)
    federation = federate(data, config.partition, config.num_clients, config.seed, **config.partition_options())
    if config.validation:
        federation = hold_out(federation, config.validation, config.seed)
    if config.validation_monitor and config.validation_source == "unused" and config.partition == "domain":
        tested = Counter()   # test images per domain, over the clients that share it
        for c in federation.clients:
            tested[c.domain] += len(c.y_test)
        per_domain = math.ceil(config.validation_monitor * max(tested.values())) + federation.num_classes  # rounding
        pool = unused_domain_images(config.dataset, per_domain, **config.dataset_params)
        federation = monitor_unused(federation, *pool[:2], config.validation_monitor, config.seed, pool_domains=pool[2])
    elif config.validation_monitor and config.validation_source == "unused":
        pool_x, pool_y = unused_training(config.dataset, config.max_train_samples, config.seed, **config.dataset_params)
        federation = monitor_unused(federation, pool_x, pool_y, config.validation_monitor, config.seed)
    elif config.validation_monitor:
        federation = hold_out(federation, config.validation_monitor, config.seed, keep_test=True)
    federation = federation.to(device)
    model_name = config.model if config.model != "auto" else DATASETS[config.dataset].default_model(data.input_shape)
    torch.manual_seed(derive_seed(config.seed, 0, INIT))  # model initialisation has its own stream
    model = build_model(model_name, data.input_shape, data.num_classes).to(device)
    algorithm = ALGORITHMS[config.algorithm](training=config.training(), **config.algorithm_params)
    augment = AUGMENTS[config.augment](**config.augment_params)
    return Simulation(algorithm, federation, model, seed=config.seed, num_rounds=config.num_rounds,
                      fraction=config.fraction, clients_per_round=config.clients_per_round,
                      eval_every=config.eval_every, augment=augment, progress=progress, workers=workers,
                      stop_at_plateau=config.stop_at_plateau, plateau_metric=config.plateau_metric,
                      patience=config.patience, executor=config.executor)


def run(config: RunConfig, *, cache_dir: str | Path | None = None, use_cache: bool = True,
        checkpoint_every: int = 1, device: str | torch.device = "auto", progress: bool | None = None,
        keep_state: bool = False, on_diverge: str = "raise", workers: int | None = None) -> History:
    """Run a federated experiment, or return its cached result.

    Parameters
    ----------
    config : the experiment.
    cache_dir : where results and checkpoints live (default :func:`default_cache_dir`).
    use_cache : read and write the result cache and checkpoints.
    checkpoint_every : write a checkpoint every this many rounds (0: never).
    device : "auto" (CUDA when present), "cpu", "cuda", "cuda:1", ...
    progress : show a progress bar (None: only on a terminal).
    keep_state : also keep the final state (models, offsets, client states) in the cache, for
        :func:`trained`; a cached result without it is run again.
    on_diverge : "raise" (a NaN training loss raises :class:`NonFiniteLossError`) or "record": the run
        ends there and its history, with NaN final metrics and ``meta["diverged"]`` saying where, is the
        result (cached like any other: a divergence is deterministic).
    workers : processes that train the sampled clients side by side, each with one thread (None: every
        core on a CPU run, one on a GPU; see :mod:`fedlab_core.parallel`). Not part of the config: the
        whole run computes with one torch thread in every process, so its numbers are the same whatever
        `workers` and the caller's thread count.

    A round in which every sampled client fails raises :class:`~fedlab_core.algorithms.ClientsFailedError`
    with the clients' errors, and nothing is cached. A cached result or checkpoint that cannot be read, or
    that belongs to another run, is renamed (``<file>.damaged``; ``<file>.refused`` for a file holding
    more than data) with a one-line warning, and the run is computed again. ``meta["samples"]`` records
    the numbers of training and test samples the run actually used.
    """
    if on_diverge not in ("raise", "record"):
        raise ValueError(f"on_diverge: unknown value {on_diverge!r}; allowed: raise, record")
    if not isinstance(checkpoint_every, int) or isinstance(checkpoint_every, bool) or checkpoint_every < 0:
        raise ValueError(f"checkpoint_every: must be an integer >= 0; got {checkpoint_every!r}")
    device = resolve_device(device)
    workers = resolve_workers(workers, device)
    key = cache_key(config, device)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    result_path, ckpt_path, final_path = folder / f"{key}.json", folder / f"{key}.ckpt", folder / f"{key}.final"
    if use_cache:
        found = stored(config, cache_dir=folder, device=device, keep_state=keep_state)
        if found is not None:
            return found
        _check_cache(folder, cache_dir)
    with one_thread(), deterministic(device):
        history = _run(config, device, workers, key, result_path, ckpt_path, final_path, use_cache, checkpoint_every,
                       progress, keep_state, on_diverge)
    if use_cache:
        _to_archive(history, config, device)
    return history


def stored(config: RunConfig, *, cache_dir: str | Path | None = None, device: str | torch.device = "auto",
           keep_state: bool = False) -> History | None:
    """The run's result if the archive or the cache holds it (with `keep_state`, only the cache's result whose
    final state it kept too), else None; nothing is computed. The archive's entry may have been computed on the
    other type of device (its meta says which: :meth:`~fedlab_core.store.Archive.key_of`); the cache's are this
    device type's. A result found in the cache is added to the archive when writing to it is on."""
    device = resolve_device(device)
    key = cache_key(config, device)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if keep_state:   # the archive keeps no states: the cache's result, whose state it kept
        return _read_result(folder / f"{key}.json", config, key) if (folder / f"{key}.final").exists() else None
    archived = Archive().get(config, device)
    if archived is not None:
        return archived
    cached = _read_result(folder / f"{key}.json", config, key)
    if cached is not None:
        _to_archive(cached, config, device)
    return cached


def _to_archive(history: History, config: RunConfig, device: torch.device) -> None:
    """Add a finished run to the archive, when writing to it is on (a final state stays in the cache:
    :func:`measured` stores what a figure draws from it)."""
    if Archive.writing():
        Archive().add(history, config, device)


def samples_trained(history: History) -> list[int]:
    """The training samples each round's local updates went through, from the run's own record (its
    clients' training sizes and its resolved local training): every client's local epochs over its data, or
    its local steps' mini-batches, as :meth:`~fedlab_core.algorithms.Algorithm.batches` draws them. Methods
    whose clients train through that loop only (FedAvg and most). Raises ValueError for a round in which a
    client sat out or failed: which one is not recorded."""
    sizes = [sum(row) for row in history.meta["class_counts"]]  # (clients,) training samples
    training = Training(**history.meta["training"])
    per_round = sum(local_samples(n, training) for n in sizes)
    rows = []
    for r in history.rounds:
        if r["clients"] != len(sizes) or r["failed"]:
            raise ValueError(f"round {r['round']}: {r['clients']} of {len(sizes)} clients took part and {r['failed']} "
                             f"failed; the record does not say which, so the samples trained are unknown")
        rows.append(per_round)
    return rows


def rerun(history: History, rounds: int | None = None, workers: int | None = None) -> list[dict[str, Any]]:
    """The per-round rows of a stored run computed again from its config, for its first `rounds` rounds (None:
    all of them), with nothing read from or written to the cache or the archive: what
    :func:`fedlab_core.verification.verify` compares with the stored rows. `workers` as for :func:`run`."""
    config = RunConfig(**history.config)
    device = resolve_device(history.meta.get("device", "cpu"))
    with one_thread(), deterministic(device):
        state = build(config, device, progress=False, workers=resolve_workers(workers, device)).run(until=rounds)
    return state.rows


def _run(config, device, workers, key, result_path, ckpt_path, final_path, use_cache, checkpoint_every, progress,
         keep_state, on_diverge) -> History:
    """The body of :func:`run` once the cache had nothing: build, resume, run, record."""
    started = time.perf_counter()
    sim = build(config, device, progress, workers)
    state = _read_state(ckpt_path, key, device) if use_cache else None
    resumed_from = 0 if state is None else state.next_round - 1
    latest = {"state": state}
    diverged = None
    try:
        state = sim.run(state, on_round_end=_checkpointer(config, key, ckpt_path, use_cache, checkpoint_every, latest))
    except NonFiniteLossError as err:
        if on_diverge == "raise":
            raise
        diverged, state = str(err), latest["state"]
    return _record(config, device, key, sim, state, diverged, started, resumed_from,
                   (result_path, ckpt_path, final_path) if use_cache else None, keep_state)


def _checkpointer(config: RunConfig, key: str, ckpt_path: Path, use_cache: bool, checkpoint_every: int,
                  latest: dict[str, Any]) -> Callable[[SimulationState], None]:
    """What a run does after each round: remember its state in `latest`, and checkpoint it every
    `checkpoint_every` rounds (not after the last: the result is written then)."""
    def checkpoint(s: SimulationState) -> None:
        latest["state"] = s
        done = s.next_round - 1
        if use_cache and checkpoint_every and done % checkpoint_every == 0 and done < config.num_rounds:
            _write_state(ckpt_path, key, s)
    return checkpoint


def _record(config: RunConfig, device: torch.device, key: str, sim: Simulation, state: SimulationState | None,
            diverged: str | None, started: float, resumed_from: int, paths: tuple[Path, Path, Path] | None,
            keep_state: bool, together: int = 1) -> History:
    """A finished (or diverged) run's :class:`History`, written to the cache at `paths` (result, checkpoint,
    final state; None: not cached), the checkpoint removed. `together`: how many runs were trained together."""
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
        meta={"key": key, "device": device.type, "code_version": code_version(), "torch": torch.__version__,
              "dh": fed.dh, "class_counts": fed.class_counts.tolist(), "global_model": sim.algorithm.global_model,
              "training": dataclasses.asdict(sim.algorithm.training),
              "samples": {"train": sum(c.num_train for c in fed.clients), "test": len(fed.y_test),
                          "client_test": [len(c.y_test) for c in fed.clients]},
              "failed_clients": sum(r["failed"] for r in rows), "workers": min(sim.workers, fed.num_clients),
              "executor": "batched" if sim.batched else "loop", "trained_together": together,
              "seconds": timing(time.perf_counter() - started),
              "setup_bytes": list(state.setup_bytes) if state is not None else [0, 0],
              "resumed_from_round": resumed_from, "diverged": diverged,
              "stopped_at_plateau": rows[-1]["round"] if diverged is None and rows and sim.plateaued(state) else None,
              "data_checksum": fed.data_checksum, "split_hash": fed.split_hash(), "threads": torch.get_num_threads(),
              "versions": library_versions(), "cpu": cpu_model(),
              "kernels": signature() if device.type == "cpu" else None,
              "deterministic": cuda_determinism() if device.type == "cuda" else None,
              # the final models' input check, read by the verdicts' degeneracy guard (a model blind to its images)
              "unchanged_under_noise": input_dependence(sim, state) if diverged is None and rows else None},
    )
    history = History.from_json(history.to_json())  # the same normalised form a cache hit returns
    if paths is not None:
        result_path, ckpt_path, final_path = paths
        if keep_state and state is not None:
            _write_state(final_path, key, state)
        _atomic_write(result_path, lambda f: f.write(history.to_json().encode()))
        ckpt_path.unlink(missing_ok=True)
    return history


def _check_cache(folder: Path, cache_dir: str | Path | None) -> None:
    """:func:`check_writable` on the run cache's `folder`, naming the setting that chose it."""
    check_writable(folder, "cache_dir" if cache_dir is not None else
                   "FEDLAB_CACHE_DIR" if os.environ.get("FEDLAB_CACHE_DIR") else "the default cache folder")


def together(configs: list[RunConfig], which: list[int]) -> list[list[int]]:
    """The configs `which` (indices into `configs`) in the groups :func:`run_many` trains together, in their
    first appearance's order: configs equal but for the seed and the local training's rates (a tuning grid's
    rates and its seeds, say)."""
    groups: dict[str, list[int]] = {}
    for i in which:
        shared = {k: v for k, v in configs[i].to_dict().items() if k not in ("seed", "lr", "momentum", "weight_decay")}
        groups.setdefault(json.dumps(shared, sort_keys=True, default=str), []).append(i)
    return list(groups.values())


def run_many(configs: list[RunConfig], *, cache_dir: str | Path | None = None, use_cache: bool = True,
             checkpoint_every: int = 1, device: str | torch.device = "auto", progress: bool | None = None,
             keep_state: bool = False, on_diverge: str = "raise") -> list[History]:
    """:func:`run` for each config, the runs of each group of :func:`together` trained together, as one batched
    program (:func:`fedlab_core.engine.run_together`): the runs of a tuning grid or of several seeds, in one
    process, on one device (the GPU's use; on a CPU a sweep's runs in parallel processes are faster). Each run's
    numbers are those of the same config run alone; the cache, the archive, checkpoints (a killed group resumes
    each run from its own) and `on_diverge` work as in :func:`run`. A run is batched where its ``executor`` says
    so ("batched", or "auto" on a GPU) and the executor can train its method and model; one that is not takes
    its rounds in the loop, in one thread. `progress` is taken as :func:`run` takes it; runs trained together
    show no bar."""
    if on_diverge not in ("raise", "record"):
        raise ValueError(f"on_diverge: unknown value {on_diverge!r}; allowed: raise, record")
    device = resolve_device(device)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out: list[History | None] = [stored(c, cache_dir=folder, device=device, keep_state=keep_state) if use_cache else None
                                 for c in configs]
    if use_cache and any(h is None for h in out):
        _check_cache(folder, cache_dir)
    for group in together(configs, [i for i, h in enumerate(out) if h is None]):
        with one_thread(), deterministic(device):
            for i, history in zip(group, _together([configs[i] for i in group], device, folder, use_cache,
                                                   checkpoint_every, keep_state, on_diverge)):
                out[i] = history
                if use_cache:
                    _to_archive(history, configs[i], device)
    return out


def _together(configs: list[RunConfig], device: torch.device, folder: Path, use_cache: bool, checkpoint_every: int,
              keep_state: bool, on_diverge: str) -> list[History]:
    """The body of :func:`run_many` for one group: build each run, resume each, train them together, record each."""
    started = time.perf_counter()
    keys = [cache_key(c, device) for c in configs]
    paths = [(folder / f"{k}.json", folder / f"{k}.ckpt", folder / f"{k}.final") for k in keys]
    states = [_read_state(p[1], k, device) if use_cache else None for k, p in zip(keys, paths)]
    latest = [{"state": s} for s in states]
    resumed_from = [0 if s is None else s.next_round - 1 for s in states]  # before the states move on
    sims, starts = [], []
    for c, state in zip(configs, states):  # each run initialised right after its build, as alone (MOON's head and
        sims.append(build(c, device, progress=False))  # DisTrans's offsets draw from the stream the build left)
        starts.append(sims[-1].initial_state() if state is None else sims[-1].resume_state(state))
    ends = engine_run_together(sims, starts, [_checkpointer(c, k, p[1], use_cache, checkpoint_every, l)
                                              for c, k, p, l in zip(configs, keys, paths, latest)])
    out = []
    for c, k, p, sim, start, end, l in zip(configs, keys, paths, sims, resumed_from, ends, latest):
        diverged = None
        if isinstance(end, Exception):
            if not isinstance(end, NonFiniteLossError) or on_diverge == "raise":
                raise end
            diverged, end = str(end), l["state"]
        out.append(_record(c, device, k, sim, end, diverged, started, start,
                           p if use_cache else None, keep_state, together=len(configs)))
    return out


def trained(config: RunConfig, *, cache_dir: str | Path | None = None, device: str | torch.device = "auto",
            progress: bool | None = None) -> tuple[Simulation, SimulationState]:
    """The run's simulation and final state, ready to look inside the trained models.

    The state comes from the cache when it was kept there (and reads back), else the run is computed and its state
    kept; the archive keeps no states (:func:`measured` stores what a figure reads from them).
    """
    device = resolve_device(device)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final_path = folder / f"{cache_key(config, device)}.final"
    for _ in range(2):  # a damaged final state is set aside by _read_state, so the second pass runs it again
        run(config, cache_dir=folder, device=device, progress=progress, keep_state=True)
        state = _read_state(final_path, cache_key(config, device), device)
        if state is not None:
            break
    else:
        raise RuntimeError(f"{final_path}: the final state just written cannot be read back")
    sim = build(config, device, progress)
    sim.resume_state(state)
    return sim, state


def _measured_as(config: RunConfig, history: History, settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The settings that name a measurement of run `config` (:func:`measured`): its own, the device and result
    it is measured on (a digest of its final metrics and its length), and `settings`."""
    result = json.dumps({"final": history.final, "rounds": len(history.rounds)}, sort_keys=True)
    return {"run": run_settings(config), "device": history.meta.get("device"),
            "result": hashlib.sha256(result.encode()).hexdigest()[:16], "measure": dict(settings or {})}


def measured(name: str, config: RunConfig, measure: Callable[[Simulation, SimulationState], Any], *,
             settings: Mapping[str, Any] | None = None, sources: tuple[str, ...] = (),
             cache_dir: str | Path | None = None, device: str | torch.device = "auto",
             progress: bool | None = None) -> Any:
    """What ``measure(sim, state)`` finds in the run's trained models (:func:`trained`), stored as a
    measurement (:class:`~fedlab_core.store.Measurements`) when writing to the archive is on, and read from
    there afterwards: a figure drawn from a trained model then needs neither the model nor the run, and the
    archive keeps results, not models.

    A measurement is named by `name`, the run and the result it is measured on (its device and a digest of its
    final metrics: a run recomputed to other numbers is measured anew), `settings` (what `measure` is given
    besides the run) and `sources`, the code `measure` runs (files of the package or ``"file.py::function"``):
    a change to any of them measures anew, and ``make verify`` lists the stored measurements it left behind.
    The run is computed first (keeping its final state in the cache) when nothing holds it. Returns the values
    as JSON reads them back."""
    Measurements.check_name(name)
    device = resolve_device(device)
    history = stored(config, cache_dir=cache_dir, device=device)
    if history is None:
        history = run(config, cache_dir=cache_dir, device=device, progress=progress, keep_state=True)
    doc = Measurements().get(name, _measured_as(config, history, settings),
                             lambda: measure(*trained(config, cache_dir=cache_dir, device=device, progress=progress)),
                             sources, libraries=())
    return doc["values"]


def is_measured(name: str, config: RunConfig, *, settings: Mapping[str, Any] | None = None,
                sources: tuple[str, ...] = (), cache_dir: str | Path | None = None,
                device: str | torch.device = "auto") -> bool:
    """Whether :func:`measured` would read this measurement rather than take it; nothing is computed."""
    Measurements.check_name(name)
    history = stored(config, cache_dir=cache_dir, device=resolve_device(device))
    return history is not None and Measurements().find(name, _measured_as(config, history, settings),
                                                       sources, libraries=()) is not None


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


def feature_map(sim: Simulation, state: SimulationState, per_client: int = 0, seed: int = 0) -> dict[str, Any]:
    """What a UMAP picture of a run's features draws, measured on its trained models (for :func:`measured`, with
    :data:`FEATURE_MAP_SOURCES`): every client's test images (the first `per_client`) embedded as the client
    sees them (:func:`client_features`), their 2-D UMAP (:func:`~fedlab_core.viz.umap_embedding`, `seed`)
    rounded to 1e-3 (finer than a figure draws), their true classes and clients, and the picture's silhouette
    by class (:func:`~fedlab_core.viz.class_separation`, on the unrounded points)."""
    from .viz import class_separation, umap_embedding

    z, y, c = client_features(sim, state, per_client=per_client)
    xy = umap_embedding(z.numpy(), seed=seed)
    return {"xy": np.round(xy.astype(np.float64), 3).tolist(), "labels": y.tolist(), "clients": c.tolist(),
            "silhouette": class_separation(xy, y.numpy())}


FEATURE_MAP_SOURCES = ("runs.py::feature_map", "runs.py::client_features", "viz.py::umap_embedding",
                       "viz.py::class_separation")


def feature_mixing(sim: Simulation, state: SimulationState, per_client: int = 0) -> dict[str, float]:
    """How a run's trained models mix the clients in feature space (for :func:`measured`, with
    :data:`FEATURE_MIXING_SOURCES`), on every client's first `per_client` test images as it sees them
    (:func:`client_features`): the silhouette of the clients and of the classes on the features
    (:func:`~fedlab_core.viz.class_separation`), and how often an image's 5 nearest neighbours tell its client
    (scikit-learn's k-NN, 5-fold cross-validated)."""
    from sklearn.model_selection import cross_val_score
    from sklearn.neighbors import KNeighborsClassifier

    from .viz import class_separation

    z, y, c = (t.numpy() for t in client_features(sim, state, per_client=per_client))
    return {"clients": class_separation(z, c), "classes": class_separation(z, y),
            "neighbours tell the client": float(cross_val_score(KNeighborsClassifier(n_neighbors=5), z, c, cv=5).mean())}


def tsne_map(sim: Simulation, state: SimulationState, per_client: int = 0, seed: int = 0) -> dict[str, Any]:
    """What a t-SNE picture of a run's features draws (for :func:`measured`, with :data:`TSNE_MAP_SOURCES`): every
    client's first `per_client` test images as it sees them (:func:`client_features`), their 2-D t-SNE
    (:func:`~fedlab_core.viz.tsne_embedding`, `seed`) rounded to 1e-3, and each point's client and class."""
    from .viz import tsne_embedding

    z, y, c = client_features(sim, state, per_client=per_client)
    xy = tsne_embedding(z.numpy(), seed=seed)
    return {"xy": np.round(xy.astype(np.float64), 3).tolist(), "clients": c.tolist(), "labels": y.tolist()}


def test_set_checks(sim: Simulation, state: SimulationState) -> dict[str, Any]:
    """Where a run's trained model scores (for :func:`measured`, with :data:`TEST_SET_CHECK_SOURCES`): the raw global
    test set, that test set aligned as the clients' images were (None for a run that aligns nothing), and the
    clients' own training images as trained on; and the sizes of the clients' test sets. The OT chapter's
    test-set check."""
    from .augment.ot_align import OTAlign

    fed = sim.federation   # the clients' data as trained on (aligned when the run aligns)
    x_train, y_train = torch.cat([c.x_train for c in fed.clients]), torch.cat([c.y_train for c in fed.clients])
    aligned = sim.augment.align(fed.x_test) if isinstance(sim.augment, OTAlign) else None
    return {"raw test set": sim.accuracy(state, fed.x_test, fed.y_test),
            "aligned test set": None if aligned is None else sim.accuracy(state, aligned, fed.y_test),
            "own training images": sim.accuracy(state, x_train, y_train),
            "client test sizes": [len(c.y_test) for c in fed.clients]}


FEATURE_MIXING_SOURCES = ("runs.py::feature_mixing", "runs.py::client_features", "viz.py::class_separation")
TSNE_MAP_SOURCES = ("runs.py::tsne_map", "runs.py::client_features", "viz.py::tsne_embedding")
TEST_SET_CHECK_SOURCES = ("runs.py::test_set_checks", "augment/ot_align.py::OTAlign.align",
                          "engine.py::Simulation.accuracy")


@torch.no_grad()
def unchanged_under_noise(predict: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                          channels: int | None = None, seed: int = 0) -> float:
    """The share of `predict`'s classes on images `x` that stay the same when the images are replaced by
    Gaussian noise of their own mean and spread (the first `channels` channels; all when None). Near the
    share of the most frequent class for a model that reads its images; 1 for one that ignores them (a
    class read from a marker, an offset, a bias)."""
    if not len(x):
        raise ValueError("x: needs at least one image")
    k = x.shape[1] if channels is None else channels
    g = torch.Generator().manual_seed(seed)
    image = x[:, :k]
    noise = torch.randn(image.shape, generator=g, dtype=image.dtype).to(x.device)   # the same draws on any device
    noisy = torch.cat([noise * image.std() + image.mean(), x[:, k:]], 1)
    return float((predict(x).argmax(1) == predict(noisy).argmax(1)).float().mean())


def input_dependence(sim: Simulation, state: SimulationState, per_client: int = 500) -> list[float]:
    """Each client's :func:`unchanged_under_noise` under the trained models of a run (its `predict` on the
    first `per_client` test images, prepared as evaluation prepares them). Recorded in a run's meta as
    ``unchanged_under_noise``, it lets :func:`fedlab_core.verdicts.degenerate` refuse a model that ignores
    its input."""
    shares = []
    for cid, data in enumerate(sim.federation.clients):
        x = data.x_test[:per_client]
        if not len(x):
            shares.append(math.nan)
            continue
        predict = sim._predictor(state, cid)
        shares.append(unchanged_under_noise(lambda xb, cid=cid: predict(sim.augment.eval_input(xb, cid)), x,
                                            seed=cid))
    return shares
