"""Lab 6's checks accept FedRDN's statistics, its random normalisation and a nearest-centroid classifier,
and reject the common mistakes: wrong axes, Bessel's correction, pooled or summed statistics, a constant
channel's zero std, one draw per batch, unpaired statistics, an unused generator, an off-by-one draw, the
wrong normalisation formula, and a nearest-centroid that returns positions, the farthest class or the
nearest single point."""
import numpy as np
import pytest
import torch

from fedlab_core.labs import LabCheckError
from fedlab_core.labs import fedrdn_statistics as checks


# ------------------------------------------------------------------------------------ correct answers

def per_image_stats(x):
    return x.mean(dim=(2, 3)), x.std(dim=(2, 3), correction=0)


def client_statistics(x):
    means, stds = per_image_stats(x)
    sigma = stds.mean(0)
    return means.mean(0), torch.where(sigma > 1e-6, sigma, torch.ones_like(sigma))


def random_normalise(x, means, stds, generator):
    drawn = torch.randint(len(means), (len(x),), generator=generator)
    return (x - means[drawn][:, :, None, None]) / stds[drawn][:, :, None, None], drawn


def nearest_centroid(features, labels, queries):
    classes = np.unique(labels)
    centroids = np.stack([features[labels == c].mean(0) for c in classes])
    return classes[np.linalg.norm(queries[:, None] - centroids[None], axis=-1).argmin(1)]


def per_image_stats_numpy(x):
    a = x.numpy()
    return a.mean(axis=(2, 3)).tolist(), a.std(axis=(2, 3))  # lists and arrays are accepted


def test_correct_answers_pass(capsys):
    checks.check_per_image_stats(per_image_stats)
    checks.check_per_image_stats(per_image_stats_numpy)
    checks.check_client_statistics(client_statistics)
    checks.check_random_normalise(random_normalise)
    checks.check_nearest_centroid(nearest_centroid)
    assert capsys.readouterr().out.count("✔") == 5


# ---------------------------------------------------------------------------------------------- task 1

def stats_over_batch(x):
    return x.mean(dim=(0, 2, 3)), x.std(dim=(0, 2, 3), correction=0)


def stats_over_channels(x):
    return x.mean(dim=(1, 2, 3)), x.std(dim=(1, 2, 3), correction=0)


def stats_over_h_only(x):
    return x.mean(dim=2), x.std(dim=2, correction=0)


def unbiased_std(x):
    return x.mean(dim=(2, 3)), x.std(dim=(2, 3))


def variance(x):
    return x.mean(dim=(2, 3)), x.var(dim=(2, 3), correction=0)


def uncentred(x):
    return x.mean(dim=(2, 3)), x.square().mean(dim=(2, 3)).sqrt()


@pytest.mark.parametrize("wrong, message", [(stats_over_batch, "averaged over the images"),
                                            (stats_over_channels, "reduced the channels"),
                                            (stats_over_h_only, "both H and W"),
                                            (unbiased_std, "Bessel"),
                                            (variance, "variances"),
                                            (uncentred, "subtract each image's channel mean")])
def test_per_image_stats_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_per_image_stats(wrong)


# ---------------------------------------------------------------------------------------------- task 2

def pooled(x):
    flat = x.transpose(0, 1).reshape(x.shape[1], -1)
    return flat.mean(1), flat.std(1, correction=0)


def summed(x):
    means, stds = per_image_stats(x)
    return means.sum(0), stds.sum(0)


def no_floor(x):
    means, stds = per_image_stats(x)
    return means.mean(0), stds.mean(0)


def epsilon_instead_of_floor(x):
    means, stds = per_image_stats(x)
    return means.mean(0), stds.mean(0) + 1e-5


def unbiased_client(x):
    sigma = x.std(dim=(2, 3)).mean(0)
    return x.mean(dim=(2, 3)).mean(0), torch.where(sigma > 1e-6, sigma, torch.ones_like(sigma))


def per_image_only(x):
    return per_image_stats(x)


@pytest.mark.parametrize("wrong, message", [(pooled, "pooled"), (summed, "sum of the"),
                                            (no_floor, "replaced by 1"), (epsilon_instead_of_floor, "replaced by 1"),
                                            (unbiased_client, "Bessel"), (per_image_only, "is per image")])
def test_client_statistics_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_client_statistics(wrong)


