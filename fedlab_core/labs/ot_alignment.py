"""Checks for Lab 5, aligning client images with optimal transport.

The paper: "Optimal Transport-based Domain Alignment as a Preprocessing Step for Federated Learning"
(anonymous ICLR submission). Before FedAvg starts, each client describes every colour channel of its
images by a Wasserstein barycenter of the images' intensity distributions and uploads it; the server takes
the barycenter of these barycenters (the target) and sends it back; each client maps every image, channel
by channel, onto the target (its Algorithm 1). The library implements it as
:class:`fedlab_core.augment.OTAlign` (variant ``"sound"``); the student writes the pieces with numpy and
POT, and each check compares them with the library's functions of :mod:`fedlab_core.augment.ot_align`:

- :func:`check_channel_histogram`: a batch's per-channel intensity histogram over ``bins`` levels
  ``k / (bins - 1)`` (each pixel counts for its nearest level), normalised, against
  :func:`~fedlab_core.augment.ot_align.channel_histograms`; catches unnormalised counts, mixed-up channels
  and ``np.histogram``'s floor binning.
- :func:`check_wasserstein`: the p-Wasserstein distance between two histograms on the levels (``ot.emd2``),
  against :func:`~fedlab_core.augment.ot_align.histogram_distance` (p = 1) and POT's 1-D closed form
  (p = 2); catches a missing p-th root, a cost not raised to the power p, a cost on bin indices and
  unnormalised inputs.
- :func:`check_barycenter`: the 2-Wasserstein barycenter of histograms (``ot.bregman.barycenter``), against
  :func:`~fedlab_core.augment.ot_align.barycenter_1d` (entropic, same ``reg``, or exact); catches the plain
  mean of the histograms, unnormalised inputs and a cost on bin indices.
- :func:`check_transport_map`: the monotone (quantile-matching) map of a source histogram onto a target,
  a new value per level, against :func:`~fedlab_core.augment.ot_align.monotone_map`; catches the map in
  the wrong direction, the target's quantile at ``F(k)`` instead of its mean over the level's share, and
  unnormalised inputs.
- :func:`check_align_images`: every image mapped channel by channel by its own histogram onto the
  target, against the library's tables; catches mixed-up channels, one map for the whole batch and pixels
  looked up at a truncated level.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..augment.ot_align import (barycenter_1d, channel_histograms, histogram_distance, intensity_support,
                                level_index, monotone_map)
from . import LabCheckError, close, passed, require


# ------------------------------------------------------------------------- helpers

def _array(answer, what: str) -> np.ndarray:
    """The student's answer as a float64 numpy array (numpy, torch, lists or a number)."""
    try:
        value = answer.detach().cpu() if hasattr(answer, "detach") else answer
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise LabCheckError(f"{what}: expected an array of numbers, got {type(answer).__name__} ({error})") from None


def _call(fn: Callable, what: str, hint: str, *args):
    """The student's `fn(*args)`; an error other than nbgrader's NotImplementedError becomes a LabCheckError
    naming the call and a hint (the original error stays chained below it)."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the student's code may raise anything
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise LabCheckError(f"{what} raised {type(error).__name__} ({first}); {hint}") from error


def _matches(got: np.ndarray, variant, atol: float = 1e-6) -> bool:
    want = np.asarray(variant, dtype=np.float64)
    return got.shape == want.shape and bool(np.allclose(got, want, atol=atol, rtol=1e-5))


def _support(bins: int) -> np.ndarray:
    return intensity_support(bins).numpy()


def _bump(support: np.ndarray, centre: float, width: float) -> np.ndarray:
    h = np.exp(-((support - centre) ** 2) / (2 * width ** 2))
    return h / h.sum()


def _random_histograms(n: int, bins: int, seed: int, empty: float = 0.3) -> np.ndarray:
    """(n, bins) random normalised histograms with some empty levels (never all empty)."""
    rng = np.random.default_rng(seed)
    h = rng.gamma(0.7, size=(n, bins)) * (rng.random((n, bins)) > empty)
    h[:, rng.integers(bins)] += 0.5  # at least one level with mass
    return h / h.sum(1, keepdims=True)


def _images(n: int, channels: int, size: int, seed: int) -> torch.Tensor:
    """(n, C, size, size) float32 8-bit images (values k / 255): a black background (about a third of the
    pixels) and channels that occupy different intensity ranges, so that mixing them up shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, channels, size, size)
    for c in range(channels):
        low, high = 0.15 + 0.25 * c, 0.45 + 0.25 * c
        x[:, c] = low + (high - low) * torch.rand(n, size, size, generator=g)
    x = x * (torch.rand(n, 1, size, size, generator=g) > 0.35)  # the same background in every channel
    return (x * 255).round() / 255


