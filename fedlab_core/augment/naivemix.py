"""NaiveMix (Yoon, Shin, Hwang and Yang, "FedMix: Approximation of Mixup under Mean Augmented Federated
Learning", ICLR 2021, Eq. 6): mixup with averaged images that the clients share.

Set-up (mean-augmented federated learning, MAFL): each client shuffles its training set, cuts it into
groups of ``mean_batch_size`` images and sends the mean image and mean one-hot label of each group
(a trailing incomplete group is dropped; a client with fewer images sends one mean of all of them).
The server pools every client's means and sends the pool to every client. These messages are returned
from :meth:`NaiveMix.setup`, so the engine counts them: this is the communication (and privacy) cost that
FedRDN's statistics avoid.

Training: each image of a batch is mixed with a mean image drawn uniformly from the global pool,
``x' = (1 - lam) x + lam x_g`` with targets ``(1 - lam) onehot(y) + lam y_g``. Evaluation inputs are left
alone. Defaults: ``mean_batch_size = 10``, ``lam = 0.05``.

Why NaiveMix and not FedMix. The FedRDN paper names its rival "FedMix" and places it in the data
augmentation flow, at the input level, beside normalisation. FedMix proper is not an input transform: it
replaces the loss of global mixup by its first-order Taylor expansion around the local image, a loss term
with the input gradient (``lam * dl/dx . x_g``), which no augmentation flow can hold. The input-level form
that FedMix's paper offers, and compares with, is NaiveMix; the FedRDN authors' code has no FedMix at all.
The book therefore runs NaiveMix and calls it so, beside the FedRDN paper's "FedMix" columns.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..algorithms.base import Message
from ..data.federation import Federation
from ..params import Range
from .base import Augment
from .mixup import soft_targets


def mean_batches(x: torch.Tensor, y: torch.Tensor, num_classes: int, mean_batch_size: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Means of shuffled groups of `mean_batch_size` samples.

    Returns (images (G, C, H, W), labels (G, classes)): the group means of x and of one-hot y.
    """
    n = len(y)
    if n == 0:
        return x[:0], torch.zeros(0, num_classes, device=x.device)
    perm = torch.randperm(n, generator=generator).to(x.device)  # (n,)
    size = min(mean_batch_size, n)
    g = n // size
    idx = perm[:g * size]
    images = x[idx].reshape(g, size, *x.shape[1:]).mean(1)  # (G, C, H, W)
    labels = F.one_hot(y[idx], num_classes).float().reshape(g, size, num_classes).mean(1)  # (G, classes)
    return images, labels


class NaiveMix(Augment):
    """NaiveMix with a globally shared pool of averaged images and labels.

    Parameters
    ----------
    mean_batch_size : number of local images averaged into one shared image (the paper's M).
    lam : mixing weight of the shared averaged image.
    """

    name = "naivemix"
    shares = "averages of its images and labels, once before training"
    constraints = {"mean_batch_size": Range(1), "lam": Range(0, 1)}

    def __init__(self, mean_batch_size: int = 10, lam: float = 0.05):
        self.mean_batch_size, self.lam = mean_batch_size, lam
        self.num_classes = 0
        self.pool_x = self.pool_y = None

    def setup(self, federation: Federation, seed: int):
        self.num_classes = federation.num_classes
        up = []
        for c in federation.clients:
            gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, c.cid]).generate_state(1)[0]))
            images, labels = mean_batches(c.x_train, c.y_train, self.num_classes, self.mean_batch_size, gen)
            up.append(Message({"images": images, "labels": labels}))
        self.pool_x = torch.cat([m.tensors["images"] for m in up])  # (G_total, C, H, W)
        self.pool_y = torch.cat([m.tensors["labels"] for m in up])  # (G_total, classes)
        down = [Message({"images": self.pool_x, "labels": self.pool_y}) for _ in federation.clients]
        return federation, up, down

    def train_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cid: int,
                    rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pool_x is None or len(self.pool_x) == 0:
            return x, y
        pick = torch.randint(len(self.pool_x), (len(x),), generator=rng).to(x.device)  # (B,)
        x_g, y_g = self.pool_x[pick].to(x), self.pool_y[pick].to(x)
        targets = soft_targets(y, self.num_classes)  # (B, classes)
        return (1 - self.lam) * x + self.lam * x_g, (1 - self.lam) * targets + self.lam * y_g
