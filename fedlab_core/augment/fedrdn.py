"""FedRDN: federated random data normalisation (Yan, Zhou, Zhao, Li and Liu, "A Simple Data Augmentation
for Feature Distribution Skewed Federated Learning").

Set-up (the paper's Algorithm 1): each client computes channel-wise statistics of its training images,
the mean over images of each image's channel mean and channel std (Eq. 5; the paper's Eq. 4 writes a
sum, its authors' code divides by the image count, which is what a normalisation needs). It sends the
pair ``(mu_k, sigma_k)`` (2 x C floats) up; the server sends the list of all K pairs to every client.
These messages are returned from :meth:`FedRDN.setup`, so the engine counts their bytes.
The statistics are those of the training images as stored, before any flip or rotation of a train
transform: the paper's Algorithm 1 computes them from the local dataset before training starts. (The
authors' code takes one pass of its augmented loader, whose rotations of up to 30 degrees fill the
corners with black.)

Training (Algorithm 2, Eq. 6): every training image is normalised ``(x - mu_j) / sigma_j`` with the
statistics of a client j drawn uniformly from the shared list (the client's own included). The paper
re-draws "for each image at each training epoch"; here a fresh draw is made for each image every time it
appears in a mini-batch, which is once per epoch. Testing (Eq. 7): a client normalises its test images
with its own statistics.

Options for the authors' code's behaviour (the paper's version is the default):

- ``draw="per_batch"``: one draw for the whole mini-batch instead of one per image;
- ``pairing="independent"``: mean and std drawn independently (client i's mean with client j's std)
  instead of as the pair of one client;
- ``unbiased_std=True``: per-image std with Bessel's correction (torch's default), not Eq. 5's.

A client channel whose images are all constant (std 0) has no spread to normalise by: images drawn with that
client's statistics are centred on that channel, not divided by zero.

Variant ``variant="average"`` is FedRDN-V (Sec. 4.5, Eq. 8): every client normalises training and test
images with the average of the K pairs; no randomness. The global test set, which belongs to no client,
is normalised with that average too, in both variants.
"""
from __future__ import annotations

import torch
from torch import nn

from ..algorithms.base import Message
from ..data.federation import Federation
from ..params import OneOf
from .base import Augment

VARIANTS = ("random", "average")
MIN_STD = 1e-6  # a channel std at or below this counts as none: that channel is centred, not scaled
DRAWS = ("per_image", "per_batch")
PAIRINGS = ("paired", "independent")


def image_statistics(x: torch.Tensor, unbiased: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over images of the per-image channel means and channel stds (Eq. 5), each (C,).

    x : images (N, C, H, W), N >= 1.
    unbiased : per-image std with Bessel's correction (the authors' code) instead of Eq. 5's 1/HW.
    """
    if x.ndim != 4 or len(x) == 0:
        raise ValueError(f"expected a non-empty batch of images (N, C, H, W), got shape {tuple(x.shape)}")
    pixels = x.double().flatten(2)  # (N, C, H*W)
    mean = pixels.mean(2).mean(0)
    std = pixels.std(2, correction=1 if unbiased else 0).mean(0)
    return mean.float(), std.float()


class FedRDN(Augment):
    """Random data normalisation with statistics shared by all clients.

    Parameters
    ----------
    variant : "random" (FedRDN) or "average" (FedRDN-V).
    draw : "per_image" (the paper) or "per_batch" (the authors' code).
    pairing : "paired" (the paper: one client's mean and std) or "independent" (the code).
    unbiased_std : per-image std with Bessel's correction (the code) instead of the population std.
    """

    name = "fedrdn"
    shares = "its images' channel-wise mean and standard deviation, once before training"
    constraints = {"variant": OneOf(*VARIANTS), "draw": OneOf(*DRAWS), "pairing": OneOf(*PAIRINGS)}

    def __init__(self, variant: str = "random", draw: str = "per_image", pairing: str = "paired",
                 unbiased_std: bool = False):
        self.variant, self.draw, self.pairing, self.unbiased_std = variant, draw, pairing, unbiased_std
        self.means = self.stds = None  # (K, C) each, after setup

    def setup(self, federation: Federation, seed: int):
        up = []
        for c in federation.clients:
            if c.num_train == 0:
                raise ValueError(f"client {c.cid} has no training images to compute FedRDN statistics from")
            mean, std = image_statistics(c.x_train, self.unbiased_std)
            up.append(Message({"mean": mean, "std": std}))
        self.means = torch.stack([m.tensors["mean"] for m in up])  # (K, C)
        stds = torch.stack([m.tensors["std"] for m in up])
        # a channel without spread at a client (constant in every image) is only centred with that client's
        # statistics: dividing by its zero std would scale every image drawn with them by ~1e8
        self.stds = torch.where(stds > MIN_STD, stds, torch.ones_like(stds))
        down = [Message({"means": self.means, "stds": self.stds}) for _ in federation.clients]
        return federation, up, down

    def _normalise(self, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """(x - mean) / std with mean, std of shape (C,) or (B, C)."""
        shape = (-1, x.shape[1], 1, 1) if mean.ndim == 2 else (1, -1, 1, 1)
        return (x - mean.to(x).view(shape)) / std.to(x).view(shape)

    def train_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cid: int,
                    rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.variant == "average":
            return self._normalise(x, self.means.mean(0), self.stds.mean(0)), y
        k = len(self.means)
        draws = len(x) if self.draw == "per_image" else 1
        i = torch.randint(k, (draws,), generator=rng)
        j = i if self.pairing == "paired" else torch.randint(k, (draws,), generator=rng)
        mean, std = self.means[i], self.stds[j]  # (draws, C)
        if draws == 1:
            mean, std = mean[0], std[0]
        return self._normalise(x, mean, std), y

    def eval_input(self, x: torch.Tensor, cid: int | None) -> torch.Tensor:
        if cid is None or self.variant == "average":
            return self._normalise(x, self.means.mean(0), self.stds.mean(0))
        return self._normalise(x, self.means[cid], self.stds[cid])
