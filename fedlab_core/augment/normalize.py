"""Conventional normalisation: one fixed per-channel mean and std for every client, ``(x - mean) / std``,
applied to training batches and evaluation inputs alike (the "+ norm" baseline of FedRDN, Yan et al.).

By default the statistics are those of the union of the clients' training sets (every pixel of every
image, population std), i.e. the usual dataset normalisation. In a federation that takes one exchange:
each client sends its per-channel pixel count, sum and sum of squares, the server sends back mean and
std; :meth:`Normalize.setup` returns those messages so their (tiny) bytes are counted. Given ``mean`` and
``std`` explicitly, nothing is exchanged: ``Normalize(**CODE_CONSTANTS)`` is the FedRDN authors' code's
"+ norm", ImageNet's fixed constants for three-channel images.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..algorithms.base import Message
from ..data.federation import Federation
from .base import Augment

# the FedRDN authors' code's "+ norm": fixed constants (ImageNet's channel means and stds), not the clients' data
CODE_CONSTANTS = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}


def channel_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel pixel count, sum and sum of squares of images (N, C, H, W), in float64; each (C,)."""
    x = x.double().transpose(0, 1).reshape(x.shape[1], -1)  # (C, N*H*W)
    count = torch.full((x.shape[0],), float(x.shape[1]), dtype=torch.float64, device=x.device)
    return count, x.sum(1), (x * x).sum(1)


class Normalize(Augment):
    """Per-channel standardisation with one global mean and std.

    Parameters
    ----------
    mean, std : per-channel statistics (length C, or one value for every channel); None: computed in
        :meth:`setup` from the union of the clients' training data.
    """

    name = "normalize"

    def __init__(self, mean: Sequence[float] | float | None = None, std: Sequence[float] | float | None = None):
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        self.given = mean is not None
        self.mean = self.std = None
        if self.given:
            self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
            self.std = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
            if (self.std <= 0).any():
                raise ValueError(f"std must be positive, got {std}")

    def setup(self, federation: Federation, seed: int):
        if self.given:
            channels = federation.input_shape[0]
            for label, values in (("mean", self.mean), ("std", self.std)):
                if len(values) not in (1, channels):
                    raise ValueError(f"'normalize' parameter {label!r} has {len(values)} values, but the images "
                                     f"have {channels} channel(s): give one value or one per channel")
            return federation, [], []
        up = []
        for c in federation.clients:
            count, total, total_sq = channel_sums(c.x_train)
            up.append(Message({"count": count, "sum": total, "sum_sq": total_sq}))
        count = sum(m.tensors["count"] for m in up)  # (C,)
        mean = sum(m.tensors["sum"] for m in up) / count
        var = (sum(m.tensors["sum_sq"] for m in up) / count - mean * mean).clamp_min(0)
        self.mean = mean.float()
        self.std = var.sqrt().float().clamp_min(1e-8)  # a constant channel is only centred
        down = [Message({"mean": self.mean, "std": self.std}) for _ in federation.clients]
        return federation, up, down

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """(x - mean) / std per channel; x (B, C, H, W)."""
        mean = self.mean.to(x).view(1, -1, 1, 1)  # (1, C or 1, 1, 1)
        std = self.std.to(x).view(1, -1, 1, 1)
        return (x - mean) / std

    def train_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cid: int,
                    rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self.normalize(x), y

    def eval_input(self, x: torch.Tensor, cid: int | None) -> torch.Tensor:
        return self.normalize(x)