# ---------------------------------------------------------------------------------------------- task 3

def _apply(x, mu, sd):
    return (x - mu[:, :, None, None]) / sd[:, :, None, None]


def per_batch(x, means, stds, generator):
    j = torch.randint(len(means), (1,), generator=generator).expand(len(x))
    return _apply(x, means[j], stds[j]), j


def independent(x, means, stds, generator):
    i = torch.randint(len(means), (len(x),), generator=generator)
    j = torch.randint(len(means), (len(x),), generator=generator)
    return _apply(x, means[i], stds[j]), i


def global_rng(x, means, stds, generator):
    drawn = torch.randint(len(means), (len(x),))
    return _apply(x, means[drawn], stds[drawn]), drawn


def off_by_one(x, means, stds, generator):
    drawn = torch.randint(len(means) - 1, (len(x),), generator=generator)
    return _apply(x, means[drawn], stds[drawn]), drawn


def multiplies(x, means, stds, generator):
    drawn = torch.randint(len(means), (len(x),), generator=generator)
    return (x - means[drawn][:, :, None, None]) * stds[drawn][:, :, None, None], drawn


def inverse(x, means, stds, generator):
    drawn = torch.randint(len(means), (len(x),), generator=generator)
    return x * stds[drawn][:, :, None, None] + means[drawn][:, :, None, None], drawn


def style_transfer(x, means, stds, generator):
    drawn = torch.randint(len(means), (len(x),), generator=generator)
    own_m, own_s = per_image_stats(x)
    return _apply(x, own_m, own_s) * stds[drawn][:, :, None, None] + means[drawn][:, :, None, None], drawn


def in_place(x, means, stds, generator):
    drawn = torch.randint(len(means), (len(x),), generator=generator)
    x -= means[drawn][:, :, None, None]
    x /= stds[drawn][:, :, None, None]
    return x, drawn


@pytest.mark.parametrize("wrong, message", [(per_batch, "one draw for the whole batch"),
                                            (independent, "different clients"),
                                            (global_rng, "generators seeded alike"),
                                            (off_by_one, "never drawn"),
                                            (multiplies, "multiplied by sigma"),
                                            (inverse, "inverse map"),
                                            (style_transfer, "style transfer"),
                                            (in_place, "in place")])
def test_random_normalise_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_random_normalise(wrong)


# ---------------------------------------------------------------------------------------------- task 4

def positions(features, labels, queries):
    classes = np.unique(labels)
    centroids = np.stack([features[labels == c].mean(0) for c in classes])
    return np.linalg.norm(queries[:, None] - centroids[None], axis=-1).argmin(1)


def farthest(features, labels, queries):
    classes = np.unique(labels)
    centroids = np.stack([features[labels == c].mean(0) for c in classes])
    return classes[np.linalg.norm(queries[:, None] - centroids[None], axis=-1).argmax(1)]


def nearest_point(features, labels, queries):
    return labels[np.linalg.norm(queries[:, None] - features[None], axis=-1).argmin(1)]


@pytest.mark.parametrize("wrong, message", [(positions, "positions of the centroids"),
                                            (farthest, "farthest"),
                                            (nearest_point, "nearest single point")])
def test_nearest_centroid_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_nearest_centroid(wrong)


def test_student_fedrdn_matches_the_library():
    """The experiment's augmentation, with a correct random_normalise, trains on the library's batches."""
    from fedlab_core.augment import FedRDN

    means, stds = checks._pool()
    x = torch.rand(5, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    y = torch.zeros(5, dtype=torch.int64)
    mine, library = checks.fedrdn_with(random_normalise), FedRDN()
    for aug in (mine, library):
        aug.means, aug.stds = means, stds
    got = mine.train_batch(None, x, y, 0, torch.Generator().manual_seed(1))[0]
    assert torch.allclose(got, library.train_batch(None, x, y, 0, torch.Generator().manual_seed(1))[0])


def test_domain_clients():
    domain_of = torch.tensor([0] * 10 + [3] * 6)
    clients = checks.domain_clients(domain_of, sizes=[1, 5], per_domain=2, seed=0)
    assert len(clients) == 2 * 2 * 2
    for d, n, idx in clients:
        assert len(idx) == n == len(set(idx.tolist())) and (domain_of[idx] == d).all()
