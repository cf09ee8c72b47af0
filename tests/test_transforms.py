"""The training transforms of the authors' code: FedRDN's flips and rotations, FRAug's crops and colour jitter, per
image, from the client's stream."""
import pytest
import torch

from fedlab_core import RunConfig
from fedlab_core.data.transforms import crop_jitter_gray, flip_rotate
from fedlab_core.runs import run
from fedlab_core.tuning import settings_table


def _image():
    x = torch.zeros(1, 1, 8, 8)
    x[0, 0, 1, 2] = 1.0  # one bright pixel off every axis of symmetry
    return x


def test_without_rotation_an_image_is_kept_or_mirrored():
    x = _image().expand(64, 1, 8, 8)
    out = flip_rotate(x, torch.Generator().manual_seed(0), max_degrees=0.0)
    kept = [torch.allclose(o, x[0], atol=1e-6) for o in out]
    mirrored = [torch.allclose(o, x[0].flip(-1), atol=1e-6) for o in out]
    assert all(k != m for k, m in zip(kept, mirrored))  # each image is one or the other
    assert 20 < sum(mirrored) < 44  # about half


def test_each_image_turns_about_its_centre_by_its_own_angle_within_30_degrees():
    x = _image().expand(256, 1, 8, 8)
    out = flip_rotate(x, torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)  # the same draws, in the same order: flips, then angles
    flip = torch.rand(256, generator=g) < 0.5
    angle = (torch.rand(256, generator=g) * 2 - 1) * torch.pi / 6
    assert angle.abs().max() > torch.pi / 6 * 0.95  # the draws cover the range
    # where the bright pixel's mass should land: mirrored (column 2 -> 5), then turned about (3.5, 3.5)
    px = torch.where(flip, torch.tensor(5.0), torch.tensor(2.0)) - 3.5
    py = torch.full((256,), 1.0 - 3.5)
    ex, ey = angle.cos() * px + angle.sin() * py, -angle.sin() * px + angle.cos() * py
    rows, cols = torch.meshgrid(torch.arange(8.0) - 3.5, torch.arange(8.0) - 3.5, indexing="ij")
    mass = out[:, 0].sum((1, 2))
    cx, cy = (out[:, 0] * cols).sum((1, 2)) / mass, (out[:, 0] * rows).sum((1, 2)) / mass
    assert torch.allclose(cx, ex, atol=0.35) and torch.allclose(cy, ey, atol=0.35)
    assert not torch.allclose(out[0], out[1])  # images get their own draws


def test_same_stream_same_batch_and_a_run_changes_with_the_transform():
    x = torch.rand(5, 3, 8, 8)
    a = flip_rotate(x, torch.Generator().manual_seed(3))
    b = flip_rotate(x, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == x.shape
    base = RunConfig(dataset="digits", model="mlp", num_clients=3, num_rounds=1, lr=0.1, local_epochs=1,
                     batch_size=32)
    plain, turned = (run(base.replace(train_transform=t), use_cache=False, workers=1).final["global_loss"]
                     for t in (None, "flip_rotate"))
    assert plain != turned
    assert "batch 32, flip and rotate (" in settings_table({"x": base.replace(train_transform="flip_rotate")}
                                                        ).loc["x", "local work per round"]
    with pytest.raises(ValueError, match="^train_transform:"):
        base.replace(train_transform="mirror")


# ------------------------------------------------------------------------ FRAug's Digits pipeline


def test_crop_jitter_gray_draws_per_image_stays_in_range_and_repeats_from_the_stream():
    torch.manual_seed(0)
    x = torch.rand(32, 3, 12, 12)
    a = crop_jitter_gray(x, torch.Generator().manual_seed(5))
    assert torch.equal(a, crop_jitter_gray(x, torch.Generator().manual_seed(5)))
    assert a.shape == x.shape and a.min() >= 0 and a.max() <= 1
    same = x[:1].expand(32, 3, 12, 12)
    out = crop_jitter_gray(same, torch.Generator().manual_seed(6))
    assert len({tuple(o.flatten()[:5].tolist()) for o in out}) == 32   # every image its own draws
    gray = [torch.equal(o[0], o[1]) and torch.equal(o[1], o[2]) for o in crop_jitter_gray(
        torch.rand(400, 3, 4, 4), torch.Generator().manual_seed(7))]
    assert 20 < sum(gray) < 65                                          # grayscale with probability 0.1


def test_crop_jitter_gray_without_jitter_only_crops_to_at_least_70_percent_of_the_area():
    x = torch.zeros(64, 1, 20, 20)
    x[:, :, 9:11, 9:11] = 1.0   # a bright centre: a crop that keeps 70% or more of the area keeps it
    out = crop_jitter_gray(x, torch.Generator().manual_seed(8), jitter=0.0, gray=0.0)
    mass = out.sum((1, 2, 3))
    assert (mass > 3.5).all() and (mass < 6.0).all()   # 4 pixels, magnified by at most 1 / 0.7
    assert (mass > 4.05).any()                          # some images are magnified
    assert "crop and jitter and gray" in settings_table(
        {"x": RunConfig(dataset="digits", train_transform="crop_jitter_gray")}).loc["x", "local work per round"]