# ------------------------------------------------------------------------- task 1

def check_channel_histogram(channel_histogram: Callable) -> None:
    """`channel_histogram(images, bins) -> (C, bins)`: the batch's pooled histogram per channel, each pixel
    counted at its nearest level ``round(x (bins - 1))``, each row summing to 1."""
    for n, channels, size, bins, seed in ((4, 3, 6, 8, 0), (7, 1, 5, 16, 1), (3, 3, 10, 256, 2)):
        x = _images(n, channels, size, seed)
        what = f"channel_histogram of {n} images of shape ({channels}, {size}, {size}) with bins={bins}"
        got = _array(channel_histogram(x, bins), what)
        expected = channel_histograms(x, bins).mean(0).numpy()  # per image, then averaged: the pooled histogram
        require(got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape} (one "
                                             "histogram per channel, pooled over the whole batch)")
        sums = got.sum(1)
        require(bool(np.allclose(sums, 1.0, atol=1e-6)),
                f"{what}: channel 0's histogram sums to {sums[0]:.6g}, expected 1; divide the counts by the "
                f"number of pixels of the channel ({n * size * size})")
        levels = x.numpy().astype(np.float64)
        floor = np.minimum((levels * bins).astype(int), bins - 1)  # np.histogram(x, bins, range=(0, 1))
        floor_hist = np.stack([np.bincount(floor[:, c].ravel(), minlength=bins) for c in range(channels)])
        if _matches(got, floor_hist / floor_hist.sum(1, keepdims=True)) and not _matches(got, expected):
            raise LabCheckError(f"{what}: the pixels are binned by floor(x * bins) (np.histogram's bins); "
                                f"expected each pixel at its nearest level k / (bins - 1), k = round(x * "
                                f"(bins - 1))")
        if channels > 1:
            index = level_index(x, bins).numpy()
            mixed = index.reshape(channels, -1)  # images.reshape(C, -1) without moving the channel axis first
            mixed_hist = np.stack([np.bincount(m, minlength=bins) for m in mixed]) / mixed.shape[1]
            pooled = np.bincount(index.ravel(), minlength=bins) / index.size
            if (_matches(got, mixed_hist) or _matches(got, np.tile(pooled, (channels, 1)))) \
                    and not _matches(got, expected):
                raise LabCheckError(f"{what}: the channels are mixed up; row c must count only the pixels "
                                    f"images[:, c] (reshape(C, -1) on (B, C, H, W) mixes images and channels)")
        close(got, expected, what)
    passed("channel_histogram: one normalised histogram per channel, each pixel at its nearest level")


# ------------------------------------------------------------------------- task 2

def _emd_cost(support: np.ndarray, p: float) -> np.ndarray:
    return np.abs(support[:, None] - support[None, :]) ** p


def _wasserstein_reference(a: np.ndarray, b: np.ndarray, support: np.ndarray, p: float) -> float:
    import ot

    a, b = a / a.sum(), b / b.sum()
    return float(ot.wasserstein_1d(support, support, a, b, p=p)) ** (1 / p)


