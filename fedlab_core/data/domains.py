"""A feature-skew benchmark built offline from a real grayscale dataset.

In a feature-skew (domain-shift) federation every client holds the same classes, but its images look
different: other colours, textures, resolutions. :func:`make_domains` builds such a benchmark from any
1-channel :class:`~fedlab_core.data.base.Dataset` (by default the book uses Fashion-MNIST): it splits the
base images into disjoint, class-stratified shards, one per domain, and applies one style transform to
each shard.

.. important::
   These domains are **synthetic shifts of real images**. The objects (digits, garments, ...) are real,
   but the "styles" are produced by the simple, hand-written transforms below, not collected from
   different real-world sources. They mimic the kind of shift found in Digits-5 / Office / DomainNet
   benchmarks, without any download.

Domains (see :data:`DOMAIN_TRANSFORMS`):

``original``
    The grey image replicated to three channels (the unshifted reference domain).
``mnistm``
    The MNIST-M recipe: ``|patch - x|`` per pixel and channel, where ``patch`` is a random HxW crop of
    one of scikit-learn's two bundled colour photos (``china.jpg``, ``flower.jpg``).
``colour``
    Colourised: the foreground takes a random bright colour per image, the background another, darker
    random colour: ``x * fg + (1 - x) * bg``.
``inverted_noise``
    Inverted intensities ``1 - x`` plus Gaussian pixel noise (std 0.15), clipped to [0, 1].
``lowres``
    Area-downsampled by 4 and bilinearly upsampled back (a blurred, low-resolution look), tinted sepia.

Five more, for a ten-domain benchmark (:data:`TEN_DOMAINS`, a stand-in for DomainNet's many styles with
fewer images each):

``faded``
    Low contrast on a light grey page: ``0.55 + 0.3 x`` (a washed-out scan).
``edges``
    The Sobel gradient magnitude of the image, white lines on black (a sketch).
``stripes``
    The garment drawn over random diagonal colour stripes (a textured background).
``posterised``
    Three intensity levels, dark blue ink on a yellow page (a printed poster).
``speckle``
    Salt-and-pepper noise on 15% of the pixels, with a random green-to-magenta tint per image.

Every transform is a pure, vectorised function ``(x: (N, 1, H, W) float in [0, 1], gen: torch.Generator)
-> (N, 3, H, W)`` with values clipped to [0, 1]. Everything is deterministic given ``seed``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .base import Dataset
from .partition import _apportion

__all__ = [
    "DEFAULT_DOMAINS",
    "TEN_DOMAINS",
    "DOMAIN_TRANSFORMS",
    "make_domains",
    "channel_stats",
    "stratified_shards",
    "unused_images",
]

Transform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]

DEFAULT_DOMAINS: tuple[str, ...] = ("original", "mnistm", "colour", "inverted_noise", "lowres")
TEN_DOMAINS: tuple[str, ...] = DEFAULT_DOMAINS + ("faded", "edges", "stripes", "posterised", "speckle")

_PHOTOS: torch.Tensor | None = None  # (2, 3, Hp, Wp) float32 in [0, 1], loaded once
_GATHER_CHUNK = 8192  # images per gather in the mnistm transform (bounds the int64 index tensor)


def _photos() -> torch.Tensor:
    """scikit-learn's two bundled colour photos as a (2, 3, 427, 640) float tensor, cached at module level."""
    global _PHOTOS
    if _PHOTOS is None:
        from sklearn.datasets import load_sample_images

        imgs = np.stack(load_sample_images().images)  # (2, H, W, 3) uint8
        _PHOTOS = torch.from_numpy(imgs).permute(0, 3, 1, 2).float().div_(255.0).contiguous()
    return _PHOTOS


def _grey3(x: torch.Tensor) -> torch.Tensor:
    return x.expand(-1, 3, -1, -1)


# --------------------------------------------------------------------------------------------------
# Domain transforms
# --------------------------------------------------------------------------------------------------

