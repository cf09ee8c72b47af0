"""Random transforms of training mini-batches (a run's ``train_transform``), drawn from the client's stream.

``"flip_rotate"`` is the training pipeline of FedRDN's authors' code (torchvision's RandomHorizontalFlip,
then RandomRotation(30)): each image is mirrored left-right with probability 1/2, then rotated about its
centre by an angle drawn uniformly from [-30, 30] degrees, bilinear, with zeros where the rotated image
leaves the frame (torchvision's default fill). The code's other steps (resizing to 256, computing the
statistics on the augmented loader) are not taken: images keep their size, statistics are the clean ones.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MAX_DEGREES = 30.0  # FedRDN's code: RandomRotation(30)


def flip_rotate(x: torch.Tensor, rng: torch.Generator, max_degrees: float = MAX_DEGREES) -> torch.Tensor:
    """(B, C, H, W) -> (B, C, H, W): a random horizontal flip (p = 1/2) and rotation in [-max, max] degrees
    per image, drawn from `rng` (a CPU generator)."""
    n, _, h, w = x.shape
    flip = (torch.rand(n, generator=rng) < 0.5).to(x.device).view(n, 1, 1, 1)
    angle = (torch.rand(n, generator=rng) * 2 - 1) * math.radians(max_degrees)
    x = torch.where(flip, x.flip(-1), x)
    cos, sin, zero = angle.cos(), angle.sin(), torch.zeros(n)
    # affine_grid works in [-1, 1] coordinates per axis: the aspect ratio keeps rotations rigid on H != W
    theta = torch.stack([torch.stack([cos, -sin * h / w, zero], 1),
                         torch.stack([sin * w / h, cos, zero], 1)], 1).to(x)  # (B, 2, 3)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


TRAIN_TRANSFORMS = {"none": None, "flip_rotate": flip_rotate}
