"""Checks for Lab 1, partitioning data and measuring heterogeneity.

The student writes the Dirichlet label-skew split (Hsu, Qi and Brown, "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification", 2019: each class is shared among
the clients with proportions drawn from Dir(alpha)), the clients' class-count matrix, and DisTrans's
distributional-heterogeneity metric DH (Yuan et al., "Addressing Heterogeneity in Federated Learning via
Distributional Transformation", ECCV 2022, Eq. 3-4). Each check runs the student's function on small
labelled sets with known answers and compares it with :mod:`fedlab_core.data.partition`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..data import partition
from . import LabCheckError, close, passed, require


def _labels(num_classes: int = 10, per_class: int = 200, seed: int = 0) -> np.ndarray:
    """A shuffled label vector with `per_class` samples of each class."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def _parts(split: Callable, labels: np.ndarray, num_clients: int, alpha: float, seed: int) -> list[np.ndarray]:
    """The student's split, checked to be a partition of every index into `num_clients` parts."""
    what = f"dirichlet_split(labels, num_clients={num_clients}, alpha={alpha}, rng)"
    parts = split(labels, num_clients, alpha, np.random.default_rng(seed))
    require(isinstance(parts, (list, tuple)), f"{what}: returned {type(parts).__name__}, expected a list of "
                                              "index arrays, one per client")
    require(len(parts) == num_clients, f"{what}: returned {len(parts)} parts, expected one per client "
                                       f"({num_clients})")
    parts = [np.asarray(p) for p in parts]
    for k, p in enumerate(parts):
        require(p.ndim == 1 and (p.size == 0 or np.issubdtype(p.dtype, np.integer)),
                f"{what}: client {k}'s part is not a 1-D array of integer sample indices")
    every = np.concatenate(parts) if parts else np.empty(0, np.int64)
    seen = np.bincount(every, minlength=labels.size) if every.size else np.zeros(labels.size, np.int64)
    require(seen.size == labels.size and every.min(initial=0) >= 0,
            f"{what}: index outside 0..{labels.size - 1}")
    if (seen > 1).any():
        raise LabCheckError(f"{what}: sample {int(np.argmax(seen > 1))} is given to {int(seen.max())} clients; "
                            "every sample must go to exactly one client")
    if (seen == 0).any():
        raise LabCheckError(f"{what}: {int((seen == 0).sum())} of {labels.size} samples are given to no client "
                            "(rounding the proportions drops samples: give the remainder to some client)")
    return parts


def _label_mix(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """(clients, classes): each client's share of each class."""
    return partition.class_counts(parts, labels, num_classes) / np.bincount(labels, minlength=num_classes)


def check_dirichlet_split(split: Callable) -> None:
    """`split(labels, num_clients, alpha, rng) -> list of index arrays`: a Dirichlet label-skew split.

    Checked: a partition of every index; with a huge alpha every client gets about 1/K of each class;
    with a small alpha each class is concentrated on few clients and the classes' proportions differ
    (one Dirichlet draw per class); and, over several seeds, the number of classes a client holds
    matches :func:`fedlab_core.data.partition.dirichlet` on the same labels.
    """
    labels, num_classes, num_clients = _labels(), 10, 5
    for alpha in (0.1, 1.0):
        _parts(split, labels, num_clients, alpha, seed=1)
    shares = _label_mix(_parts(split, labels, num_clients, 1e4, seed=2), labels, num_classes)
    worst = float(np.abs(shares - 1 / num_clients).max())
    require(worst < 0.05, f"dirichlet_split with alpha=1e4: a client holds {worst + 1 / num_clients:.2f} of a "
                          f"class, expected about 1/{num_clients} (a huge alpha means equal proportions)")
    ours, theirs = [], []
    for seed in range(8):
        mix = _label_mix(_parts(split, labels, num_clients, 0.1, seed=10 + seed), labels, num_classes)
        require(float(mix.max(axis=0).mean()) > 0.5,
                "dirichlet_split with alpha=0.1: each class is spread evenly over the clients; draw each "
                "class's proportions from Dir(alpha), so that a small alpha concentrates it on few clients")
        require(float(np.abs(mix - mix.mean(axis=1, keepdims=True)).max()) > 0.2,
                "dirichlet_split with alpha=0.1: every class is shared in the same proportions, so every "
                "client has the same label mix; draw a fresh Dirichlet vector for each class")
        ours.append((mix > 0).sum(axis=1).mean())
        reference = partition.dirichlet(labels, num_clients, seed=seed, alpha=0.1, min_size=1)
        theirs.append((partition.class_counts(reference, labels, num_classes) > 0).sum(axis=1).mean())
    require(abs(np.mean(ours) - np.mean(theirs)) < 1.5,
            f"dirichlet_split with alpha=0.1: clients hold {np.mean(ours):.1f} classes on average, the library's "
            f"split {np.mean(theirs):.1f}; the proportions should be drawn from Dir(alpha) over the clients")
    passed("dirichlet_split: every sample goes to exactly one client, and alpha controls the label skew")


def check_class_counts(count: Callable) -> None:
    """`count(parts, labels, num_classes) -> (clients, classes)` matrix of samples per class per client."""
    labels = np.array([0, 0, 1, 2, 2, 2, 1, 0])
    parts = [np.array([0, 2]), np.array([1, 3, 4, 5]), np.array([6, 7]), np.array([], dtype=np.int64)]
    expected = partition.class_counts(parts, labels, 5)   # classes 3 and 4, held by nobody, keep their columns
    got = np.asarray(count(parts, labels, 5))
    require(got.shape == expected.shape, f"class_counts: shape {got.shape}, expected {expected.shape} "
                                         "(one row per client, one column per class, including unseen classes)")
    close(got, expected, "class_counts")
    passed("class_counts: one row per client, one column per class")


def check_dh(dh: Callable) -> None:
    """`dh(counts) -> float`: DisTrans's DH of a (clients, classes) count matrix, checked on hand cases."""
    cases = {
        "every client holds every class": np.ones((3, 4), dtype=int),
        "no class is shared": np.eye(4, dtype=int) * 5,
        "class 3 held by one client only": np.array([[2, 1, 0, 4], [1, 1, 1, 0], [0, 3, 2, 0]]),
        "two clients, one shared class of two": np.array([[5, 0], [2, 7]]),
        "a random split": partition.class_counts(partition.dirichlet(_labels(), 6, seed=3, alpha=0.2, min_size=1),
                                                  _labels(), 10),
    }
    for name, counts in cases.items():
        expected = partition.dh_of(counts, counts.shape[1])
        got = dh(counts.copy())
        require(np.ndim(got) == 0, f"dh ({name}): returned shape {np.shape(got)}, expected one number")
        if not np.isclose(float(got), expected, atol=1e-9):
            one_holder_as_one = 1 - (counts > 0).sum() / counts.size
            hint = ("; a class only one client holds counts as 0 holders (c_j = 0), not 1"
                    if np.isclose(float(got), one_holder_as_one, atol=1e-9) else "")
            raise LabCheckError(f"dh ({name}): {float(got):.4f}, expected {expected:.4f}{hint}")
    passed("dh: matches DisTrans's DH on every hand-made case")