def check_wasserstein(wasserstein: Callable) -> None:
    """`wasserstein(a, b, support, p) -> float`: the p-Wasserstein distance between two histograms on the
    levels `support`, (min over couplings of sum P_ij |s_i - s_j|^p)^(1/p), for inputs that may be counts."""
    s = _support(4)
    a, b = np.array([1.0, 0, 0, 0]), np.array([0.0, 0.5, 0, 0.5])
    # hand-computed: W2 = (0.5 / 9 + 0.5)^(1/2); a cost |x - y| gives W1 = 0.5 / 3 + 0.5
    right = np.sqrt(0.5 / 9 + 0.5)
    wrong = {np.sqrt(0.5 / 9 + 0.5) ** 2: "you returned W2^2; take the p-th root of the optimal cost",
             0.5 / 3 + 0.5: "that is W1: raise the distances |s_i - s_j| to the power p in the cost",
             np.sqrt(0.5 / 3 + 0.5): "the cost is |s_i - s_j| not raised to the power p",
             np.sqrt(0.5 * 1 + 0.5 * 9): "the cost is measured on the bin indices; measure it on the levels "
                                         "`support` (in [0, 1])"}
    what = "wasserstein([1, 0, 0, 0], [0, 0.5, 0, 0.5], levels [0, 1/3, 2/3, 1], p=2)"
    got = _array(_call(wasserstein, what, "see the error above", a, b, s, 2), what)
    require(got.size == 1, f"{what}: returned {got.size} numbers, expected one distance")
    got = float(got.reshape(()))
    for value, hint in wrong.items():
        if abs(got - value) < 1e-6:
            raise LabCheckError(f"{what}: {got:.6g}, expected {right:.6g}; {hint}")
    close(got, right, what)

    bins = 16
    s = _support(bins)
    hists = _random_histograms(6, bins, seed=3)
    for p in (1, 2):
        for i in range(0, 6, 2):
            a, b = hists[i], hists[i + 1]
            what = f"wasserstein of two random histograms on {bins} levels, p={p}"
            if p == 1:  # the library's 1-D formula (CDF differences) gives W1
                expected = float(histogram_distance(torch.from_numpy(a), torch.from_numpy(b),
                                                    torch.from_numpy(s)))
            else:
                expected = _wasserstein_reference(a, b, s, p)
            got = float(_array(_call(wasserstein, what, "see the error above", a, b, s, p), what).reshape(-1)[0])
            if abs(got - expected * (bins - 1)) < 1e-6 * bins:
                raise LabCheckError(f"{what}: {got:.6g}, expected {expected:.6g} ({bins - 1} times smaller); "
                                    "measure the cost on the levels `support`, not on the bin indices")
            close(got, expected, what)
    a, b = hists[0] * 784, hists[1] * 250
    what = "wasserstein of two count histograms (784 and 250 pixels), p=2"
    hint = "normalise a and b to sum to 1 first (the inputs here are pixel counts)"
    got = _array(_call(wasserstein, what, hint, a, b, s, 2), what).reshape(-1)
    expected = _wasserstein_reference(a, b, s, 2)
    require(got.size == 1 and abs(float(got[0]) - expected) < 1e-6,
            f"{what}: {float(got[0]):.6g}, expected {expected:.6g}; {hint}")
    passed("wasserstein: W1 and W2 between histograms on the levels, counts normalised")


def _w1(a, b, support: np.ndarray) -> float:
    return float(histogram_distance(torch.as_tensor(np.asarray(a, dtype=np.float64)),
                                    torch.as_tensor(np.asarray(b, dtype=np.float64)), torch.from_numpy(support)))


def check_barycenter(barycenter: Callable, reg: float = 1e-2) -> None:
    """`barycenter(hists, support, reg) -> (bins,)`: the 2-Wasserstein barycenter (uniform weights) of the
    rows of `hists` on the levels `support`, entropic with regularisation `reg` (``ot.bregman.barycenter``)
    or exact: within 1-Wasserstein 2e-3 of the library's :func:`barycenter_1d` of either kind."""
    tolerance = 2e-3
    cases = []
    s = _support(32)
    cases.append(("two bumps at 0.25 and 0.75 on 32 levels",
                  np.stack([_bump(s, 0.25, 0.05), _bump(s, 0.75, 0.05)]), s))
    s64 = _support(64)
    cases.append(("three bumps at 0.2, 0.5 and 0.9 on 64 levels",
                  np.stack([_bump(s64, 0.2, 0.04), _bump(s64, 0.5, 0.08), _bump(s64, 0.9, 0.03)]), s64))
    cases.append(("five random histograms on 64 levels", _random_histograms(5, 64, seed=4, empty=0.0), s64))
    for name, hists, s in cases:
        for counts in (False, True):
            given = hists * np.array([784.0, 250.0, 300.0, 1000.0, 77.0])[:len(hists), None] if counts else hists
            what = f"barycenter of {name}" + (" given as pixel counts" if counts else "") + f", reg={reg}"
            hint = ("normalise each row of hists to sum to 1 first (the inputs here are counts)" if counts else
                    "see the error above")
            got = _array(_call(barycenter, what, hint, given, s, reg), what)
            require(got.shape == (len(s),), f"{what}: shape {got.shape}, expected ({len(s)},), one histogram "
                                            "on the levels (hists holds one histogram per row)")
            if not np.isfinite(got).all():
                raise LabCheckError(f"{what}: contains NaN or infinite values; " + (
                    "normalise each row of hists to sum to 1 first (the inputs here are counts)" if counts else
                    "measure the squared cost on the levels `support` (in [0, 1]), not on the bin indices: "
                    "with reg=1e-2 the kernel exp(-cost / reg) underflows"))
            require(abs(got.sum() - 1) < 1e-3 and got.min() > -1e-9,
                    f"{what}: sums to {got.sum():.6g} (smallest entry {got.min():.3g}), expected a histogram "
                    f"summing to 1" + ("; normalise each row of hists first" if counts else ""))
            mean = hists.mean(0)
            entropic = barycenter_1d(torch.from_numpy(hists), torch.from_numpy(s), "entropic", reg=reg).numpy()
            exact = barycenter_1d(torch.from_numpy(hists), torch.from_numpy(s), "exact").numpy()
            far = min(_w1(got, entropic, s), _w1(got, exact, s))
            if far <= tolerance:
                continue
            if _w1(got, mean, s) < tolerance:
                raise LabCheckError(f"{what}: the plain mean of the histograms (a mixture with every input's "
                                    f"modes), 1-Wasserstein {far:.4f} from the barycenter; expected the "
                                    f"Wasserstein barycenter (ot.bregman.barycenter with a squared cost), "
                                    f"which moves mass to the middle")
            raise LabCheckError(f"{what}: 1-Wasserstein {far:.4f} from the library's barycenter (entropic at "
                                f"reg={reg} or exact), expected at most {tolerance}; use "
                                f"ot.bregman.barycenter(hists.T, cost, reg) with cost (s_i - s_j)^2 on the levels")
    passed("barycenter: the Wasserstein barycenter of the histograms on the levels, counts normalised")


