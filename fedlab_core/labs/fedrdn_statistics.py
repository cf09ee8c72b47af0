"""Checks for Lab 6, FedRDN's statistics and what they reveal about a client.

FedRDN (Yan, Zhou, Zhao, Li and Liu, "A Simple Data Augmentation for Feature Distribution Skewed
Federated Learning"; see :mod:`fedlab_core.augment.fedrdn`) has every client share the channel-wise
statistics of its training images: the mean over images of each image's channel means and channel
standard deviations (population std, Eq. 4-5, averaged as the authors' code does). During training each
image is normalised ``(x - mu_j) / sigma_j`` with the statistics of a client j drawn at random from the
shared list (Eq. 6). The student writes these three steps and then an attack on them: a nearest-centroid
classifier that tells from a client's shared statistics which domain (style) its images come from.

Checks:

- :func:`check_per_image_stats`: per-image channel means and population stds, (B, C) each, against
  :func:`~fedlab_core.augment.fedrdn.image_statistics` applied image by image (wrong axes, Bessel's
  correction, a variance or an uncentred root mean square are named);
- :func:`check_client_statistics`: a client's shared pair ``(mu, sigma)``, (C,) each, against what
  :meth:`FedRDN.setup <fedlab_core.augment.fedrdn.FedRDN.setup>` computes on a hand-made federation
  (the pooled pixel std of conventional normalisation, Eq. 4's literal sum, the unbiased std and a
  constant channel's zero std are named);
- :func:`check_random_normalise`: one training batch normalised with randomly drawn clients'
  statistics, against :meth:`FedRDN.train_batch <fedlab_core.augment.fedrdn.FedRDN.train_batch>` with
  the same generator (one draw per batch, mean and std of different clients, an unused generator, an
  off-by-one draw, multiplying by sigma and the inverse map are named);
- :func:`check_nearest_centroid`: nearest-centroid labels on hand-made points where the farthest
  centroid, the nearest single sample and a centroid's position instead of its label all give other
  answers, then on random points against scikit-learn's ``NearestCentroid``.

The experiment helpers (:func:`domain_clients`, :func:`fedrdn_with`) keep the notebook short.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..augment.fedrdn import MIN_STD, FedRDN, image_statistics
from ..data.federation import ClientData, Federation
from . import LabCheckError, close, passed, require


# ----------------------------------------------------------------------------------------------- helpers

def _array(value, what: str) -> np.ndarray:
    """`value` (tensor, array, list) as a float64 array, or a LabCheckError naming `what`."""
    try:
        if hasattr(value, "detach"):
            value = value.detach().cpu()
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise LabCheckError(f"{what}: expected an array of numbers, got {type(value).__name__} ({error})") from None


def _pair(out, what: str, names: str) -> tuple[np.ndarray, np.ndarray]:
    """The two arrays of a returned pair (a tuple or list of two)."""
    require(isinstance(out, (tuple, list)) and len(out) == 2,
            f"{what}: returned {type(out).__name__}, expected a pair ({names})")
    return _array(out[0], f"{what}, {names.split(',')[0]}"), _array(out[1], f"{what}, {names.split(', ')[1]}")


def _near(a: np.ndarray, b, atol: float = 1e-5) -> bool:
    b = np.asarray(b.detach().cpu() if hasattr(b, "detach") else b, dtype=np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, atol=atol, rtol=1e-4))


def _images(batch: int, channels: int, h: int, w: int, seed: int) -> torch.Tensor:
    """Random images whose brightness and contrast differ from image to image and channel to channel."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(batch, channels, h, w, generator=g)
    scale = 0.2 + 0.8 * torch.rand(batch, channels, 1, 1, generator=g)
    shift = 0.5 * torch.rand(batch, channels, 1, 1, generator=g)
    return (shift + scale * base).clamp(0, 1)


# ------------------------------------------------------------------------------------------------ task 1

def _per_image_reference(x: torch.Tensor, unbiased: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C) means and stds: the library's image_statistics of each image alone."""
    stats = [image_statistics(x[i:i + 1], unbiased) for i in range(len(x))]
    return torch.stack([m for m, _ in stats]), torch.stack([s for _, s in stats])


