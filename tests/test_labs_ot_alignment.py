"""Lab 5's checks accept correct histograms, Wasserstein distances, barycenters, transport maps and aligned
images, and reject the common mistakes: unnormalised histograms, mixed-up channels, floor binning, a missing
root or power in the cost, a cost on bin indices, the mean in place of the barycenter, a map in the wrong
direction or evaluated at one end of a level's share, and one map for a whole batch."""
import numpy as np
import ot
import pytest
import torch

from fedlab_core.labs import LabCheckError
from fedlab_core.labs import ot_alignment as checks


# ------------------------------------------------------------------------- correct answers

def channel_histogram(images, bins):
    x = np.asarray(images, dtype=np.float64)
    levels = np.rint(x * (bins - 1)).astype(int)
    counts = np.stack([np.bincount(levels[:, c].ravel(), minlength=bins) for c in range(x.shape[1])])
    return counts / counts.sum(axis=1, keepdims=True)


def channel_histogram_torch(images, bins):
    """The same in torch, returning a tensor."""
    levels = (images.double() * (bins - 1)).round().long()
    return torch.stack([torch.bincount(levels[:, c].flatten(), minlength=bins) for c in range(images.shape[1])]
                       ).double() / levels[:, 0].numel()


def wasserstein(a, b, support, p=2):
    a, b, s = (np.asarray(v, dtype=np.float64) for v in (a, b, support))
    return float(ot.emd2(a / a.sum(), b / b.sum(), np.abs(s[:, None] - s[None, :]) ** p)) ** (1 / p)


def barycenter(hists, support, reg=0.01):
    h = np.asarray(hists, dtype=np.float64)
    s = np.asarray(support, dtype=np.float64)
    return ot.bregman.barycenter((h / h.sum(1, keepdims=True)).T, (s[:, None] - s[None, :]) ** 2, reg)


def exact_barycenter(hists, support, reg=0.01):
    """The exact 1-D barycenter, by averaging quantile functions on a fine grid (no POT)."""
    h = np.asarray(hists, dtype=np.float64)
    h = h / h.sum(1, keepdims=True)
    s = np.asarray(support, dtype=np.float64)
    u = (np.arange(20000) + 0.5) / 20000
    quantiles = np.mean([s[np.minimum(np.searchsorted(np.cumsum(row), u), len(s) - 1)] for row in h], axis=0)
    lower = np.clip(np.searchsorted(s, quantiles, side="right") - 1, 0, len(s) - 2)
    frac = (quantiles - s[lower]) / (s[lower + 1] - s[lower])
    out = np.zeros(len(s))
    np.add.at(out, lower, (1 - frac) / len(u))
    np.add.at(out, lower + 1, frac / len(u))
    return out


def transport_map(source, target, support):
    p, q, s = (np.asarray(v, dtype=np.float64) for v in (source, target, support))
    return _monotone(p / p.sum(), q / q.sum(), s)


def _monotone(p, q, s):
    upper = np.cumsum(p)
    lower = upper - p
    knots = np.concatenate([[0.0], np.cumsum(q)])
    areas = np.concatenate([[0.0], np.cumsum(q * s)])
    share = np.interp(upper, knots, areas) - np.interp(lower, knots, areas)
    return np.where(p > 0, share / np.maximum(p, 1e-300), s)


def align_images(images, target, support, level=np.rint):
    x = np.asarray(images, dtype=np.float64)
    bins = len(support)
    levels = level(x * (bins - 1)).astype(int)
    out = np.empty_like(x)
    for i in range(len(x)):
        hist = channel_histogram(x[i:i + 1], bins)
        for c in range(x.shape[1]):
            out[i, c] = transport_map(hist[c], target[c], support)[levels[i, c]]
    return out


def test_correct_answers_pass(capsys):
    checks.check_channel_histogram(channel_histogram)
    checks.check_channel_histogram(channel_histogram_torch)
    checks.check_wasserstein(wasserstein)
    checks.check_barycenter(barycenter)
    checks.check_barycenter(exact_barycenter)
    checks.check_transport_map(transport_map)
    checks.check_align_images(align_images)
    checks.check_align_images(lambda x, t, s: torch.as_tensor(align_images(x, t, s), dtype=torch.float32))
    assert capsys.readouterr().out.count("✔") == 8


def test_not_implemented_passes_through():
    """nbgrader's stub must surface as NotImplementedError, not as a check failure."""
    def stub(*args):
        raise NotImplementedError()
    for check in (checks.check_channel_histogram, checks.check_wasserstein, checks.check_barycenter,
                  checks.check_transport_map, checks.check_align_images):
        with pytest.raises(NotImplementedError):
            check(stub)


# ------------------------------------------------------------------------- task 1 mistakes