# ------------------------------------------------------------------------- task 3

def _library_map(source: np.ndarray, target: np.ndarray, support: np.ndarray) -> np.ndarray:
    return monotone_map(torch.from_numpy(source), torch.from_numpy(target), torch.from_numpy(support)).numpy()


def check_transport_map(transport_map: Callable) -> None:
    """`transport_map(source, target, support) -> (bins,)`: where each level of the source goes under the
    monotone optimal map onto the target, ``T(k) = (G(F(k)) - G(F(k-))) / p(k)``; compared at the levels
    where the source has mass, against :func:`~fedlab_core.augment.ot_align.monotone_map`."""
    s = _support(4)
    source, target = np.array([0.5, 0.5, 0.0, 0.0]), np.full(4, 0.25)
    what = "transport_map(source [0.5, 0.5, 0, 0], target [0.25, 0.25, 0.25, 0.25], levels [0, 1/3, 2/3, 1])"
    got = _array(_call(transport_map, what, "see the error above", source, target, s), what)
    require(got.shape == (4,), f"{what}: shape {got.shape}, expected (4,), one new value per level")
    right = np.array([1 / 6, 5 / 6])  # level 0 holds the share [0, 0.5] of the mass: the mean of Q there
    if _matches(got[:2], [1 / 3, 1.0]) or _matches(got[:2], [0.0, 2 / 3]):
        raise LabCheckError(f"{what}: levels 0 and 1 go to {got[0]:.4g} and {got[1]:.4g}, expected 1/6 and "
                            "5/6; each level holds a share [F(k-), F(k)] of the mass and goes to the mean of the "
                            "target's quantile function over that share, not to its value at one end")
    if _matches(got[:2], [0.0, 0.0]) or _matches(got, _library_map(target, source, s)):
        raise LabCheckError(f"{what}: levels 0 and 1 go to {got[0]:.4g} and {got[1]:.4g}, expected 1/6 and 5/6; "
                            "this maps the target onto the source: F is the source's CDF and G integrates the "
                            "target's quantile function")
    close(got[:2], right, what + " at levels 0 and 1")

    bins = 24
    s = _support(bins)
    hists = _random_histograms(8, bins, seed=5)
    for i in range(0, 8, 2):
        for counts in (False, True):
            source, target = hists[i], hists[i + 1]
            if counts:
                source, target = source * 784, target * 3000
            what = f"transport_map of random histograms on {bins} levels" + (" given as counts" if counts else "")
            hint = "normalise source and target to sum to 1 first (the inputs here are counts)"
            got = _array(_call(transport_map, what, hint if counts else "see the error above", source, target, s),
                         what)
            require(got.shape == (bins,), f"{what}: shape {got.shape}, expected ({bins},)")
            used = hists[i] > 0
            expected = _library_map(hists[i], hists[i + 1], s)
            if _matches(got[used], _library_map(hists[i + 1], hists[i], s)[used]) \
                    and not _matches(got[used], expected[used]):
                raise LabCheckError(f"{what}: this maps the target onto the source; F is the source's CDF and "
                                    "G integrates the target's quantile function")
            require(bool(np.all(np.diff(got[used]) >= -1e-9)),
                    f"{what}: the map decreases between two levels that hold mass; the 1-D optimal map is "
                    "monotone (non-decreasing)" + ("; " + hint if counts else ""))
            bad = ~np.isclose(got[used], expected[used], atol=1e-6)
            if bad.any():
                k = int(np.flatnonzero(used)[np.argmax(bad)])
                raise LabCheckError(f"{what}: level {k} goes to {got[k]:.6g}, expected {expected[k]:.6g}"
                                    + ("; " + hint if counts else ""))
    passed("transport_map: the monotone map sends each level to the mean of the target over its share")


