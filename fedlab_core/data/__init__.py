"""Datasets as tensors, their split across clients, and the feature-skew benchmark.

:data:`DATASETS` lists every dataset a run can name, with what validation needs to know before any
file is read; :func:`load_dataset` loads one (cached in memory) and optionally takes a
class-stratified subset.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from . import partition
from .base import Dataset, DatasetNotFoundError, data_root, digest
from ..params import Range, Subset, check
from .domains import DEFAULT_DOMAINS, DOMAIN_TRANSFORMS, TEN_DOMAINS, make_domains, unused_images
from .federation import ClientData, Federation, federate, hold_out, monitor_unused
from .sources import DIGIT_DOMAINS, DOMAIN_DATASETS, LOADERS, load


@dataclass(frozen=True)
class DatasetInfo:
    """What a run needs to know about a dataset before loading it."""

    num_classes: int
    num_train: int | None  # None when it depends on the files (folder datasets)
    has_domains: bool = False
    shape: tuple[int, int, int] | None = None  # (C, H, W); None: (3, S, S), S the loader's image_size
    image_size: int = 64                       # S when the loader's image_size is not given
    domains: tuple[str, ...] = ()              # the domains a run may pick (loader option ``domains``)

    def input_shape(self, params: dict | None = None) -> tuple[int, int, int]:
        """(C, H, W) of one image when loaded with the loader options `params`."""
        if self.shape is not None:
            return self.shape
        size = (params or {}).get("image_size", self.image_size)
        return (3, size, size)

    def default_model(self, input_shape: tuple[int, int, int]) -> str:
        """The model "auto" picks: an MLP for tiny images, LeNet-5 up to 32x32, else ResNet-18."""
        size = input_shape[1]
        return "mlp" if size < 16 else "lenet5" if size <= 32 else "resnet18"


def _folder(num_classes: int, name: str) -> DatasetInfo:
    return DatasetInfo(num_classes, None, has_domains=True, domains=DOMAIN_DATASETS[name][1])


DATASETS: dict[str, DatasetInfo] = {
    "fashion_mnist": DatasetInfo(10, 60_000, shape=(1, 28, 28)),
    "fashion_mnist_domains": DatasetInfo(10, 60_000, has_domains=True, shape=(3, 28, 28),
                                         domains=tuple(DOMAIN_TRANSFORMS)),
    "digits": DatasetInfo(10, 1_347, shape=(1, 8, 8)),
    "mnist": DatasetInfo(10, 60_000, shape=(1, 28, 28)),
    "mnist_m": DatasetInfo(10, None, image_size=28),
    "digits4": DatasetInfo(10, None, has_domains=True, image_size=28, domains=DIGIT_DOMAINS),
    "cifar10": DatasetInfo(10, 50_000, shape=(3, 32, 32)),
    "cifar100": DatasetInfo(100, 50_000, shape=(3, 32, 32)),
    "svhn": DatasetInfo(10, 73_257, shape=(3, 32, 32)),
    "usps": DatasetInfo(10, 7_291, shape=(1, 16, 16)),
    "pacs": _folder(7, "pacs"),
    "officehome": _folder(65, "officehome"),
    "office_caltech10": _folder(10, "office_caltech10"),
    "domainnet": _folder(345, "domainnet"),
}

# The ranges of the loaders' options, by name (an option means the same in every loader that has it).
LOADER_CONSTRAINTS = {"image_size": Range(1), "test_fraction": Range(0, 1, high_open=True), "max_per_domain": Range(1),
                      "seed": Range(0), "domain_seed": Range(0), "samples_per_domain": Range(1),
                      "test_per_domain": Range(1), "threshold": Range(0, 1),
                      "train_share": Range(0, 1, low_open=True), "test_share": Range(0, 1, low_open=True)}


def check_dataset_params(name: str, params: dict, field: str = "dataset_params") -> dict:
    """The loader options of dataset `name` checked against the loader's signature (names and annotated
    types), :data:`LOADER_CONSTRAINTS` and the dataset's domains; normalised. ValueError naming `field`."""
    loader = load_fashion_mnist_domains if name == "fashion_mnist_domains" else LOADERS[name]
    constraints = {**LOADER_CONSTRAINTS, "domains": Subset(*DATASETS[name].domains)}
    return check(repr(name), loader, params, constraints, field)


