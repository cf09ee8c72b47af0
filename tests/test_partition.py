"""Partitions: determinism, the DH metric and its targets, test-set protocols, bad input."""
import numpy as np
import pytest

from fedlab_core.data import partition as P

LABELS = np.repeat(np.arange(10), 600)       # 10 balanced classes
TEST_LABELS = np.repeat(np.arange(10), 100)


def _disjoint_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "clients share samples"
    assert len(allidx) == n, "some samples are unassigned"


def test_dh_of_hand_example():
    # N = 4 classes, C = 3 clients: class 1 held by two clients (c = 2), the others by one (c = 0).
    assert P.dh_of([[0, 1], [1, 2], [3]], 4) == pytest.approx(1 - 2 / 12)
    assert P.dh_of([[0, 1, 2, 3]] * 3, 4) == 0.0          # everyone holds everything: i.i.d.
    assert P.dh_of([[0], [1], [2], [3]], 4) == 1.0        # nothing shared
    counts = np.array([[5, 0, 1, 0], [0, 3, 2, 0], [0, 0, 0, 7]])
    assert P.dh_of(counts, 4) == pytest.approx(P.dh_of([[0, 2], [1, 2], [3]], 4))


@pytest.mark.parametrize("dh,u", [(0.0, 10), (0.4, 6), (0.6, 4), (0.8, 2), (1.0, 1)])
def test_distrans_split_reaches_dh_targets(dh, u):
    assert P.classes_for_dh(dh, 10, 10) == u
    parts = P.distrans(LABELS, 10, seed=3, dh=dh)
    counts = P.class_counts(parts, LABELS, 10)
    assert ((counts > 0).sum(axis=1) == u).all()
    assert P.dh_of(counts, 10) == pytest.approx(dh)
    _disjoint_cover(parts, LABELS.size)


@pytest.mark.parametrize("dh,u", [(0.25, 6), (0.5, 4), (0.75, 2)])
def test_dh_targets_with_eight_clients_and_classes(dh, u):
    assert P.classes_for_dh(dh, 8, 8) == u


def test_distrans_shares_follow_uniform_weights():
    # Two holders per class with s ~ U(0.4, 0.6): each holder's share lies in [0.4, 0.6].
    parts = P.distrans(LABELS, 10, seed=0, dh=0.8)
    counts = P.class_counts(parts, LABELS, 10)
    shares = counts[counts > 0] / 600
    assert shares.min() >= 0.4 - 1e-9 and shares.max() <= 0.6 + 1e-9


def test_unreachable_dh_lists_reachable_values():
    with pytest.raises(ValueError, match="not reachable.*0.8"):
        P.classes_for_dh(0.85, 10, 10)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        P.classes_for_dh(1.2, 10, 10)


SCHEMES = {
    "iid": {}, "dirichlet": {"alpha": 0.3}, "pathological": {"classes_per_client": 2},
    "distrans": {"dh": 0.6}, "quantity": {"beta": 0.5},
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_schemes_are_deterministic_disjoint_and_complete(scheme):
    a = P.PARTITIONS[scheme](LABELS, 10, 1, **SCHEMES[scheme])
    b = P.PARTITIONS[scheme](LABELS, 10, 1, **SCHEMES[scheme])
    c = P.PARTITIONS[scheme](LABELS, 10, 2, **SCHEMES[scheme])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    _disjoint_cover(a, LABELS.size)


def test_dirichlet_many_clients_tiny_alpha_terminates_with_min_size():
    labels = np.repeat(np.arange(10), 6000)
    parts = P.dirichlet(labels, 1000, seed=0, alpha=0.01, min_size=10)
    assert len(parts) == 1000 and min(map(len, parts)) >= 10
    _disjoint_cover(parts, labels.size)


def test_dirichlet_small_alpha_is_more_skewed():
    def mean_classes(alpha):
        counts = P.class_counts(P.dirichlet(LABELS, 10, 0, alpha=alpha), LABELS, 10)
        return (counts > 0).sum(1).mean()
    assert mean_classes(0.05) < mean_classes(100.0) == 10


def test_pathological_gives_at_most_k_classes():
    counts = P.class_counts(P.pathological(LABELS, 20, 0, classes_per_client=2), LABELS, 10)
    assert ((counts > 0).sum(1) <= 2).all()


def test_quantity_skew_sizes_vary_labels_do_not():
    parts = P.quantity(LABELS, 10, 0, beta=0.3, min_size=20)
    sizes = np.array(list(map(len, parts)))
    assert sizes.min() >= 20 and sizes.max() > 3 * sizes.min()
    big = parts[int(sizes.argmax())]
    assert (np.bincount(LABELS[big], minlength=10) > 0).all()


def test_domain_split_one_domain_per_client():
    domains = np.repeat(np.arange(4), 250)
    parts = P.domain(domains, 8, 0)
    for i, p in enumerate(parts):
        assert set(domains[p]) == {i % 4}
    _disjoint_cover(parts, domains.size)


def test_test_sets_follow_client_class_proportions_and_cover_global_set():
    parts = P.distrans(LABELS, 10, 0, dh=0.8)
    tests = P.split_test(parts, LABELS, TEST_LABELS, 0)
    _disjoint_cover(tests, TEST_LABELS.size)
    train_counts = P.class_counts(parts, LABELS, 10)
    test_counts = P.class_counts(tests, TEST_LABELS, 10)
    assert ((test_counts > 0) <= (train_counts > 0)).all()        # no class a client never trained on
    np.testing.assert_allclose(test_counts / 100, train_counts / 600, atol=0.011)


def test_one_class_positive_label_protocol():
    parts = P.one_class(LABELS, 10, 0)
    counts = P.class_counts(parts, LABELS, 10)
    assert ((counts > 0).sum(1) == 1).all() and P.dh_of(counts, 10) == 1.0
    tests = P.one_class_test(parts, LABELS, TEST_LABELS, 0)
    for p, t in zip(parts, tests):
        own = LABELS[p[0]]
        positives = (TEST_LABELS[t] == own).sum()
        assert positives == 100 and len(t) == 2 * positives


@pytest.mark.parametrize("call,match", [
    (lambda: P.dirichlet(LABELS, 10, 0, alpha=0.0), "alpha"),
    (lambda: P.dirichlet(LABELS, 10, 0, alpha=-1), "alpha"),
    (lambda: P.iid(LABELS, LABELS.size + 1, 0), "num_clients"),
    (lambda: P.dirichlet(LABELS, 1000, 0, min_size=10), "num_clients"),
    (lambda: P.pathological(LABELS, 10, 0, classes_per_client=11), "classes_per_client"),
    (lambda: P.distrans(LABELS, 10, 0), "exactly one"),
    (lambda: P.distrans(LABELS, 10, 0, dh=0.55), "not reachable"),
    (lambda: P.domain(np.repeat(np.arange(4), 10), 3, 0), "domains"),
])
def test_bad_input_raises_clear_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
