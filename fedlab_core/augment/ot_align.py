"""OT-based preprocessing ("Optimal Transport-based Domain Alignment as a Preprocessing Step for Federated
Learning", anonymous ICLR submission; code: the ``ch5`` folder of the first author's thesis repository).

A set-up exchange before training, model- and algorithm-agnostic (Algorithm 1 of the paper):

1. each client computes, per colour channel, a Wasserstein barycenter of its training images' channel
   distributions and uploads only these barycenters;
2. the server computes, per channel, the barycenter of the clients' barycenters (the "target") and sends
   it down;
3. each client maps every one of its images, training and test, onto the target.

:meth:`OTAlign.setup` returns the aligned federation and the messages of steps 1 and 2, so the engine
counts their bytes. What is evaluated on what: the clients' own test sets are aligned (each client maps
them as it maps its training images); the global test set ``federation.x_test`` belongs to no client
and is left as it is. A run therefore reports both: ``mean_client_accuracy`` on aligned images,
``global_accuracy`` on raw ones. :meth:`OTAlign.align` maps any other images onto the target, e.g. the
global test set as a new client would see it.

Four readings of the method (``variant``):

``"sound"`` (default)
    A channel's distribution is its intensity histogram over ``bins`` equally spaced levels in [0, 1]
    (each pixel counts for the nearest level), with cost the squared distance between levels. The
    client's barycenter is, by default (``solver="exact"``), the exact 1-D 2-Wasserstein barycenter of its
    images' histograms, whose quantile function is the average of the inputs' quantile functions; the
    server does the same with the clients' barycenters. ``solver="entropic"`` takes the paper's entropic
    barycenter instead (iterative Bregman projections, ``ot.bregman.barycenter``, regularisation ``reg``;
    the cost's maximum is 1, as in the paper's normalised cost) and ``solver="debiased"`` its debiased form
    (``ot.bregman.barycenter_debiased``). Why exact by default: at the paper's ``reg`` 1e-2 the entropic
    barycenter smears a histogram's mass over neighbouring levels, and on Fashion-MNIST, whose images are
    mostly black background, the target keeps about 1% of its mass at level 0 where the exact barycenter
    keeps about a quarter: the backgrounds of every aligned image turn grey. The paper's entropic solver
    is a computational device (it is what POT offers in any dimension); in 1-D the exact barycenter is
    cheaper and has no blur. Each image is mapped by the 1-D monotone transport map
    (quantile matching), channel by channel: a pixel at level k goes to the mean of the target's quantile
    function over the share of the image's pixels at level k, ``T(k) = (G(F(k)) - G(F(k-))) / p(k)``
    with ``F`` the image's CDF, ``p`` its histogram and ``G(t)`` the integral of the target's quantile
    function from 0 to t. Pixels of equal value stay equal, order is kept, and the image's histogram
    becomes the target's (up to ties). By default (``cdf="image"``) F is the image's own CDF: the target
    is a barycenter of single images' histograms, the histogram of a typical image, so it is each image
    that is moved onto it, as the paper does (one map per image). ``cdf="client"`` instead fits one map
    per client and channel on the client's pooled training histogram and applies it to all its images,
    train and test: gentler (differences between the client's images survive), but it maps a mixture of
    many images onto the histogram of one typical image. The sound path is vectorised over images.
``"channel"``
    The paper's Algorithm 1 read literally, channel by channel: the barycenters are the sound variant's
    (entropic barycenters of intensity histograms, each image's histogram made of ``pixels`` sampled
    pixels, the paper's 250; the solver is the paper's entropic one by default), and each image's channel is
    mapped with ``ot.da.SinkhornTransport``
    (``reg_map``, the paper's 1e-1) fitted from ``pixels`` of its sampled values to ``pixels`` points of
    the target (its quantiles at the midpoints ``(k + 1/2) / pixels``, equal weights, since POT's map
    takes uniform marginals), then applied to all the channel's pixels through the out-of-sample map
    (below). One POT call per image and channel: slow. The entropic map at ``reg_map`` 1e-1 on intensities
    in [0, 1] blurs strongly: it pulls a channel's values towards their mean (the chapter shows it).
``"joint"``
    The joint-colour reading: an image is a cloud of ``pixels`` sampled pixels, points in [0, 1]^C
    (C = 3 for colour, 1 for grey). The client's barycenter is a free-support barycenter
    (``ot.lp.free_support_barycenter``) of its images' clouds with ``pixels`` support points; the server's
    is the same over the clients' barycenters. Each image is mapped with ``ot.da.SinkhornTransport``
    (``reg_map``) fitted from ``pixels`` of its sampled pixels to the target and applied to all its
    pixels through the out-of-sample map ``out_of_sample_map``. POT 0.9.4 changed that map's default
    from ``"ferradans"`` (a pixel goes where its nearest fitted sample goes, plus its offset from that
    sample; Ferradans et al. 2014, the paper's reference) to ``"continuous"`` (the map of the entropic
    plan's dual potentials, evaluated at the new pixel), and its Sinkhorn from ``method="sinkhorn"`` to
    ``"sinkhorn_log"``. Both are pinned here, as pairs: ``"ferradans"`` with ``"sinkhorn"`` (the default
    of ``"channel"`` and ``"joint"``, the paper's reference), ``"continuous"`` with ``"sinkhorn_log"`` (the
    default of ``"paper-code"``: what the authors' pinned POT 0.9.5 ran). One POT call per image: slow.
``"paper-code"``
    What the authors' code computes: per image and channel, ``pixels`` sampled pixel values (the same
    positions for every channel, drawn with replacement) are normalised to sum to 1 and treated as a
    histogram over ``pixels`` bins (the sample positions) with cost ``ot.utils.dist0(pixels)`` scaled
    to a maximum of 1; barycenters with ``ot.bregman.barycenter`` (``reg``); the target "colours" are
    the C barycenter vectors stacked into ``pixels`` points of R^C, whose coordinates are probabilities
    (about 1 / pixels); each image is mapped onto them with ``SinkhornTransport`` as the pinned POT 0.9.5
    does by default (``"continuous"``, ``"sinkhorn_log"``). The mapped images lose their intensities (they
    are offered to show it). These defaults are the paper's settings, which the authors' first code uses
    (250 pixels drawn with replacement, ``reg`` 1e-2 for both barycenters, ``reg_map`` 1e-1). Their cleaned
    code changes four of them, all options here: ``barycenter_pixels=1000`` drawn without replacement
    (``barycenter_replace=False``) for the clients' barycenters, ``reg_server=0.1`` and ``reg_map=0.01``;
    ``variant="paper-code", **CLEANED_CODE`` gives them all.

Defaults follow the paper where it has a value: ``pixels`` 250 for the sampling variants, ``reg`` 1e-2
for barycenters, ``reg_map`` 1e-1 for the map. The sound variant histograms all pixels (it costs nothing
more: a histogram has ``bins`` entries whatever the image size). Clients count equally in the server's
barycenter and images equally in a client's (the paper's uniform weights).

Cost. The entropic barycenter costs (iterations x images x bins^2); the paper samples pixels to cut the
cost, and ``max_images`` (default 1000) does the same with images: a client's barycenter is estimated
from at most that many of its images. On Fashion-MNIST the exact barycenter of 1000 random training
images lies within 1-Wasserstein 0.004 (one intensity level) of the barycenter of all 60,000, while the
entropic blur at ``reg`` 1e-2 is about 0.02. ``max_images=0`` uses every image (and makes the cost grow
with the client's size, as in the paper's Section 6). :func:`alignment_cost` times the stages.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

# POT (``ot``) is imported inside the functions that call it: it takes about a second to load, and only
# runs that align images need it.
from ..algorithms.base import Message
from ..data.federation import ClientData, Federation
from ..params import OneOf, Range
from .base import Augment

VARIANTS = ("sound", "channel", "joint", "paper-code")
SOLVERS = ("entropic", "debiased", "exact")
CDFS = ("image", "client")
OUT_OF_SAMPLE_MAPS = ("ferradans", "continuous")
PAPER_PIXELS = 250  # the paper's pixels sampled per image (Appendix A.2.2)
# the authors' cleaned code's settings, where they differ from the paper's (and its first code's)
CLEANED_CODE = {"barycenter_pixels": 1000, "barycenter_replace": False, "reg_server": 0.1, "reg_map": 0.01}
_CHUNK = 4096  # images per vectorised step of the sound path (bounds memory at (chunk, C, bins) float64)
_EPS = 1e-10  # added to the paper-code histograms so that an all-black sample still sums to 1 (authors' fix)
# POT's solvers here multiply small matrices ((bins, bins) by (bins, images), (k, C) clouds). With two BLAS
# threads on a busy two-core machine, a (256, 256) @ (256, 8) product took 5.3 ms instead of 0.11 ms with
# one; threads gain little on products this small, so every POT call runs with one BLAS thread.
_BLAS_THREADS = 1
_CONTROLLER = None  # threadpoolctl's controller, made on first use (POT and threadpoolctl load lazily)


def _blas_limit():
    """A context in which numpy's BLAS uses ``_BLAS_THREADS`` threads (the controller is made once)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=_BLAS_THREADS, user_api="blas")


