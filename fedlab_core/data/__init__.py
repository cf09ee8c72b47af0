"""Datasets as tensors, their split across clients, and the feature-skew benchmark.

:data:`DATASETS` lists every dataset a run can name, with what validation needs to know before any
file is read; :func:`load_dataset` loads one (cached in memory) and optionally takes a
class-stratified subset.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from . import partition
from .base import Dataset, DatasetNotFoundError, data_root
from .domains import DEFAULT_DOMAINS, make_domains
from .federation import ClientData, Federation, federate
from .sources import LOADERS, load


@dataclass(frozen=True)
class DatasetInfo:
    """What a run needs to know about a dataset before loading it."""

    num_classes: int
    num_train: int | None  # None when it depends on the files (folder datasets)
    has_domains: bool = False

    def default_model(self, input_shape: tuple[int, int, int]) -> str:
        """The model "auto" picks: an MLP for tiny images, LeNet-5 up to 32x32, else ResNet-18."""
        size = input_shape[1]
        return "mlp" if size < 16 else "lenet5" if size <= 32 else "resnet18"


DATASETS: dict[str, DatasetInfo] = {
    "fashion_mnist": DatasetInfo(10, 60_000),
    "fashion_mnist_domains": DatasetInfo(10, 60_000, has_domains=True),
    "digits": DatasetInfo(10, 1_347),
    "mnist": DatasetInfo(10, 60_000),
    "mnist_m": DatasetInfo(10, None),
    "cifar10": DatasetInfo(10, 50_000),
    "cifar100": DatasetInfo(100, 50_000),
    "svhn": DatasetInfo(10, 73_257),
    "usps": DatasetInfo(10, 7_291),
    "pacs": DatasetInfo(7, None, has_domains=True),
    "officehome": DatasetInfo(65, None, has_domains=True),
    "office_caltech10": DatasetInfo(10, None, has_domains=True),
    "domainnet": DatasetInfo(345, None, has_domains=True),
}


def load_fashion_mnist_domains(root: str | Path | None = None, domains=DEFAULT_DOMAINS, domain_seed: int = 0,
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
    if name == "fashion_mnist_domains":
        return load_fashion_mnist_domains(**kwargs)
    return load(name, **kwargs)


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
    data = _load_cached(name, tuple(sorted((k, v if not isinstance(v, list) else tuple(v))
                                           for k, v in options.items())))
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


__all__ = [
    "DATASETS", "ClientData", "Dataset", "DatasetInfo", "DatasetNotFoundError", "Federation", "LOADERS",
    "data_root", "federate", "load", "load_dataset", "load_fashion_mnist_domains", "make_domains", "partition",
]
