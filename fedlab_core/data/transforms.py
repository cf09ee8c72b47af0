"""Random transforms of training mini-batches (a run's ``train_transform``), drawn from the client's stream.

``"flip_rotate"`` is the training pipeline of FedRDN's authors' code (torchvision's RandomHorizontalFlip,
then RandomRotation(30)): each image is mirrored left-right with probability 1/2, then rotated about its
centre by an angle drawn uniformly from [-30, 30] degrees, bilinear, with zeros where the rotated image
leaves the frame (torchvision's default fill). The code's other steps (resizing to 256, computing the
statistics on the augmented loader) are not taken: images keep their size, statistics are the clean ones.

``"crop_jitter_gray"`` is the training pipeline of FRAug's authors' code on Digits (``datasets/Digits.py``):
torchvision's RandomResizedCrop(size, scale=(0.7, 1.0)), ColorJitter(0.3, 0.3, 0.3, 0.3) and
RandomGrayscale(p=0.1), each image with its own draws from the client's stream, through torchvision's
functional transforms. On one-channel images saturation, hue and grayscale leave the image unchanged, as
torchvision's do.
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


def _uniform(rng: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=rng))


def crop_jitter_gray(x: torch.Tensor, rng: torch.Generator, scale: tuple[float, float] = (0.7, 1.0),
                     jitter: float = 0.3, gray: float = 0.1) -> torch.Tensor:
    """(B, C, H, W) in [0, 1] -> the same shape: per image, a random resized crop (area share in `scale`, aspect
    ratio in [3/4, 4/3], as torchvision draws them: up to ten tries, else the whole image), brightness,
    contrast, saturation and hue jitter in a random order (factors in [1 - jitter, 1 + jitter], hue shift in
    [-jitter, jitter]), then grayscale with probability `gray`; every draw from `rng` (a CPU generator)."""
    from torchvision.transforms.v2 import functional as TF   # here: importing torchvision takes seconds

    _, c, h, w = x.shape
    out = []
    for image in x:
        top, left, height, width = 0, 0, h, w
        for _ in range(10):
            area = h * w * _uniform(rng, *scale)
            ratio = math.exp(_uniform(rng, math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < cw <= w and 0 < ch <= h:
                top = int(torch.randint(h - ch + 1, (), generator=rng))
                left = int(torch.randint(w - cw + 1, (), generator=rng))
                height, width = ch, cw
                break
        image = TF.resized_crop(image, top, left, height, width, [h, w], antialias=True)
        factors = [_uniform(rng, 1 - jitter, 1 + jitter) for _ in range(3)] + [_uniform(rng, -jitter, jitter)]
        for op in torch.randperm(4, generator=rng).tolist():
            if op == 0:
                image = TF.adjust_brightness(image, factors[0])
            elif op == 1:
                image = TF.adjust_contrast(image, factors[1])
            elif op == 2 and c == 3:
                image = TF.adjust_saturation(image, factors[2])
            elif op == 3 and c == 3:
                image = TF.adjust_hue(image, factors[3])
        if c == 3 and float(torch.rand((), generator=rng)) < gray:
            image = TF.rgb_to_grayscale(image, num_output_channels=3)
        out.append(image)
    return torch.stack(out)


TRAIN_TRANSFORMS = {"none": None, "flip_rotate": flip_rotate, "crop_jitter_gray": crop_jitter_gray}