# ------------------------------------------------------------------------- 1-D histograms (sound)

def intensity_support(bins: int) -> torch.Tensor:
    """The intensity levels of the histograms: ``bins`` equally spaced values from 0 to 1, (bins,) float64."""
    return torch.linspace(0.0, 1.0, bins, dtype=torch.float64)


def squared_cost(support: torch.Tensor) -> torch.Tensor:
    """Squared distances between levels, (B, B); its maximum is 1 on [0, 1]."""
    return (support[:, None] - support[None, :]) ** 2


def check_range(x: torch.Tensor, what: str = "images") -> None:
    """Raise ValueError unless every value of x lies in [0, 1] (the histograms' range)."""
    if x.numel() and (x.min() < 0 or x.max() > 1):
        raise ValueError(f"ot_align needs {what} with intensities in [0, 1]; got values in "
                         f"[{float(x.min()):.4g}, {float(x.max()):.4g}]")


def level_index(x: torch.Tensor, bins: int) -> torch.Tensor:
    """The nearest of ``bins`` levels for every value of x (same shape, int64); 8-bit images lose nothing at 256."""
    return (x.float() * (bins - 1)).round_().clamp_(0, bins - 1).long()


def _count_levels(idx: torch.Tensor, bins: int) -> torch.Tensor:
    """Histogram counts of level indices (N, C, P) -> (N, C, bins) float64, one bincount for all rows."""
    n, c = idx.shape[:2]
    rows = torch.arange(n * c, device=idx.device).view(n, c, 1) * bins  # (N, C, 1)
    return torch.bincount((idx + rows).flatten(), minlength=n * c * bins).view(n, c, bins).double()


