"""Tests for viz.tsne_embedding: shape, determinism, what it keeps apart, small inputs."""
import numpy as np
import pytest

from fedlab_core import viz


def _blobs(n_per=40, dim=20, gap=20.0, seed=0):
    """Three well-separated Gaussian blobs in `dim` dimensions: points (3 n_per, dim), labels (3 n_per,)."""
    rng = np.random.default_rng(seed)
    centres = gap * np.eye(3, dim)
    points = np.concatenate([c + rng.normal(size=(n_per, dim)) for c in centres])
    return points, np.repeat(np.arange(3), n_per)


def test_shape_and_determinism():
    z, _ = _blobs()
    a = viz.tsne_embedding(z, seed=0)
    assert a.shape == (len(z), 2) and np.isfinite(a).all()
    np.testing.assert_array_equal(a, viz.tsne_embedding(z, seed=0))


def test_separated_groups_stay_separated_and_mixed_ones_do_not():
    z, labels = _blobs()
    assert viz.class_separation(viz.tsne_embedding(z, seed=0), labels) > 0.6
    shuffled = np.random.default_rng(1).permutation(labels)  # labels that carry no structure
    assert abs(viz.class_separation(viz.tsne_embedding(z, seed=0), shuffled)) < 0.1


def test_small_inputs_lower_the_perplexity_and_tiny_ones_are_rejected():
    z, _ = _blobs(n_per=3)  # 9 points: the default perplexity 30 would be refused by scikit-learn
    assert viz.tsne_embedding(z, seed=0).shape == (9, 2)
    with pytest.raises(ValueError, match="at least 4 points"):
        viz.tsne_embedding(z[:3], seed=0)