def _axes_hint(shape: tuple, x_shape: tuple, what: str) -> None:
    b, c, h, w = x_shape
    if shape == (c,):
        raise LabCheckError(f"{what}: shape {shape}, one value per channel; you averaged over the images too: "
                            f"expected ({b}, {c}), one value per image and channel (reduce H and W only)")
    if shape == (b,):
        raise LabCheckError(f"{what}: shape {shape}, one value per image; you reduced the channels too: expected "
                            f"({b}, {c}), one value per image and channel (reduce H and W only)")
    if shape in ((b, c, h), (b, c, w)):
        raise LabCheckError(f"{what}: shape {shape}; reduce over both H and W (dims 2 and 3), expected ({b}, {c})")
    require(shape == (b, c), f"{what}: shape {shape}, expected ({b}, {c}), one value per image and channel")


def check_per_image_stats(per_image_stats: Callable) -> None:
    """`per_image_stats(x)` for images x (B, C, H, W) returns ``(means, stds)``, each (B, C): each image's
    channel mean and population standard deviation over its H x W pixels (Eq. 5)."""
    for batch, channels, h, w, seed in ((3, 2, 2, 3, 0), (1, 3, 4, 4, 1), (5, 3, 3, 5, 2)):
        x = _images(batch, channels, h, w, seed)
        what = f"per_image_stats on images of shape {tuple(x.shape)}"
        out = per_image_stats(x.clone())
        means, stds = _pair(out, what, "means, stds")
        want_mean, want_std = _per_image_reference(x)
        _axes_hint(means.shape, tuple(x.shape), f"{what}: means")
        close(means, want_mean, f"{what}: means", atol=1e-5)
        _axes_hint(stds.shape, tuple(x.shape), f"{what}: stds")
        if _near(stds, _per_image_reference(x, unbiased=True)[1]):
            raise LabCheckError(f"{what}: these stds divide by HW - 1 (Bessel's correction, torch's default); "
                                "Eq. 5 divides by HW: use the population std (correction=0 / unbiased=False)")
        if _near(stds, want_std ** 2):
            raise LabCheckError(f"{what}: these are variances; FedRDN's sigma is the standard deviation (take the "
                                "square root)")
        rms = x.double().flatten(2).square().mean(2).sqrt()
        if _near(stds, rms):
            raise LabCheckError(f"{what}: these stds are the root mean square of the pixels; subtract each "
                                "image's channel mean before squaring")
        close(stds, want_std, f"{what}: stds", atol=1e-5)
    passed("per_image_stats: each image's channel means and population standard deviations, (B, C) each")


# ------------------------------------------------------------------------------------------------ task 2

def _hand_federation() -> tuple[list[torch.Tensor], Federation]:
    """Three clients of 2, 5 and 3 RGB 4 x 4 images; client 1's last channel is constant in every image
    (a different constant per image)."""
    xs = [_images(n, 3, 4, 4, seed) for n, seed in ((2, 10), (5, 11), (3, 12))]
    xs[1][:, 2] = torch.linspace(0.2, 0.8, 5).view(5, 1, 1)
    clients = [ClientData(x, torch.zeros(len(x), dtype=torch.int64), x[:1], torch.zeros(1, dtype=torch.int64), cid=k)
               for k, x in enumerate(xs)]
    federation = Federation(clients, xs[0][:1], torch.zeros(1, dtype=torch.int64), num_classes=2,
                            input_shape=(3, 4, 4), class_counts=np.zeros((3, 2)), scheme="hand", dataset="hand")
    return xs, federation