# ------------------------------------------------------------------------- task 4

def _library_alignment(x: torch.Tensor, target: np.ndarray, support: np.ndarray, per_image: bool = True,
                       same_target: bool = False) -> np.ndarray:
    """The library's alignment of images x onto target (C, bins): each image by its own histogram
    (per_image) or the whole batch by its pooled one; same_target: every channel onto target[0]."""
    bins = len(support)
    idx = level_index(x.reshape(len(x), x.shape[1], -1), bins)  # (n, C, HW)
    hists = channel_histograms(x, bins)  # (n, C, B)
    if not per_image:
        hists = hists.mean(0, keepdim=True).expand_as(hists)
    t = torch.from_numpy(target)
    tables = torch.stack([monotone_map(hists[:, c], t[0 if same_target else c], torch.from_numpy(support))
                          for c in range(x.shape[1])], 1)  # (n, C, B)
    return tables.gather(2, idx).reshape(x.shape).numpy()


def check_align_images(align_images: Callable) -> None:
    """`align_images(images, target, support) -> images`: every image's channel c mapped by the monotone map
    of its own histogram onto target[c], pixels looked up at their nearest level; against the library."""
    bins = 16
    s = _support(bins)
    target = np.stack([_bump(s, 0.3, 0.08), _bump(s, 0.6, 0.1), _bump(s, 0.8, 0.05)])
    x = _images(5, 3, 6, seed=6)
    what = f"align_images of 5 images (3, 6, 6) onto a target on {bins} levels (a different one per channel)"
    got = _array(_call(align_images, what, "see the error above", x, target, s), what)
    require(got.shape == tuple(x.shape), f"{what}: shape {got.shape}, expected {tuple(x.shape)}, the images' own")
    expected = _library_alignment(x, target, s)
    if not _matches(got, expected):
        if _matches(got, _library_alignment(x, target, s, same_target=True)):
            raise LabCheckError(f"{what}: every channel was mapped onto target[0]; channel c of an image must "
                                "be mapped onto target[c]")
        if _matches(got, _library_alignment(x, target, s, per_image=False)):
            raise LabCheckError(f"{what}: the images were mapped with one map made from the whole batch's "
                                "histogram; map each image by its own histogram (channel_histogram(images[i:i+1]))")
        truncated = x.double().reshape(5, 3, -1).mul(bins - 1).long().clamp(0, bins - 1)
        hists = channel_histograms(x, bins)
        tables = torch.stack([monotone_map(hists[:, c], torch.from_numpy(target[c]), torch.from_numpy(s))
                              for c in range(3)], 1)
        # compared where the truncated level holds mass (elsewhere a map's value is free)
        held = (hists.gather(2, truncated) > 0).reshape(x.shape).numpy()
        if held.mean() > 0.5 and _matches(got[held], tables.gather(2, truncated).reshape(x.shape).numpy()[held]):
            raise LabCheckError(f"{what}: the pixels were looked up at level int(x * (bins - 1)); look each pixel "
                                "up at its nearest level round(x * (bins - 1)), as in channel_histogram")
        per_channel = [c for c in range(3) if not _matches(got[:, c], expected[:, c])]
        if per_channel and per_channel != [0, 1, 2]:
            raise LabCheckError(f"{what}: channel {per_channel[0]} is wrong and other channels are right; the "
                                f"channels are mixed up (channel c of an image, its histogram row c, target[c])")
    close(got, expected, what)
    passed("align_images: each image and channel mapped onto the target by its own monotone map")


# ------------------------------------------------------------------------- the experiment

def library_target(clients_images, bins: int, reg: float = 1e-2) -> np.ndarray:
    """The target that the library's :class:`~fedlab_core.augment.OTAlign` (variant "sound", entropic
    barycenters) computes from each client's training images (a list of (N, C, H, W) tensors, all used):
    (C, bins), to compare with the student's."""
    from ..augment import OTAlign

    align = OTAlign(bins=bins, reg=reg, max_images=0)
    uploads = torch.stack([align.client_barycenter(x, torch.Generator().manual_seed(0)) for x in clients_images])
    return align.server_barycenter(uploads.double()).numpy()


def w1_distance(a, b, bins: int) -> float:
    """The library's 1-Wasserstein distance between two histograms on ``bins`` levels in [0, 1]."""
    return _w1(a, b, _support(bins))