def unnormalised(images, bins):
    return channel_histogram(images, bins) * np.asarray(images)[:, 0].size


def mixed_channels(images, bins):
    x = np.asarray(images, dtype=np.float64)
    levels = np.rint(x * (bins - 1)).astype(int).reshape(x.shape[1], -1)  # mixes images and channels
    return np.stack([np.bincount(row, minlength=bins) for row in levels]) / levels.shape[1]


def floor_binning(images, bins):
    x = np.asarray(images, dtype=np.float64)
    counts = np.stack([np.histogram(x[:, c], bins=bins, range=(0, 1))[0] for c in range(x.shape[1])])
    return counts / counts.sum(1, keepdims=True)


@pytest.mark.parametrize("wrong, message", [(unnormalised, "sums to"), (mixed_channels, "channels are mixed"),
                                            (floor_binning, "nearest level")])
def test_histogram_mistakes(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_channel_histogram(wrong)


# ------------------------------------------------------------------------- task 2 mistakes

def no_root(a, b, support, p=2):
    return wasserstein(a, b, support, p) ** p


def cost_not_powered(a, b, support, p=2):
    return wasserstein(a, b, support, 1) ** (1 / p)


def index_cost(a, b, support, p=2):
    return wasserstein(a, b, np.arange(len(support)), p)


def unnormalised_emd(a, b, support, p=2):
    a, b, s = (np.asarray(v, dtype=np.float64) for v in (a, b, support))
    return float(ot.emd2(a, b, np.abs(s[:, None] - s[None, :]) ** p)) ** (1 / p)


@pytest.mark.parametrize("wrong, message", [(no_root, "root"), (cost_not_powered, "power p"),
                                            (index_cost, "bin indices"), (unnormalised_emd, "normalise")])
def test_wasserstein_mistakes(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_wasserstein(wrong)


def mean_histogram(hists, support, reg=0.01):
    h = np.asarray(hists, dtype=np.float64)
    return (h / h.sum(1, keepdims=True)).mean(0)


def unnormalised_barycenter(hists, support, reg=0.01):
    s = np.asarray(support, dtype=np.float64)
    return ot.bregman.barycenter(np.asarray(hists, dtype=np.float64).T, (s[:, None] - s[None, :]) ** 2, reg)


def index_cost_barycenter(hists, support, reg=0.01):
    return barycenter(hists, np.arange(len(support), dtype=np.float64), reg)


@pytest.mark.parametrize("wrong, message", [(mean_histogram, "plain mean"),
                                            (unnormalised_barycenter, "normalise each row"),
                                            (index_cost_barycenter, "bin indices")])
@pytest.mark.filterwarnings("ignore")
def test_barycenter_mistakes(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_barycenter(wrong)


# ------------------------------------------------------------------------- task 3 mistakes

def wrong_direction(source, target, support):
    return transport_map(target, source, support)


def quantile_at_cdf(source, target, support):
    p, q, s = (np.asarray(v, dtype=np.float64) for v in (source, target, support))
    p, q = p / p.sum(), q / q.sum()
    return s[np.minimum(np.searchsorted(np.cumsum(q), np.cumsum(p) - 1e-12), len(s) - 1)]


def unnormalised_map(source, target, support):
    return _monotone(*(np.asarray(v, dtype=np.float64) for v in (source, target, support)))


@pytest.mark.parametrize("wrong, message", [(wrong_direction, "target onto the source"),
                                            (quantile_at_cdf, "mean of the target's quantile"),
                                            (unnormalised_map, "normalise")])
def test_transport_map_mistakes(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_transport_map(wrong)


# ------------------------------------------------------------------------- task 4 mistakes

def first_target_only(images, target, support):
    return align_images(images, np.repeat(np.asarray(target)[:1], len(target), axis=0), support)


def one_map_for_the_batch(images, target, support):
    x = np.asarray(images, dtype=np.float64)
    bins = len(support)
    levels = np.rint(x * (bins - 1)).astype(int)
    hist = channel_histogram(x, bins)
    out = np.empty_like(x)
    for c in range(x.shape[1]):
        out[:, c] = transport_map(hist[c], target[c], support)[levels[:, c]]
    return out


def truncated_lookup(images, target, support):
    return align_images(images, target, support, level=np.trunc)


def swapped_channels(images, target, support):
    return align_images(images, np.asarray(target)[[0, 2, 1]], support)


@pytest.mark.parametrize("wrong, message", [(first_target_only, "target\\[0\\]"),
                                            (one_map_for_the_batch, "own histogram"),
                                            (truncated_lookup, "nearest level"),
                                            (swapped_channels, "channels are mixed up")])
def test_align_mistakes(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_align_images(wrong)