def check_client_statistics(client_statistics: Callable) -> None:
    """`client_statistics(x)` for one client's images x (N, C, H, W) returns ``(mu, sigma)``, each (C,): the
    mean over the images of their channel means and of their channel population stds, with a std at or
    below 1e-6 replaced by 1; exactly what FedRDN's set-up shares (checked on three clients, one of them
    with a constant channel)."""
    xs, federation = _hand_federation()
    rdn = FedRDN()
    rdn.setup(federation, 0)
    for k in (0, 2, 1):  # client 1, with the constant channel, last
        x = xs[k]
        n = len(x)
        what = f"client_statistics on client {k}'s {n} images"
        mu, sigma = _pair(client_statistics(x.clone()), what, "mu, sigma")
        if mu.shape == (n, 3) or sigma.shape == (n, 3):
            raise LabCheckError(f"{what}: shape ({n}, 3) is per image; average the per-image statistics over the "
                                "images: expected (3,), one value per channel")
        require(mu.shape == (3,) and sigma.shape == (3,),
                f"{what}: shapes {mu.shape} and {sigma.shape}, expected (3,) each, one value per channel")
        per_mean, per_std = _per_image_reference(x)
        if _near(mu, per_mean.sum(0)):
            raise LabCheckError(f"{what}: mu is the sum of the {n} per-image means (Eq. 4 as printed); divide by the "
                                "number of images, as the library and the authors' code do (a sum grows with the "
                                "client's size)")
        close(mu, rdn.means[k], f"{what}: mu", atol=1e-5)
        pooled = x.double().transpose(0, 1).reshape(3, -1).std(1, correction=0)
        if _near(sigma, pooled):
            raise LabCheckError(f"{what}: sigma is the std of all the client's pixels pooled (conventional "
                                "normalisation's); FedRDN shares the mean over images of each image's own std")
        if _near(sigma, per_std.sum(0)):
            raise LabCheckError(f"{what}: sigma is the sum of the {n} per-image stds (Eq. 4 as printed); divide by "
                                "the number of images")
        if _near(sigma, _per_image_reference(x, unbiased=True)[1].mean(0)):
            raise LabCheckError(f"{what}: sigma uses per-image stds with Bessel's correction (1/(HW-1)); Eq. 5 "
                                "divides by HW (population std)")
        flat = per_std.mean(0) <= MIN_STD
        if flat.any() and not np.isclose(sigma[flat.numpy()], 1.0).all():
            c = int(np.flatnonzero(flat.numpy())[0])
            raise LabCheckError(f"{what}: channel {c} is constant in every image, so its std is 0; got sigma "
                                f"{sigma[c]:.3g}, expected 1 (a std at or below 1e-6 is replaced by 1: the channel is "
                                "only centred, never divided by ~0)")
        close(sigma, rdn.stds[k], f"{what}: sigma", atol=1e-5)
    passed("client_statistics: the mean of per-image channel means and stds, as FedRDN's set-up shares them")


# ------------------------------------------------------------------------------------------------ task 3