def pixel_positions(n: int, hw: int, pixels: int, generator: torch.Generator | None,
                    replace: bool = True) -> torch.Tensor:
    """``pixels`` positions among ``hw`` for each of n images: (n, 1, pixels) int64 (CPU).

    With replacement, independent uniform draws; without, the first ``pixels`` of a random permutation of
    each image's positions (``pixels`` must then be at most ``hw``).
    """
    if replace:
        return torch.randint(hw, (n, 1, pixels), generator=generator)
    if pixels > hw:
        raise ValueError(f"ot_align cannot sample {pixels} pixels without replacement from images of {hw}")
    return torch.rand(n, hw, generator=generator).argsort(1)[:, None, :pixels]


def channel_histograms(x: torch.Tensor, bins: int, pixels: int | None = None,
                       generator: torch.Generator | None = None, replace: bool = True) -> torch.Tensor:
    """Per-image, per-channel intensity histograms.

    Parameters
    ----------
    x : images (N, C, H, W) in [0, 1].
    bins : number of levels.
    pixels : if given, each image's histogram is made of this many pixel positions drawn at random
        (the same positions for every channel); None: all pixels.
    generator : draws the positions.
    replace : draw the positions with replacement (else without).

    Returns (N, C, bins) float64, each row summing to 1.
    """
    n, c = x.shape[:2]
    flat = x.reshape(n, c, -1)  # (N, C, HW)
    if pixels is not None:
        pos = pixel_positions(n, flat.shape[-1], pixels, generator, replace).to(x.device)  # (N, 1, P)
        flat = flat.gather(2, pos.expand(n, c, pixels))  # (N, C, P)
    counts = torch.cat([_count_levels(level_index(flat[s:s + _CHUNK], bins), bins)
                        for s in range(0, max(n, 1), _CHUNK)])  # (N, C, B)
    return counts / counts.sum(-1, keepdim=True).clamp_min(1)


