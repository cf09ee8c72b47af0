"""Lab 1's checks accept a correct Dirichlet split, class counts and DH, and reject the common mistakes."""
import numpy as np
import pytest

from fedlab_core.data import partition
from fedlab_core.labs import LabCheckError
from fedlab_core.labs import partitions as checks


def dirichlet_split(labels, num_clients, alpha, rng):
    parts = [[] for _ in range(num_clients)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        cuts = np.round(np.cumsum(rng.dirichlet(np.full(num_clients, alpha))) * idx.size).astype(int)[:-1]
        for k, share in enumerate(np.split(idx, cuts)):
            parts[k].append(share)
    return [np.concatenate(p) for p in parts]


def floored(labels, num_clients, alpha, rng):
    parts = [[] for _ in range(num_clients)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        counts = np.floor(rng.dirichlet(np.full(num_clients, alpha)) * idx.size).astype(int)
        starts = np.concatenate([[0], np.cumsum(counts)])
        for k in range(num_clients):
            parts[k].append(idx[starts[k]:starts[k] + counts[k]])
    return [np.concatenate(p) for p in parts]


def overlapping(labels, num_clients, alpha, rng):
    parts = dirichlet_split(labels, num_clients, alpha, rng)
    return [np.concatenate([parts[0], parts[1][:1]]), *parts[1:]]


def one_draw_for_all_classes(labels, num_clients, alpha, rng):
    props = rng.dirichlet(np.full(num_clients, alpha))
    parts = [[] for _ in range(num_clients)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        for k, share in enumerate(np.split(idx, np.round(np.cumsum(props) * idx.size).astype(int)[:-1])):
            parts[k].append(share)
    return [np.concatenate(p) for p in parts]


def ignores_alpha(labels, num_clients, alpha, rng):
    parts = [[] for _ in range(num_clients)]
    for c in np.unique(labels):
        for k, share in enumerate(np.array_split(rng.permutation(np.flatnonzero(labels == c)), num_clients)):
            parts[k].append(share)
    return [np.concatenate(p) for p in parts]


def test_a_correct_answer_passes(capsys):
    checks.check_dirichlet_split(dirichlet_split)
    checks.check_class_counts(partition.class_counts)
    checks.check_dh(lambda counts: partition.dh_of(counts, counts.shape[1]))
    assert capsys.readouterr().out.count("✔") == 3


@pytest.mark.parametrize("wrong, message", [
    (floored, "given to no client"),
    (overlapping, "given to 2 clients"),
    (one_draw_for_all_classes, "same label mix"),
    (ignores_alpha, "spread evenly"),
    (lambda labels, k, alpha, rng: dirichlet_split(labels, k, alpha, rng)[:-1], "one per client"),
])
def test_dirichlet_split_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_dirichlet_split(wrong)


@pytest.mark.parametrize("wrong, message", [
    (lambda parts, labels, n: partition.class_counts(parts, labels, n).T, "shape"),
    (lambda parts, labels, n: np.stack([np.bincount(labels[p], minlength=labels.max() + 1) for p in parts]),
     "including unseen classes"),
    (lambda parts, labels, n: partition.class_counts(parts, labels, n) / 2, "expected"),
])
def test_class_counts_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_class_counts(wrong)


def single_holders_count_as_one(counts):
    return float(1 - (counts > 0).sum(axis=0).sum() / counts.size)


def divided_by_classes_only(counts):
    holders = (counts > 0).sum(axis=0)
    return float(1 - np.where(holders > 1, holders, 0).sum() / counts.shape[1])


@pytest.mark.parametrize("wrong, message", [
    (single_holders_count_as_one, "counts as 0 holders"),
    (divided_by_classes_only, "expected"),
    (lambda counts: np.zeros(3), "one number"),
])
def test_dh_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_dh(wrong)