def original(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Unshifted: the grey image replicated to 3 channels."""
    return _grey3(x).clamp(0.0, 1.0).contiguous()


def mnistm(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """MNIST-M recipe: |patch - x| with a random HxW crop of a bundled colour photo (china/flower)."""
    photos = _photos()
    n, _, h, w = x.shape
    p, _, ph, pw = photos.shape
    if h > ph or w > pw:
        raise ValueError(f"mnistm needs images no larger than the photos ({ph}x{pw}), got {h}x{w}")
    which = torch.randint(0, p, (n,), generator=gen)
    top = torch.randint(0, ph - h + 1, (n,), generator=gen)
    left = torch.randint(0, pw - w + 1, (n,), generator=gen)
    # Flat index of pixel (img, c, top+i, left+j) in photos.view(-1), built by broadcasting.
    flat = photos.reshape(-1)
    chan = (torch.arange(3) * ph * pw).view(1, 3, 1, 1)
    rows = torch.arange(h).view(1, 1, h, 1)
    cols = torch.arange(w).view(1, 1, 1, w)
    out = torch.empty(n, 3, h, w)
    for s in range(0, n, _GATHER_CHUNK):  # chunks of images, not a per-image loop
        e = min(s + _GATHER_CHUNK, n)
        base = (which[s:e] * (3 * ph * pw) + top[s:e] * pw + left[s:e]).view(-1, 1, 1, 1)
        patch = flat[base + chan + rows * pw + cols]
        out[s:e] = (patch - x[s:e]).abs_()
    return out.clamp_(0.0, 1.0)


def colour(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Colourised: x * fg + (1 - x) * bg with a bright random fg and a darker random bg colour per image."""
    n = x.shape[0]
    fg = 0.5 + 0.5 * torch.rand(n, 3, 1, 1, generator=gen)  # in [0.5, 1]
    bg = 0.4 * torch.rand(n, 3, 1, 1, generator=gen)  # in [0, 0.4]
    return (x * fg + (1.0 - x) * bg).clamp_(0.0, 1.0)


def inverted_noise(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Inverted: 1 - x plus grey Gaussian pixel noise (std 0.15), clipped to [0, 1]."""
    noise = 0.15 * torch.randn(x.shape, generator=gen)
    return _grey3((1.0 - x + noise).clamp_(0.0, 1.0)).contiguous()


_SEPIA_INK = torch.tensor([1.0, 0.82, 0.58]).view(1, 3, 1, 1)
_SEPIA_PAPER = torch.tensor([0.14, 0.09, 0.04]).view(1, 3, 1, 1)


def lowres(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Low resolution: area-downsample by 4, bilinear upsample back (blurry), sepia tint."""
    h, w = x.shape[-2:]
    if x.shape[0] == 0:
        return x.new_zeros(0, 3, h, w)
    small = F.interpolate(x, size=(max(1, h // 4), max(1, w // 4)), mode="area")
    g = F.interpolate(small, size=(h, w), mode="bilinear", align_corners=False)
    return (g * _SEPIA_INK + (1.0 - g) * _SEPIA_PAPER).clamp_(0.0, 1.0)


def faded(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Faded: low contrast on a light grey page, 0.55 + 0.3 x."""
    return _grey3(0.55 + 0.3 * x).contiguous()


_SOBEL = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]).view(1, 1, 3, 3)


def edges(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Edges: the Sobel gradient magnitude, white lines on black (a sketch)."""
    gx = F.conv2d(x, _SOBEL, padding=1)
    gy = F.conv2d(x, _SOBEL.transpose(2, 3), padding=1)
    return _grey3((gx.square() + gy.square()).sqrt_().div_(4.0).clamp_(0.0, 1.0)).contiguous()


def stripes(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Stripes: the image over random diagonal stripes of two random colours (period 4 to 8 pixels)."""
    n, _, h, w = x.shape
    period = torch.randint(4, 9, (n, 1, 1, 1), generator=gen).float()
    phase = torch.rand(n, 1, 1, 1, generator=gen) * period
    diagonal = (torch.arange(h).view(1, 1, h, 1) + torch.arange(w).view(1, 1, 1, w)).float()
    band = ((diagonal + phase) % period < period / 2).float()  # (N, 1, H, W)
    a, b = torch.rand(n, 3, 1, 1, generator=gen), torch.rand(n, 3, 1, 1, generator=gen)
    background = band * a + (1.0 - band) * b
    return (x + (1.0 - x) * background).clamp_(0.0, 1.0)


_POSTER_INK = torch.tensor([0.1, 0.15, 0.45]).view(1, 3, 1, 1)
_POSTER_PAPER = torch.tensor([0.98, 0.9, 0.3]).view(1, 3, 1, 1)  # every channel differs from the ink's


def posterised(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Posterised: three intensity levels, dark blue ink on a yellow page."""
    level = (x * 3.0).floor_().clamp_(max=2.0) / 2.0  # 0, 0.5, 1
    return (level * _POSTER_INK + (1.0 - level) * _POSTER_PAPER).clamp_(0.0, 1.0)


def speckle(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Speckle: salt-and-pepper noise on 15% of the pixels, a random green-to-magenta tint per image."""
    u = torch.rand(x.shape, generator=gen)
    salt = torch.rand(x.shape, generator=gen) < 0.5
    noisy = torch.where(u < 0.15, salt.float(), x)
    t = torch.rand(x.shape[0], 1, 1, 1, generator=gen)
    tint = torch.cat([0.6 + 0.4 * t, 1.0 - 0.4 * t, 0.6 + 0.4 * t], dim=1)  # green (t=0) to magenta (t=1)
    return (noisy * tint).clamp_(0.0, 1.0)


DOMAIN_TRANSFORMS: dict[str, Transform] = {
    "original": original,
    "mnistm": mnistm,
    "colour": colour,
    "inverted_noise": inverted_noise,
    "lowres": lowres,
    "faded": faded,
    "edges": edges,
    "stripes": stripes,
    "posterised": posterised,
    "speckle": speckle,
}


def _describe(name: str) -> str:
    doc = (DOMAIN_TRANSFORMS[name].__doc__ or name).strip()
    return doc.splitlines()[0]


# --------------------------------------------------------------------------------------------------
# Splitting
# --------------------------------------------------------------------------------------------------

def stratified_shards(y: torch.Tensor, num_shards: int, rng: np.random.Generator,
                      max_per_shard: int | None = None) -> list[np.ndarray]:
    """Split sample indices into ``num_shards`` disjoint, class-stratified shards.

    Each class's (shuffled) samples are dealt round-robin to the shards starting at a random shard, so per
    class the shard counts differ by at most one. With ``max_per_shard`` every shard is cut to the same
    per-class quota (proportional to the class sizes), so capped shards have identical class histograms.
    Returns one shuffled index array per shard.
    """
    per, quota = _deal(y, num_shards, rng, max_per_shard)
    if quota is not None:
        per = [[per[d][k][: quota[k]] for k in range(len(quota))] for d in range(num_shards)]
    return [rng.permutation(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in per]


def _deal(y: torch.Tensor, num_shards: int, rng: np.random.Generator, max_per_shard: int | None
          ) -> tuple[list[list[np.ndarray]], np.ndarray | None]:
    """:func:`stratified_shards`' deal before its cut: ``per[shard][class]``, each class's shuffled indices dealt
    round-robin from a random shard, and the per-class quota each shard keeps under the cap (None: no cap)."""
    y_np = y.cpu().numpy()
    classes = np.unique(y_np)
    per = [[None] * len(classes) for _ in range(num_shards)]  # per[shard][class] -> indices
    for k, c in enumerate(classes):
        idx = rng.permutation(np.flatnonzero(y_np == c))
        owner = (np.arange(len(idx)) + rng.integers(num_shards)) % num_shards
        for d in range(num_shards):
            per[d][k] = idx[owner == d]
    if max_per_shard is None:
        return per, None
    avail = np.array([min(len(per[d][k]) for d in range(num_shards)) for k in range(len(classes))])
    return per, _proportional_quota(avail, int(max_per_shard))


def _proportional_quota(avail: np.ndarray, cap: int) -> np.ndarray:
    """Largest-remainder allocation of ``cap`` samples proportionally to ``avail`` (never above it)."""
    if cap >= int(avail.sum()):
        return avail
    return np.minimum(_apportion(cap, avail), avail)


def _build_split(x: torch.Tensor, y: torch.Tensor, names: Sequence[str], rng: np.random.Generator,
                 gens: list[torch.Generator], cap: int | None):
    shards = stratified_shards(y, len(names), rng, cap)
    xs, ys, ds = [], [], []
    for d, (name, idx) in enumerate(zip(names, shards)):
        idx_t = torch.from_numpy(idx.astype(np.int64))
        xs.append(DOMAIN_TRANSFORMS[name](x[idx_t], gens[d]).to(torch.float32))
        ys.append(y[idx_t])
        ds.append(torch.full((len(idx),), d, dtype=torch.int64))
    return torch.cat(xs).contiguous(), torch.cat(ys), torch.cat(ds)


def make_domains(base: Dataset, domains: Sequence[str] = DEFAULT_DOMAINS, seed: int = 0,
                 samples_per_domain: int | None = None, test_per_domain: int | None = None) -> Dataset:
    """Build a multi-domain (feature-skew) RGB dataset from a 1-channel base dataset.

    The base training set is split into ``len(domains)`` disjoint, class-stratified shards (at most
    ``samples_per_domain`` images each), and domain ``d``'s transform from :data:`DOMAIN_TRANSFORMS` is
    applied to shard ``d``; the test set likewise (``test_per_domain``). The shifts are synthetic styles
    applied to real images (see the module docstring for what each domain does).

    Returns a :class:`Dataset` with 3 channels and the base's H, W and classes, ``domains=list(domains)``,
    ``domain_train`` / ``domain_test`` holding each sample's domain id, ``name=f"{base.name}_domains"`` and
    ``notes["domains"]`` mapping each domain to a one-line description. Deterministic given ``seed``.
    """
    names = list(domains)
    unknown = [d for d in names if d not in DOMAIN_TRANSFORMS]
    if unknown or not names:
        raise ValueError(f"Unknown domain(s) {unknown or names}; allowed: {sorted(DOMAIN_TRANSFORMS)}")
    if base.x_train.shape[1] != 1 or base.x_test.shape[1] != 1:
        raise ValueError(f"make_domains needs a 1-channel (grey) base dataset, got shape {base.input_shape}")
    for cap, what in ((samples_per_domain, "samples_per_domain"), (test_per_domain, "test_per_domain")):
        if cap is not None and cap < 0:
            raise ValueError(f"{what} must be non-negative, got {cap}")

    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, 2**62, size=len(names))
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    x_tr, y_tr, d_tr = _build_split(base.x_train, base.y_train, names, rng, gens, samples_per_domain)
    x_te, y_te, d_te = _build_split(base.x_test, base.y_test, names, rng, gens, test_per_domain)
    notes = {
        "base": base.name,
        "seed": seed,
        "synthetic": "Synthetic style shifts of real images (see fedlab_core.data.domains).",
        "domains": {d: _describe(d) for d in names},
    }
    return Dataset(x_tr, y_tr, x_te, y_te, num_classes=base.num_classes, name=f"{base.name}_domains",
                   classes=base.classes, domains=names, domain_train=d_tr, domain_test=d_te, notes=notes)


def unused_images(base: Dataset, domains: Sequence[str] = DEFAULT_DOMAINS, seed: int = 0,
                  samples_per_domain: int | None = None, per_domain: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training images of `base` that :func:`make_domains` with the same arguments leaves out of every domain: at
    most `per_domain` per domain, class-stratified like a capped shard, taken from the images dealt to that
    domain's shard and cut by ``samples_per_domain``, and styled by the domain's transform (with a random stream of
    their own, so the benchmark's images are untouched). A pool no client holds, for validation sets
    (``RunConfig.validation_source="unused"``). Returns (x (N, 3, H, W), y (N,), domain ids (N,)); empty without a
    cap (every image is in a shard)."""
    names = list(domains)
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, 2**62, size=len(names))     # as make_domains draws them, before the training shards
    per, quota = _deal(base.y_train, len(names), rng, samples_per_domain)
    xs, ys, ds = [], [], []
    for d, name in enumerate(names):
        rest = [] if quota is None else [per[d][k][quota[k]:] for k in range(len(quota))]
        take = _proportional_quota(np.array([len(r) for r in rest], dtype=int), int(per_domain))
        idx = torch.from_numpy(np.concatenate([r[:t] for r, t in zip(rest, take)] or [np.zeros(0, dtype=np.int64)]))
        gen = torch.Generator().manual_seed(int(np.random.default_rng([int(seeds[d]), 1]).integers(2**62)))
        xs.append(DOMAIN_TRANSFORMS[name](base.x_train[idx], gen).to(torch.float32) if len(idx)
                  else base.x_train.new_zeros((0, 3, *base.x_train.shape[2:])))
        ys.append(base.y_train[idx])
        ds.append(torch.full((len(idx),), d, dtype=torch.int64))
    return torch.cat(xs).contiguous(), torch.cat(ys), torch.cat(ds)


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------

def channel_stats(ds: Dataset):
    """Per-domain, per-channel mean and (population) std of the training images, as a DataFrame.

    Columns ``domain, mean_r, mean_g, mean_b, std_r, std_g, std_b``; one row per domain (one row named
    after the dataset when it has no domains). Grey images report the same value for r, g and b.
    """
    import pandas as pd

    x = ds.x_train
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    if x.shape[1] != 3:
        raise ValueError(f"channel_stats needs 1- or 3-channel images, got {x.shape[1]} channels")
    if ds.domains is None or ds.domain_train is None:
        groups = [(ds.name, torch.ones(len(x), dtype=torch.bool))]
    else:
        groups = [(name, ds.domain_train == d) for d, name in enumerate(ds.domains)]
    rows = []
    for name, mask in groups:
        flat = x[mask].transpose(0, 1).reshape(3, -1)
        std, mean = torch.std_mean(flat, dim=1, correction=0)
        rows.append([name, *mean.tolist(), *std.tolist()])
    return pd.DataFrame(rows, columns=["domain", "mean_r", "mean_g", "mean_b", "std_r", "std_g", "std_b"])