def histogram_distance(a: torch.Tensor, b: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """1-Wasserstein distance between histograms on the same sorted support, over the last axis.

    In 1-D, ``W1(a, b) = sum_k |F_a(k) - F_b(k)| (s_{k+1} - s_k)``; a (..., B) and b broadcast together.
    """
    gaps = (support[1:] - support[:-1]).to(a)  # (B - 1,)
    diff = (a.cumsum(-1) - b.to(a).cumsum(-1))[..., :-1].abs()  # (..., B - 1)
    return (diff * gaps).sum(-1)


def quantile_average(hists: torch.Tensor, support: torch.Tensor,
                     weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact 2-Wasserstein barycenter of 1-D histograms, as atoms.

    In 1-D the barycenter's quantile function is the weighted average of the inputs' quantile functions
    ``Q(s) = sum_i w_i Q_i(s)``. Each Q_i is a step function that jumps where the cumulative mass of
    histogram i crosses a non-empty level; Q is a step function too, with every one of those jumps.
    Sorting the jumps by position gives Q exactly.

    Parameters
    ----------
    hists : (n, B) non-negative histograms (rows are normalised).
    support : (B,) increasing levels.
    weights : (n,) barycentric weights (normalised); None: uniform.

    Returns (values (m,), masses (m,)): Q takes value ``values[j]`` on an interval of length
    ``masses[j]``; values are non-decreasing, masses sum to 1 (some may be 0).
    """
    hists = hists.double()
    support = support.to(hists)
    n, b = hists.shape
    mass = hists / hists.sum(1, keepdim=True)
    w = torch.full((n,), 1.0 / n, dtype=torch.float64) if weights is None else weights.double() / weights.sum()
    w = w.to(hists)
    levels = torch.arange(b, device=hists.device)
    occupied = torch.where(mass > 0, levels, b)  # (n, B): own index where there is mass, else b
    first_from = occupied.flip(1).cummin(1).values.flip(1)  # (n, B): first occupied level >= k
    following = torch.cat([first_from[:, 1:], torch.full((n, 1), b, device=hists.device)], 1)  # first > k
    start = (w * support[first_from[:, 0]]).sum()
    jumps_at = (mass > 0) & (following < b)  # leaving an occupied level that is not the last one
    positions = mass.cumsum(1).clamp(0, 1)[jumps_at]  # (E,)
    steps = (w[:, None] * (support[following.clamp(max=b - 1)] - support[None, :]))[jumps_at]  # (E,)
    order = positions.argsort()
    positions, steps = positions[order], steps[order]
    values = start + torch.cat([steps.new_zeros(1), steps.cumsum(0)])  # (E + 1,)
    edges = torch.cat([positions.new_zeros(1), positions, positions.new_ones(1)])
    return values, (edges[1:] - edges[:-1]).clamp_min(0)


def to_support(values: torch.Tensor, masses: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Atoms put on a sorted support: each atom's mass is split between its two neighbouring levels in
    proportion to closeness (which keeps the mean). Returns (B,) float64."""
    values, masses, support = values.double(), masses.double(), support.double().to(values.device)
    b = len(support)
    lower = (torch.searchsorted(support, values.contiguous(), right=True) - 1).clamp(0, b - 2)
    frac = ((values - support[lower]) / (support[lower + 1] - support[lower])).clamp(0, 1)
    out = torch.zeros(b, dtype=torch.float64, device=values.device)
    out.index_add_(0, lower, masses * (1 - frac))
    out.index_add_(0, lower + 1, masses * frac)
    return out


def barycenter_1d(hists: torch.Tensor, support: torch.Tensor, solver: str = "entropic", reg: float = 1e-2,
                  num_iter: int = 1000, tol: float = 1e-3, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Wasserstein barycenter of histograms on one intensity support.

    Parameters
    ----------
    hists : (n, B) histograms.
    support : (B,) levels; the cost is their squared distance.
    solver : "entropic" (``ot.bregman.barycenter``), "debiased" (``ot.bregman.barycenter_debiased``) or
        "exact" (:func:`quantile_average` put back on the support).
    reg, num_iter, tol : the entropic solvers' regularisation, iteration cap and stopping threshold.
    weights : (n,) barycentric weights; None: uniform.

    Returns the barycenter (B,) float64, summing to 1, on the device of `hists`.
    """
    import ot

    if solver == "exact":
        values, masses = quantile_average(hists, support.to(hists.device), weights)
        return to_support(values, masses, support.to(hists.device))
    device = hists.device
    a = (hists.double() / hists.double().sum(1, keepdim=True)).cpu().numpy().T.copy()  # (B, n)
    cost = squared_cost(support.double().cpu()).numpy()  # (B, B)
    w = None if weights is None else (weights.double() / weights.sum()).cpu().numpy()
    fn = ot.bregman.barycenter if solver == "entropic" else ot.bregman.barycenter_debiased
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"), \
            _blas_limit():
        bary = fn(a, cost, reg, weights=w, method="sinkhorn", numItermax=num_iter, stopThr=tol, warn=False)
    if not np.all(np.isfinite(bary)) or bary.sum() <= 0:
        raise FloatingPointError(f"the {solver} barycenter overflowed at reg={reg}; use a larger reg or "
                                 f"solver='exact'")
    bary = np.clip(bary, 0, None)
    return torch.from_numpy(bary / bary.sum()).to(device)


def monotone_map(source: torch.Tensor, target: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """The 1-D optimal map from histograms onto one target histogram, as a value for every level.

    Level k of a source holds the share ``[F(k-), F(k)]`` of its mass; the monotone transport plan sends
    that share to the same share of the target, and the map sends the level to its mean there:
    ``T(k) = (G(F(k)) - G(F(k-))) / p(k)``, with ``G(t)`` the integral of the target's quantile function
    over [0, t]. A level with no mass gets the target's quantile at F(k) (no pixel uses it).

    Parameters
    ----------
    source : (..., B) histograms.
    target : (B,) the target histogram.
    support : (B,) levels.

    Returns (..., B) float64: where each level of each source goes.
    """
    source = source.double()
    support, target = support.double().to(source.device), target.double().to(source.device)
    b = len(support)
    p = source / source.sum(-1, keepdim=True)  # (..., B)
    upper = p.cumsum(-1).clamp_(0, 1)  # F(k)
    lower = torch.cat([torch.zeros_like(upper[..., :1]), upper[..., :-1]], -1)  # F(k-)
    t_mass = target / target.sum()
    knots = torch.cat([t_mass.new_zeros(1), t_mass.cumsum(0).clamp(0, 1)])  # (B + 1,) target CDF
    knots[-1] = 1.0
    integral = torch.cat([t_mass.new_zeros(1), (t_mass * support).cumsum(0)])  # (B + 1,) G at the knots
    j_up = (torch.searchsorted(knots, upper, right=True) - 1).clamp_(0, b - 1)  # target level holding F(k)
    j_lo = (torch.searchsorted(knots, lower, right=True) - 1).clamp_(0, b - 1)  # ... and F(k-)
    # G(F(k)) - G(F(k-)) summed piece by piece (the end pieces, the whole target levels between), so that
    # a level with little mass is not the small difference of two large numbers
    inner = integral[j_up] - integral[(j_lo + 1).clamp_(max=b)]
    pieces = (knots[(j_lo + 1).clamp_(max=b)] - lower) * support[j_lo] + inner + (upper - knots[j_up]) * support[j_up]
    mean = torch.minimum(torch.maximum(pieces / p.clamp_min(1e-300), support[j_lo]), support[j_up])
    return torch.where((p > 0) & (j_up > j_lo), mean, support[j_up])


# ------------------------------------------------------------------------- point clouds (joint, paper-code)

def sample_pixels(x: torch.Tensor, pixels: int, generator: torch.Generator, replace: bool = True) -> torch.Tensor:
    """``pixels`` pixels of every image drawn at random (with replacement or not), as points: (N, pixels, C)
    float64 (CPU)."""
    n, c = x.shape[:2]
    flat = x.detach().reshape(n, c, -1).double().cpu()  # (N, C, HW)
    pos = pixel_positions(n, flat.shape[-1], pixels, generator, replace)  # (N, 1, P)
    return flat.gather(2, pos.expand(n, c, pixels)).transpose(1, 2)  # (N, P, C)


def free_support_barycenter(clouds: Sequence[np.ndarray], size: int, rng: np.random.Generator,
                            num_iter: int, tol: float) -> np.ndarray:
    """Free-support 2-Wasserstein barycenter (``ot.lp.free_support_barycenter``) of uniform point clouds.

    ``size`` support points, started from points drawn from the pooled clouds. Returns (size, C).
    """
    import ot

    pooled = np.concatenate(clouds)  # (sum k_i, C)
    start = pooled[rng.choice(len(pooled), size, replace=len(pooled) < size)]
    weights = [np.full(len(c), 1.0 / len(c)) for c in clouds]
    with _blas_limit():
        return ot.lp.free_support_barycenter(list(clouds), weights, start, numItermax=num_iter, stopThr=tol)


def paper_code_histograms(samples: torch.Tensor) -> torch.Tensor:
    """The authors' construction: sampled values of one channel, clipped at 0, plus 1e-10, normalised to
    sum to 1, read as a histogram over the sample positions. samples (..., P) -> (..., P) float64."""
    v = samples.double().clamp_min(0) + _EPS
    return v / v.sum(-1, keepdim=True)


def paper_code_barycenter(hists: np.ndarray, reg: float, num_iter: int, tol: float) -> np.ndarray:
    """``ot.bregman.barycenter`` of (P, n) paper-code histograms with cost ``dist0(P)`` scaled to max 1."""
    import ot

    cost = ot.utils.dist0(hists.shape[0])
    cost /= cost.max()
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"), \
            _blas_limit():
        bary = ot.bregman.barycenter(hists, cost, reg, method="sinkhorn", numItermax=num_iter, stopThr=tol,
                                     warn=False)
    if not np.all(np.isfinite(bary)):
        raise FloatingPointError(f"the paper-code barycenter overflowed at reg={reg}; use a larger reg")
    return bary


def quantile_points(hists: torch.Tensor, support: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` equally weighted points standing for each histogram: its quantiles at ``(j + 1/2) / k``.

    hists (C, B) on the sorted ``support`` (B,) -> (C, k)."""
    cdf = hists.double().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    q = (torch.arange(k, dtype=torch.float64) + 0.5) / k  # (k,)
    idx = torch.searchsorted(cdf.contiguous(), q.expand(len(cdf), k).contiguous()).clamp_(max=len(support) - 1)
    return support.double()[idx]


def sinkhorn_map(image: np.ndarray, sample: np.ndarray, target: np.ndarray, reg_map: float, map_iter: int,
                 out_of_sample_map: str) -> np.ndarray:
    """Map one image's pixels (HW, C) onto target points (k, C) with ``ot.da.SinkhornTransport`` fitted on
    `sample` (P, C); the out-of-sample map and the Sinkhorn method are pinned (see the module doc)."""
    import ot

    method = "sinkhorn" if out_of_sample_map == "ferradans" else "sinkhorn_log"
    transport = ot.da.SinkhornTransport(reg_e=reg_map, method=method, max_iter=map_iter,
                                        out_of_sample_map=out_of_sample_map)
    with warnings.catch_warnings(), _blas_limit():
        warnings.simplefilter("ignore")  # Sinkhorn's non-convergence warning at max_iter
        transport.fit(Xs=sample, Xt=target)
        return transport.transform(Xs=image)


# ------------------------------------------------------------------------- the augmentation

def _generator(seed: int, cid: int | None, stream: int) -> torch.Generator:
    """A torch generator for (seed, client, stream): stream 0 draws barycenter samples, 1 the map's."""
    who = 2**32 if cid is None else cid  # None: images of no client (the global test set)
    state = np.random.SeedSequence([seed, who, stream]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state) >> 1)


class OTAlign(Augment):
    """OT-based preprocessing: align every client's images onto a shared barycenter before training.

    Parameters
    ----------
    variant : "sound", "channel", "joint" or "paper-code" (see the module doc).
    solver : barycenter solver of the sound and channel variants: "entropic", "debiased" or "exact";
        None: "exact" for "sound", the paper's "entropic" for "channel".
    bins : intensity levels of the sound and channel variants' histograms.
    pixels : pixels sampled per image; None: all pixels for "sound", 250 (the paper's) otherwise.
        In "sound" sampling only feeds the client's barycenter (each image is mapped with its full
        histogram); in the others it is also the map's fitting set and the target's size.
    reg : entropic regularisation of the barycenters ("sound" and "channel" with an entropic solver,
        "paper-code").
    reg_server : the server's barycenter's regularisation where it differs from the clients' (the authors'
        cleaned code: 0.1); None: ``reg``.
    barycenter_pixels : pixels sampled per image for the clients' barycenters, where they differ from
        ``pixels`` (the cleaned code's 1000); None: ``pixels``. The map is fitted on ``pixels``.
    barycenter_replace : draw the barycenters' pixels with replacement (the paper's code) or without (its
        cleaned code); the map's are drawn with replacement.
    reg_map : entropic regularisation of the SinkhornTransport map ("channel", "joint", "paper-code").
    num_iter : iteration cap of the barycenter solvers. The entropic barycenter needs about 2/reg
        iterations on 256 bins (201 at reg 1e-2), so the cap of 1,000 is reached, silently, below
        reg of about 2.5e-3: raise it with reg.
    tol : stopping threshold of the barycenter solvers.
    map_iter : iteration cap of the map's Sinkhorn.
    max_images : if > 0, a client's barycenter is computed from at most this many of its training images,
        drawn at random: a sample estimate of the same barycenter (in 1-D the barycenter is the mean of the
        images' quantile functions); 0: all of them. Every image is still mapped.
    cdf : "image" (default) maps each image by its own CDF, "client" by its client's pooled training CDF
        ("sound" only).
    out_of_sample_map : SinkhornTransport's map for pixels outside the fitted sample, with its Sinkhorn:
        "ferradans" with "sinkhorn" (the paper's reference, POT < 0.9.4's defaults) or "continuous" with
        "sinkhorn_log" (POT >= 0.9.4's, which the authors' pinned 0.9.5 ran); None: "continuous" for
        "paper-code", "ferradans" for "channel" and "joint".

    After :meth:`setup`: ``client_barycenters`` (what the server received, stacked), ``target`` (what it
    sent), ``support`` (the sound variant's levels) and ``timings`` (seconds per stage and client).
    """

    name = "ot_align"
    shares = "its channel-wise intensity barycenter, once before training"
    constraints = {"variant": OneOf(*VARIANTS), "solver": OneOf(*SOLVERS), "bins": Range(2), "pixels": Range(1),
                   "reg": Range(0, low_open=True), "reg_server": Range(0, low_open=True),
                   "barycenter_pixels": Range(1),
                   "reg_map": Range(0, low_open=True), "num_iter": Range(1),
                   "tol": Range(0, low_open=True), "map_iter": Range(1), "max_images": Range(0),
                   "cdf": OneOf(*CDFS), "out_of_sample_map": OneOf(*OUT_OF_SAMPLE_MAPS)}

    def __init__(self, variant: str = "sound", solver: str | None = None, bins: int = 256, pixels: int | None = None,
                 reg: float = 1e-2, reg_map: float = 1e-1, num_iter: int = 1000, tol: float = 1e-3,
                 map_iter: int = 1000, max_images: int = 1000, cdf: str = "image",
                 out_of_sample_map: str | None = None, reg_server: float | None = None,
                 barycenter_pixels: int | None = None, barycenter_replace: bool = True):
        if variant != "sound" and cdf != "image":
            raise ValueError(f"cdf belongs to the sound variant; variant {variant!r} does not take it")
        if variant not in ("sound", "channel") and solver is not None:
            raise ValueError(f"solver belongs to the sound and channel variants; variant {variant!r} does not "
                             f"take it")
        if variant == "sound" and out_of_sample_map is not None:
            raise ValueError("out_of_sample_map belongs to the SinkhornTransport variants; variant 'sound' does "
                             "not take it")
        self.variant, self.bins, self.cdf = variant, int(bins), cdf
        self.solver = solver or ("exact" if variant == "sound" else "entropic")
        self.pixels = pixels if pixels is not None else (None if variant == "sound" else PAPER_PIXELS)
        self.reg, self.reg_map, self.num_iter, self.tol = float(reg), float(reg_map), int(num_iter), float(tol)
        self.reg_server = self.reg if reg_server is None else float(reg_server)
        self.barycenter_pixels = self.pixels if barycenter_pixels is None else int(barycenter_pixels)
        self.barycenter_replace = bool(barycenter_replace)
        self.out_of_sample_map = out_of_sample_map or ("continuous" if variant == "paper-code" else "ferradans")
        self.map_iter, self.max_images = int(map_iter), int(max_images)
        self.support = intensity_support(self.bins)
        self.client_barycenters: torch.Tensor | None = None
        self.target: torch.Tensor | None = None
        self.client_maps: dict[int, torch.Tensor] = {}
        self.timings: dict[str, list[float] | float] = {}
        self._seed = 0

    # ---------------------------------------------------------------- the protocol

    def setup(self, federation: Federation, seed: int):
        self._seed = seed
        for c in federation.clients:
            check_range(c.x_train, f"client {c.cid}'s training images")
            check_range(c.x_test, f"client {c.cid}'s test images")
        up, senders, bary_seconds = [], [], []
        for c in federation.clients:
            if c.num_train == 0:  # nothing to describe: it sends nothing, and still receives the target
                continue
            t0 = time.perf_counter()
            bary = self.client_barycenter(c.x_train, _generator(seed, c.cid, 0))
            bary_seconds.append(time.perf_counter() - t0)
            up.append(Message({"barycenter": bary.float().cpu()}))
            senders.append(c.cid)
        if not up:
            raise ValueError("ot_align needs at least one client with training images")
        self.client_barycenters = torch.stack([m.tensors["barycenter"] for m in up])  # what the server holds
        t0 = time.perf_counter()
        self.target = self.server_barycenter(self.client_barycenters, seed).float()
        server_seconds = time.perf_counter() - t0
        down = [Message({"barycenter": self.target}) for _ in federation.clients]
        clients, map_seconds = [], []
        self.client_maps = {}
        for c in federation.clients:
            t0 = time.perf_counter()
            clients.append(self._align_client(c, _generator(seed, c.cid, 1)))
            map_seconds.append(time.perf_counter() - t0)
            if c.x_val is not None:   # a monitored validation set is mapped as the client's test set is
                check_range(c.x_val, f"client {c.cid}'s validation images")
                clients[-1] = replace(clients[-1], x_val=self._align_val(c, _generator(seed, c.cid, 2)))
        self.timings = {"client_barycenter": bary_seconds, "server_barycenter": server_seconds,
                        "projection": map_seconds, "senders": senders}
        return replace(federation, clients=clients), up, down

    def client_barycenter(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One client's upload: its per-channel barycenter of images x (N, C, H, W).

        Shapes: "sound", "channel" (C, bins) histogram; "joint" (pixels, C) support points (uniform weights);
        "paper-code" (C, pixels) histograms over sample positions.
        """
        if self.max_images and len(x) > self.max_images:
            pick = torch.randperm(len(x), generator=generator)[:self.max_images].to(x.device)
            x = x[pick]
        c = x.shape[1]
        if self.variant in ("sound", "channel"):
            support = self.support.to(x.device)
            hists = channel_histograms(x, self.bins, self.barycenter_pixels, generator,
                                       self.barycenter_replace)  # (N, C, B)
            return torch.stack([barycenter_1d(hists[:, ch], support, self.solver, self.reg, self.num_iter,
                                              self.tol) for ch in range(c)])
        clouds = sample_pixels(x, self.barycenter_pixels, generator, self.barycenter_replace)  # (N, P, C)
        if self.variant == "joint":
            rng = np.random.default_rng(int(torch.randint(2**62, (1,), generator=generator)))
            return torch.from_numpy(free_support_barycenter(list(clouds.numpy()), self.pixels, rng,
                                                            self.num_iter, self.tol))
        hists = paper_code_histograms(clouds.transpose(1, 2))  # (N, C, P)
        return torch.stack([torch.from_numpy(paper_code_barycenter(hists[:, ch].numpy().T.copy(), self.reg,
                                                                   self.num_iter, self.tol)) for ch in range(c)])

    def server_barycenter(self, barycenters: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """The target: the barycenter of the clients' barycenters (stacked as uploaded), per channel."""
        if self.variant in ("sound", "channel"):
            return torch.stack([barycenter_1d(barycenters[:, ch].double(), self.support, self.solver,
                                              self.reg_server, self.num_iter, self.tol)
                                for ch in range(barycenters.shape[1])])
        if self.variant == "joint":
            rng = np.random.default_rng(np.random.SeedSequence([seed, 2**31]))
            clouds = list(barycenters.double().numpy())
            return torch.from_numpy(free_support_barycenter(clouds, self.pixels, rng, self.num_iter, self.tol))
        hists = barycenters.double()
        hists = hists / hists.sum(-1, keepdim=True)  # the float32 upload, renormalised
        return torch.stack([torch.from_numpy(paper_code_barycenter(hists[:, ch].numpy().T.copy(), self.reg_server,
                                                                   self.num_iter, self.tol))
                            for ch in range(hists.shape[1])])

    def _align_client(self, c: ClientData, generator: torch.Generator) -> ClientData:
        if self.variant == "sound" and self.cdf == "client":
            pooled = c.x_train if c.num_train else c.x_test  # a client without training images fits on its tests
            self.client_maps[c.cid] = self._client_map(pooled)
            return replace(c, x_train=self._apply_client_map(c.x_train, self.client_maps[c.cid]),
                           x_test=self._apply_client_map(c.x_test, self.client_maps[c.cid]))
        return replace(c, x_train=self._align(c.x_train, generator), x_test=self._align(c.x_test, generator))

    def _align_val(self, c: ClientData, generator: torch.Generator) -> torch.Tensor:
        """Client c's monitored validation images mapped as its test images are (its own map, or each image's),
        on a stream of their own, so a run without them maps every other image as before."""
        if self.variant == "sound" and self.cdf == "client":
            return self._apply_client_map(c.x_val, self.client_maps[c.cid])
        return self._align(c.x_val, generator)

    # ---------------------------------------------------------------- mapping images onto the target

    def align(self, x: torch.Tensor, cid: int | None = None, seed: int | None = None) -> torch.Tensor:
        """Map images x (N, C, H, W) onto the target, as a client would; after :meth:`setup`.

        With ``cdf="client"``, client `cid`'s map is used (None: a map fitted on x's own pooled
        histogram). The sampling variants draw from `seed` (None: the set-up's seed).
        """
        if self.target is None:
            raise RuntimeError("call setup() before align()")
        check_range(x)
        if self.variant == "sound" and self.cdf == "client":
            table = self.client_maps[cid] if cid is not None else self._client_map(x)
            return self._apply_client_map(x, table)
        return self._align(x, _generator(self._seed if seed is None else seed, cid, 1))

    def _align(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if len(x) == 0:
            return x
        if self.variant == "sound":
            return self._match_images(x)
        if self.variant == "channel":
            return self._sinkhorn_channels(x, generator)
        return self._sinkhorn_images(x, generator)

    def _match_images(self, x: torch.Tensor) -> torch.Tensor:
        """Each image's channels by their own CDFs onto the target (vectorised over chunks of images)."""
        out = torch.empty_like(x)
        support, target = self.support.to(x.device), self.target.to(x.device)  # (B,), (C, B)
        n, c = x.shape[:2]
        for s in range(0, n, _CHUNK):
            xb = x[s:s + _CHUNK]
            idx = level_index(xb.reshape(len(xb), c, -1), self.bins)  # (n, C, HW)
            hists = _count_levels(idx, self.bins)  # (n, C, B)
            table = torch.stack([monotone_map(hists[:, ch], target[ch], support) for ch in range(c)], 1)  # (n, C, B)
            out[s:s + _CHUNK] = table.gather(2, idx).to(x.dtype).reshape(xb.shape)
        return out

    def _client_map(self, x: torch.Tensor) -> torch.Tensor:
        """The map of a client's pooled histogram onto the target, per channel: (C, B)."""
        pooled = channel_histograms(x, self.bins).sum(0)  # (C, B)
        target, support = self.target.to(x.device), self.support.to(x.device)
        return torch.stack([monotone_map(pooled[ch], target[ch], support) for ch in range(len(pooled))])

    def _apply_client_map(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        if len(x) == 0:
            return x
        n, c = x.shape[:2]
        idx = level_index(x.reshape(n, c, -1), self.bins)  # (N, C, HW)
        table = table.to(x.device)[None].expand(n, c, self.bins)  # (N, C, B)
        return table.gather(2, idx).to(x.dtype).reshape(x.shape)

    def _sinkhorn_images(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Each image by its own SinkhornTransport onto the target points (one POT call per image)."""
        n, c, h, w = x.shape
        target = self.target.double().numpy()
        target = target if self.variant == "joint" else target.T  # (k, C) points
        samples = sample_pixels(x, self.pixels, generator).numpy()  # (N, P, C)
        images = x.detach().reshape(n, c, -1).transpose(1, 2).double().cpu().numpy()  # (N, HW, C)
        out = np.stack([sinkhorn_map(images[i], samples[i], target, self.reg_map, self.map_iter,
                                     self.out_of_sample_map) for i in range(n)])  # (N, HW, C)
        return torch.from_numpy(out).transpose(1, 2).reshape(n, c, h, w).to(x)

    def _sinkhorn_channels(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Each channel of each image by its own 1-D SinkhornTransport onto the target's quantile points."""
        n, c, h, w = x.shape
        points = quantile_points(self.target, self.support, self.pixels).numpy()[..., None]  # (C, P, 1)
        samples = sample_pixels(x, self.pixels, generator).numpy()  # (N, P, C)
        images = x.detach().reshape(n, c, -1).double().cpu().numpy()[..., None]  # (N, C, HW, 1)
        out = np.stack([np.stack([sinkhorn_map(images[i, ch], samples[i, :, ch:ch + 1], points[ch], self.reg_map,
                                               self.map_iter, self.out_of_sample_map)[:, 0] for ch in range(c)])
                        for i in range(n)])  # (N, C, HW)
        return torch.from_numpy(out).reshape(n, c, h, w).to(x)


# ------------------------------------------------------------------------- cost of the preprocessing

@dataclass(frozen=True)
class AlignmentCost:
    """Measured seconds of one alignment, by stage.

    client_barycenter, projection : per client (the clients work in parallel in a federation).
    server_barycenter : the server's one barycenter.
    """

    client_barycenter: tuple[float, ...]
    server_barycenter: float
    projection: tuple[float, ...]

    @property
    def parallel(self) -> float:
        """What a federation waits when clients work in parallel: slowest client barycenter + server's +
        slowest projection (the quantity the paper's Section 6 bounds)."""
        return max(self.client_barycenter) + self.server_barycenter + max(self.projection)

    @property
    def total(self) -> float:
        """Every stage on one machine, one after the other."""
        return sum(self.client_barycenter) + self.server_barycenter + sum(self.projection)


def alignment_cost(images: torch.Tensor, images_per_client: int, num_clients: int = 1, seed: int = 0,
                   **params) -> AlignmentCost:
    """Time :meth:`OTAlign.setup` on a federation of `num_clients` clients of `images_per_client` images.

    Parameters
    ----------
    images : real images (N, C, H, W) in [0, 1]; client i gets the i-th block of `images_per_client`
        of them (reused cyclically when N is smaller than needed). Clients have no test images, so the
        projection stage maps exactly `images_per_client` images per client.
    images_per_client : the paper's M.
    num_clients : the paper's N.
    seed : the set-up's seed.
    params : :class:`OTAlign`'s parameters (variant, pixels, reg, solver, ...).

    Returns the measured :class:`AlignmentCost` (wall-clock seconds of this machine).
    """
    if images_per_client < 1 or num_clients < 1:
        raise ValueError("images_per_client and num_clients must be >= 1")
    need = torch.arange(images_per_client * num_clients) % len(images)
    x = images[need].reshape(num_clients, images_per_client, *images.shape[1:])
    y = torch.zeros(images_per_client, dtype=torch.long)
    clients = [ClientData(x[i], y, x[i][:0], y[:0], cid=i) for i in range(num_clients)]
    fed = Federation(clients=clients, x_test=images[:0], y_test=y[:0], num_classes=1,
                     input_shape=tuple(images.shape[1:]), class_counts=np.full((num_clients, 1), images_per_client),
                     scheme="iid", dataset="timing")
    aug = OTAlign(**params)
    aug.setup(fed, seed)
    t = aug.timings
    return AlignmentCost(tuple(t["client_barycenter"]), float(t["server_barycenter"]), tuple(t["projection"]))


def cost_sweep(images: torch.Tensor, points: Sequence[tuple[int, dict]], repeats: int, seed: int = 0) -> np.ndarray:
    """Time one client's set-up (:func:`alignment_cost`) at every point of a sweep, the whole sweep `repeats`
    times over, so that a busy moment of the machine spoils one run of a point, not a whole series.

    points : (images per client, :class:`OTAlign`'s parameters) per point.

    Returns the seconds, (repeats, points, 2): the client's barycenter, then its projection.
    """
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    out = np.zeros((repeats, len(points), 2))
    for r in range(repeats):
        for i, (m, params) in enumerate(points):
            measured = alignment_cost(images, m, 1, seed=seed, **params)
            out[r, i] = measured.client_barycenter[0], measured.projection[0]
    return out