def _pool(k: int = 4, channels: int = 3, seed: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return 0.2 + 0.6 * torch.rand(k, channels, generator=g), 0.1 + 0.3 * torch.rand(k, channels, generator=g)


def _library_batch(x, means, stds, seed: int, **options) -> torch.Tensor:
    rdn = FedRDN(**options)
    rdn.means, rdn.stds = means.clone(), stds.clone()
    return rdn.train_batch(None, x.clone(), torch.zeros(len(x), dtype=torch.int64), 0,
                           torch.Generator().manual_seed(seed))[0]


def _call_normalise(fn: Callable, x, means, stds, seed: int, what: str):
    out = fn(x.clone(), means.clone(), stds.clone(), torch.Generator().manual_seed(seed))
    x_hat, drawn = _pair(out, what, "normalised images, drawn clients")
    return x_hat, drawn


def check_random_normalise(random_normalise: Callable) -> None:
    """`random_normalise(x, means, stds, generator)` for images x (B, C, H, W) and the shared statistics
    means, stds (K, C) returns ``(x_hat, drawn)``: drawn (B,) = ``torch.randint(K, (B,), generator=generator)``
    and ``x_hat[b] = (x[b] - means[drawn[b]]) / stds[drawn[b]]`` per channel; the same batch as
    FedRDN's ``train_batch`` (per image, paired) gives with a generator in the same state."""
    means, stds = _pool()
    k = len(means)
    x = _images(6, 3, 5, 5, seed=21)
    seed = 3
    what = f"random_normalise on {len(x)} images with K = {k} clients' statistics"
    x_before = x.clone()
    out = random_normalise(x, means.clone(), stds.clone(), torch.Generator().manual_seed(seed))
    require(torch.equal(x, x_before), f"{what}: the input images were changed in place; return new tensors")
    require(isinstance(out, (tuple, list)) and len(out) == 2,
            f"{what}: returned {type(out).__name__}, expected a pair (normalised images, drawn clients)")
    x_hat, drawn = _array(out[0], f"{what}, normalised images"), _array(out[1], f"{what}, drawn clients")
    want_drawn = torch.randint(k, (len(x),), generator=torch.Generator().manual_seed(seed)).numpy()
    require(drawn.shape == (len(x),), f"{what}: drawn has shape {drawn.shape}, expected ({len(x)},), one client "
                                      "index per image")
    if len(set(drawn.tolist())) == 1:
        raise LabCheckError(f"{what}: every image got client {int(drawn[0])}'s statistics: one draw for the whole "
                            "batch (the authors' code); the paper (Eq. 6) draws for each image")
    if not np.array_equal(drawn, want_drawn):
        again = _call_normalise(random_normalise, x, means, stds, seed, what)[1]
        if not np.array_equal(again, drawn):
            raise LabCheckError(f"{what}: two calls with generators seeded alike drew different clients; draw with "
                                "the generator given: torch.randint(K, (B,), generator=generator)")
        big = _images(400, 3, 2, 2, seed=22)
        many = _call_normalise(random_normalise, big, means, stds, seed, what)[1]
        if many.min() > 0 or many.max() < k - 1:
            missing = 0 if many.min() > 0 else k - 1
            raise LabCheckError(f"{what}: over 400 images client {missing} was never drawn; draw from all K clients "
                                "0..K-1 (torch.randint's upper bound, K, is excluded)")
        raise LabCheckError(f"{what}: drew clients {drawn.astype(int).tolist()}, expected "
                            f"{want_drawn.tolist()} from torch.randint(K, (B,), generator=generator) called once")
    require(x_hat.shape == tuple(x.shape), f"{what}: normalised images of shape {x_hat.shape}, expected "
                                           f"{tuple(x.shape)}")
    want = _library_batch(x, means, stds, seed)
    mu, sd = means[want_drawn].view(-1, 3, 1, 1), stds[want_drawn].view(-1, 3, 1, 1)
    if _near(x_hat, _library_batch(x, means, stds, seed, pairing="independent")):
        raise LabCheckError(f"{what}: each image's mean and std come from different clients (the authors' code); "
                            "the paper draws one client j and uses its pair (mu_j, sigma_j)")
    if _near(x_hat, (x - mu) * sd):
        raise LabCheckError(f"{what}: (x - mu_j) is multiplied by sigma_j; divide by it: (x - mu_j) / sigma_j")
    if _near(x_hat, x * sd + mu):
        raise LabCheckError(f"{what}: x * sigma_j + mu_j is the inverse map (it un-normalises); FedRDN normalises: "
                            "(x - mu_j) / sigma_j")
    own_m, own_s = (t[:, :, None, None] for t in _per_image_reference(x))
    if _near(x_hat, (x - own_m) / own_s * sd + mu):
        raise LabCheckError(f"{what}: this re-styles each image to client j's statistics (a style transfer); Eq. 6 "
                            "only normalises with them: (x - mu_j) / sigma_j")
    if _near(x_hat, x - mu):
        raise LabCheckError(f"{what}: the images are centred but not scaled; divide by sigma_j too")
    close(x_hat, want, f"{what}: normalised images", atol=1e-5)
    passed("random_normalise: one client drawn per image with the generator, its (mu, sigma) applied, as "
           "FedRDN's train_batch does")


# ------------------------------------------------------------------------------------------------ task 4

def _nearest_centroid(features: np.ndarray, labels: np.ndarray, queries: np.ndarray) -> np.ndarray:
    classes = np.unique(labels)
    centroids = np.stack([features[labels == c].mean(0) for c in classes])
    d = ((queries[:, None, :] - centroids[None]) ** 2).sum(-1)
    return classes[d.argmin(1)]


def check_nearest_centroid(nearest_centroid: Callable) -> None:
    """`nearest_centroid(features, labels, queries)`: features (N, D) with integer labels (N,) and queries
    (M, D), numpy arrays, returns (M,) labels: for each query the label whose centroid (the mean of that
    label's features) is nearest in Euclidean distance."""
    features = np.array([[0.0, 0.0], [4.0, 0.0], [5.5, 0.0], [6.5, 0.0], [0.0, 10.0], [0.0, 12.0]])
    labels = np.array([5, 5, 2, 2, 9, 9])  # centroids: 5 at (2, 0), 2 at (6, 0), 9 at (0, 11)
    queries = np.array([[4.5, 0.0], [1.0, 1.0], [0.0, 9.0], [7.0, 0.0]])
    want = np.array([2, 5, 9, 2])
    what = "nearest_centroid on 6 points of labels 5, 5, 2, 2, 9, 9"
    got = _array(nearest_centroid(features.copy(), labels.copy(), queries.copy()), what)
    require(got.shape == (len(queries),), f"{what}: shape {got.shape}, expected ({len(queries)},), one label per "
                                          "query")
    if not np.array_equal(got, want):
        if np.array_equal(got, [1, 0, 2, 1]) or np.array_equal(got, [0, 1, 2, 0]):
            raise LabCheckError(f"{what}: returned {got.astype(int).tolist()}, the positions of the centroids; "
                                f"return their labels, expected {want.tolist()}")
        if got[0] == 5 and np.array_equal(got[1:], want[1:]):
            raise LabCheckError(f"{what}: query (4.5, 0) got label 5, the label of its nearest single point (4, 0); "
                                "compare the query with each label's centroid (the mean of its points): expected 2")
        if np.array_equal(got, [9, 9, 2, 9]):
            raise LabCheckError(f"{what}: returned {got.astype(int).tolist()}, the farthest centroids; take the "
                                f"nearest (argmin of the distances), expected {want.tolist()}")
        raise LabCheckError(f"{what}: returned {got.tolist()}, expected {want.tolist()}")
    rng = np.random.default_rng(30)
    labels = rng.permutation(np.repeat(np.array([7, 1, 4, 0, 3]), 12))
    features = rng.normal(size=(len(labels), 6)) + 0.4 * labels[:, None]
    queries = rng.normal(size=(25, 6)) + 0.4 * rng.integers(0, 8, size=(25, 1))
    want = _nearest_centroid(features, labels, queries)
    from sklearn.neighbors import NearestCentroid

    require(np.array_equal(want, NearestCentroid().fit(features, labels).predict(queries)),
            "nearest_centroid: the check's own reference disagrees with scikit-learn (a bug in the check)")
    what = "nearest_centroid on 60 random points in 6-D (labels 0, 1, 3, 4, 7)"
    got = _array(nearest_centroid(features.copy(), labels.copy(), queries.copy()), what)
    require(got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}")
    if not np.array_equal(got, want):
        i = int(np.flatnonzero(got != want)[0])
        raise LabCheckError(f"{what}: query {i} got label {got[i]:g}, expected {want[i]} (scikit-learn's "
                            "NearestCentroid agrees)")
    passed("nearest_centroid: each query gets the label of the nearest class mean")


# ------------------------------------------------------------------------------------ experiment helpers

def domain_clients(domain_of: torch.Tensor, sizes: Sequence[int], per_domain: int,
                   seed: int) -> list[tuple[int, int, torch.Tensor]]:
    """Hypothetical clients drawn from a multi-domain training set: for every domain d and size n in `sizes`,
    `per_domain` clients, each holding n distinct images of domain d (images may recur across clients).
    `domain_of` (N,) holds each image's domain id. Returns ``(domain, n, indices)`` triples."""
    rng = np.random.default_rng(seed)
    domain_of = np.asarray(domain_of)
    out = []
    for d in np.unique(domain_of):
        pool = np.flatnonzero(domain_of == d)
        for n in sizes:
            require(n <= len(pool), f"domain_clients: a client of {n} images, but domain {d} has {len(pool)}")
            for _ in range(per_domain):
                out.append((int(d), int(n), torch.as_tensor(rng.choice(pool, n, replace=False))))
    return out


class _StudentFedRDN(FedRDN):
    """FedRDN whose training batches go through a student's `random_normalise`."""

    def __init__(self, random_normalise: Callable):
        super().__init__()
        self.random_normalise = random_normalise

    def train_batch(self, model, x, y, cid, rng):
        x_hat, _ = self.random_normalise(x, self.means, self.stds, rng)
        return torch.as_tensor(x_hat, dtype=x.dtype, device=x.device), y


def fedrdn_with(random_normalise: Callable) -> FedRDN:
    """The library's FedRDN augmentation (its set-up and test-time normalisation) with training batches
    normalised by `random_normalise(x, means, stds, generator)`: plug it into a run with
    :func:`fedlab_core.labs.simulate` (``augment=``)."""
    return _StudentFedRDN(random_normalise)