def load_fashion_mnist_domains(root: str | Path | None = None, domains: Sequence[str] = DEFAULT_DOMAINS, domain_seed: int = 0,
                               samples_per_domain: int | None = None, test_per_domain: int | None = None) -> Dataset:
    """The feature-skew benchmark: Fashion-MNIST split into domains with synthetic style shifts.

    See :func:`fedlab_core.data.domains.make_domains`; `domain_seed` fixes the benchmark itself,
    independently of a run's seed.
    """
    return make_domains(load("fashion_mnist", root), tuple(domains), seed=domain_seed,
                        samples_per_domain=samples_per_domain, test_per_domain=test_per_domain)


@lru_cache(maxsize=4)
def _load_cached(name: str, options: tuple) -> Dataset:
    kwargs = dict(options)
    data = load_fashion_mnist_domains(**kwargs) if name == "fashion_mnist_domains" else load(name, **kwargs)
    data.notes["checksum"] = digest(data.x_train, data.y_train, data.x_test, data.y_test)   # of what was read
    return data


def _loaded(name: str, options: dict) -> Dataset:
    """The dataset as its loader reads it with `options`, kept in memory (:func:`_load_cached`)."""
    return _load_cached(name, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items())))


def _stratified_subset(y: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """Indices of a class-stratified random subset of `size` samples (sorted)."""
    labels = y.numpy()
    rng = np.random.default_rng([seed, 7])
    quota = partition._apportion(size, np.bincount(labels))
    picked = [rng.choice(np.flatnonzero(labels == c), q, replace=False) for c, q in enumerate(quota) if q]
    return torch.as_tensor(np.sort(np.concatenate(picked)))


def load_dataset(name: str, max_train: int = 0, max_test: int = 0, seed: int = 0, **options) -> Dataset:
    """Load a dataset of :data:`DATASETS` (kept in memory for reuse), optionally subsampled.

    Parameters
    ----------
    name : a key of :data:`DATASETS`.
    max_train, max_test : if > 0, keep a class-stratified random subset of at most this many samples.
    seed : seed of the subset.
    options : the loader's options (``root``, ``image_size``, ``domains``, ...).
    """
    if name not in DATASETS:
        raise ValueError(f"dataset: unknown value {name!r}; allowed: {', '.join(sorted(DATASETS))}")
    data = _loaded(name, options)
    keep = {}
    for split, limit in (("train", max_train), ("test", max_test)):
        y = getattr(data, f"y_{split}")
        if limit and limit < len(y):
            keep[split] = _stratified_subset(y, limit, seed)
    if not keep:
        return data
    fields = {}
    for split, idx in keep.items():
        for prefix in ("x_", "y_", "domain_"):
            value = getattr(data, prefix + split)
            if value is not None:
                fields[prefix + split] = value[idx]
    return Dataset(**{**data.__dict__, **fields})


def unused_training(name: str, max_train: int, seed: int, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """The training images (x, y) that :func:`load_dataset` with the same arguments leaves out of its subset: a
    pool no client holds, from which a run draws its validation sets (``RunConfig.validation_source``). Empty when
    `max_train` keeps every image."""
    data = _loaded(name, options)
    subset = bool(max_train and max_train < len(data.y_train))
    unused = torch.full((len(data.y_train),), subset)
    if subset:
        unused[_stratified_subset(data.y_train, max_train, seed)] = False
    return data.x_train[unused], data.y_train[unused]



def unused_domain_images(name: str, per_domain: int, root: str | Path | None = None,
                         domains: Sequence[str] = DEFAULT_DOMAINS, domain_seed: int = 0,
                         samples_per_domain: int | None = None, test_per_domain: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The feature-skew benchmark's counterpart of :func:`unused_training`: (x, y, domain ids) of at most
    `per_domain` training images per domain that no domain holds, styled like their domain
    (:func:`~fedlab_core.data.domains.unused_images`); the other arguments are the benchmark's options. Only the
    embedded benchmark has such images: ValueError naming ``validation_source`` for another dataset."""
    if name != "fashion_mnist_domains":
        raise ValueError("validation_source: 'unused' under the domain split draws from the images that the embedded "
                         f"benchmark 'fashion_mnist_domains' leaves out of its domains; {name!r} has none (use 'share')")
    base = _loaded("fashion_mnist", {} if root is None else {"root": root})
    return unused_images(base, tuple(domains), domain_seed, samples_per_domain, per_domain)


__all__ = [
    "DATASETS", "LOADER_CONSTRAINTS", "ClientData", "DataFileError", "check_dataset_params", "Dataset", "DatasetInfo", "DatasetNotFoundError", "Federation", "LOADERS",
    "data_root", "federate", "hold_out", "load", "load_dataset", "monitor_unused", "unused_domain_images", "unused_training", "load_fashion_mnist_domains", "make_domains", "TEN_DOMAINS", "partition",
]
