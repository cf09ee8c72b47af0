"""Tests for the synthetic feature-skew domains built from a small real base (scikit-learn digits)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from fedlab_core.data.base import Dataset
from fedlab_core.data.domains import (
    DEFAULT_DOMAINS,
    DOMAIN_TRANSFORMS,
    TEN_DOMAINS,
    channel_stats,
    make_domains,
    unused_images,
)


@pytest.fixture(scope="module")
def base() -> Dataset:
    """Real digit images (8x8, 0..16) resized to 28x28 in [0, 1]: a Fashion-MNIST-shaped grey base."""
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False).clamp(0, 1)
    y = torch.tensor(d.target, dtype=torch.int64)
    return Dataset(x[:1400], y[:1400], x[1400:], y[1400:], num_classes=10, name="digits",
                   classes=[str(i) for i in range(10)])


@pytest.fixture(scope="module")
def ds(base) -> Dataset:
    return make_domains(base, seed=0)


def test_shapes_range_and_metadata(base, ds):
    assert ds.x_train.shape == (len(base.y_train), 3, 28, 28)
    assert ds.x_test.shape == (len(base.y_test), 3, 28, 28)
    for x in (ds.x_train, ds.x_test):
        assert x.dtype == torch.float32 and x.min() >= 0 and x.max() <= 1
    assert ds.domains == list(DEFAULT_DOMAINS)
    assert ds.name == "digits_domains" and ds.num_classes == 10 and ds.classes == base.classes
    assert set(ds.notes["domains"]) == set(DEFAULT_DOMAINS)
    assert all(isinstance(v, str) and "\n" not in v for v in ds.notes["domains"].values())
    assert ds.domain_train.dtype == torch.int64 and set(ds.domain_train.tolist()) == set(range(5))


def test_shards_disjoint_and_stratified(base, ds):
    # every base label appears exactly once overall: the shards partition the base set
    assert torch.equal(torch.bincount(ds.y_train, minlength=10), torch.bincount(base.y_train, minlength=10))
    hist = torch.stack([torch.bincount(ds.y_train[ds.domain_train == d], minlength=10) for d in range(5)])
    assert (hist.max(0).values - hist.min(0).values).max() <= 1
    hist_te = torch.stack([torch.bincount(ds.y_test[ds.domain_test == d], minlength=10) for d in range(5)])
    assert (hist_te.max(0).values - hist_te.min(0).values).max() <= 1


def test_original_shard_is_disjoint_subset_of_base(base, ds):
    orig = ds.x_train[ds.domain_train == 0][:, 0].reshape(-1, 28 * 28)
    flat = base.x_train[:, 0].reshape(-1, 28 * 28)
    match = torch.cdist(orig, flat).argmin(1)
    assert torch.allclose(flat[match], orig)
    assert len(set(match.tolist())) == len(orig)


def test_caps(base):
    out = make_domains(base, seed=1, samples_per_domain=50, test_per_domain=20)
    assert torch.equal(torch.bincount(out.domain_train), torch.full((5,), 50))
    assert torch.equal(torch.bincount(out.domain_test), torch.full((5,), 20))
    hist = torch.stack([torch.bincount(out.y_train[out.domain_train == d], minlength=10) for d in range(5)])
    assert (hist.max(0).values - hist.min(0).values).max() <= 1
    assert (hist > 0).all()


def test_deterministic_by_seed(base, ds):
    again = make_domains(base, seed=0)
    assert torch.equal(ds.x_train, again.x_train) and torch.equal(ds.y_train, again.y_train)
    assert torch.equal(ds.domain_test, again.domain_test) and torch.equal(ds.x_test, again.x_test)
    other = make_domains(base, seed=1)
    assert not torch.equal(ds.x_train, other.x_train)


def test_original_replicates_grey(base):
    x = base.x_train[:16]
    out = DOMAIN_TRANSFORMS["original"](x, torch.Generator().manual_seed(0))
    assert out.shape == (16, 3, 28, 28)
    assert torch.equal(out, x.expand(-1, 3, -1, -1))


def test_inverted_noise_mean(base):
    x = base.x_train
    out = DOMAIN_TRANSFORMS["inverted_noise"](x, torch.Generator().manual_seed(0))
    assert out.shape == (len(x), 3, 28, 28)
    assert abs(out.mean().item() - (1 - x.mean().item())) < 0.05
    assert not torch.equal(out[:, 0:1], 1 - x)  # noise was added


def test_mnistm_is_abs_patch_minus_x():
    f = DOMAIN_TRANSFORMS["mnistm"]
    zeros, ones = torch.zeros(4, 1, 28, 28), torch.ones(4, 1, 28, 28)
    patch = f(zeros, torch.Generator().manual_seed(3))  # |patch - 0| = patch
    assert patch.shape == (4, 3, 28, 28)
    assert (patch.std(dim=(2, 3)) > 0).all()  # a photo crop, not a flat colour
    assert (patch[:, 0] - patch[:, 1]).abs().max() > 0.05  # it has colour: channels differ
    inv = f(ones, torch.Generator().manual_seed(3))  # same crops: |patch - 1| = 1 - patch
    assert torch.allclose(inv, 1 - patch, atol=1e-6)
    x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    mixed = f(x, torch.Generator().manual_seed(3))
    assert torch.allclose(mixed, (patch - x).abs(), atol=1e-6)


def test_colour_between_fg_and_bg(base):
    x = base.x_train[:32]
    out = DOMAIN_TRANSFORMS["colour"](x, torch.Generator().manual_seed(0))
    ones = DOMAIN_TRANSFORMS["colour"](torch.ones_like(x), torch.Generator().manual_seed(0))
    zeros = DOMAIN_TRANSFORMS["colour"](torch.zeros_like(x), torch.Generator().manual_seed(0))
    fg, bg = ones[:, :, :1, :1], zeros[:, :, :1, :1]  # constant per image
    assert torch.allclose(ones, fg.expand_as(ones)) and torch.allclose(zeros, bg.expand_as(zeros))
    lo, hi = torch.minimum(fg, bg), torch.maximum(fg, bg)
    assert (out >= lo - 1e-6).all() and (out <= hi + 1e-6).all()
    assert torch.allclose(out, x * fg + (1 - x) * bg, atol=1e-6)
    assert (fg.mean(1) > bg.mean(1)).all()  # background darker


def test_lowres_blurs_and_tints(base):
    x = base.x_train[:32]
    out = DOMAIN_TRANSFORMS["lowres"](x, torch.Generator().manual_seed(0))
    assert out.shape == (32, 3, 28, 28) and out.min() >= 0 and out.max() <= 1
    assert (out[:, 0].mean() > out[:, 1].mean() > out[:, 2].mean())  # warm, sepia-like
    tv = lambda t: (t[..., 1:, :] - t[..., :-1, :]).abs().mean()  # noqa: E731
    assert tv(out[:, :1]) < tv(x)


def test_channel_stats_matches_direct(ds):
    stats = channel_stats(ds)
    assert list(stats.columns) == ["domain", "mean_r", "mean_g", "mean_b", "std_r", "std_g", "std_b"]
    assert list(stats["domain"]) == list(DEFAULT_DOMAINS)
    for d, name in enumerate(DEFAULT_DOMAINS):
        x = ds.x_train[ds.domain_train == d].double().numpy()
        row = stats[stats["domain"] == name].iloc[0]
        np.testing.assert_allclose(row[["mean_r", "mean_g", "mean_b"]].to_numpy(float), x.mean((0, 2, 3)), atol=1e-5)
        np.testing.assert_allclose(row[["std_r", "std_g", "std_b"]].to_numpy(float), x.std((0, 2, 3)), atol=1e-5)


def test_errors(base):
    with pytest.raises(ValueError, match="allowed"):
        make_domains(base, domains=("original", "sketch"))
    rgb = Dataset(base.x_train.expand(-1, 3, -1, -1).contiguous(), base.y_train,
                  base.x_test.expand(-1, 3, -1, -1).contiguous(), base.y_test, 10, "rgb")
    with pytest.raises(ValueError, match="1-channel"):
        make_domains(rgb)


def test_subset_of_domains(base):
    out = make_domains(base, domains=["colour", "mnistm"], seed=0, samples_per_domain=100)
    assert out.domains == ["colour", "mnistm"]
    assert torch.equal(torch.bincount(out.domain_train), torch.tensor([100, 100]))


def test_a_domain_dataset_can_be_split_by_label_and_then_names_no_client_domain():
    from fedlab_core.data import federate, load_dataset

    data = load_dataset("fashion_mnist_domains", samples_per_domain=40, test_per_domain=20)
    fed = federate(data, "iid", 4, seed=0)
    assert sum(c.num_train for c in fed.clients) == len(data.y_train)
    assert all(c.domain is None for c in fed.clients)
    assert [c.domain for c in federate(data, "domain", 5, seed=0).clients] == list(data.domains)


def test_ten_domains_are_distinct_styles_of_the_same_images(base):
    out = make_domains(base, domains=TEN_DOMAINS, seed=0, samples_per_domain=60, test_per_domain=20)
    assert out.domains == list(TEN_DOMAINS) and len(set(TEN_DOMAINS)) == 10
    assert torch.equal(torch.bincount(out.domain_train), torch.full((10,), 60))
    x = base.x_train[:64]
    styled = {name: DOMAIN_TRANSFORMS[name](x, torch.Generator().manual_seed(0)) for name in TEN_DOMAINS}
    for name, img in styled.items():
        assert img.shape == (64, 3, 28, 28) and img.min() >= 0 and img.max() <= 1, name
    # every style is its own: pairwise, the domains' mean images differ
    means = torch.stack([img.mean(0).flatten() for img in styled.values()])
    gaps = torch.cdist(means, means) + torch.eye(10) * 1e3
    assert gaps.min() > 0.5
    # each keeps the object: the style's image correlates with the raw image (edges with its gradient)
    for name in ("faded", "stripes", "posterised", "speckle"):
        grey = styled[name].mean(1).flatten(1)
        r = torch.corrcoef(torch.stack([grey.flatten(), x.flatten()]))[0, 1]
        assert abs(r) > 0.5, (name, r)
    assert float(styled["faded"].amax() - styled["faded"].amin()) <= 0.3 + 1e-6  # low contrast
    assert len(torch.unique(styled["posterised"][:, 0])) <= 3  # three levels


def test_the_unused_images_are_the_base_images_no_domain_holds_styled_like_their_domain(base):
    ds = make_domains(base, seed=3, samples_per_domain=60)
    x, y, d = unused_images(base, seed=3, samples_per_domain=60, per_domain=40)
    assert x.shape == (200, 3, 28, 28) and torch.equal(torch.bincount(d), torch.full((5,), 40))
    assert torch.bincount(y[d == 0], minlength=10).min() >= 3                  # class-stratified, like a shard
    grey = lambda t: {tuple(r.tolist()) for r in t[:, 0].flatten(1)}          # the original domain: grey images
    original = x[d == 0]
    assert torch.equal(original[:, 0], original[:, 1]) and not torch.equal(x[d == 2][:, 0], x[d == 2][:, 1])
    assert not grey(original) & grey(ds.x_train[ds.domain_train == 0])       # no domain's image among them
    assert not grey(original) & {tuple(r.tolist()) for r in base.x_test[:, 0].flatten(1)}
    assert grey(original) <= {tuple(r.tolist()) for r in base.x_train[:, 0].flatten(1)}
    # the benchmark itself is untouched, and the pool repeats
    assert torch.equal(make_domains(base, seed=3, samples_per_domain=60).x_train, ds.x_train)
    assert torch.equal(unused_images(base, seed=3, samples_per_domain=60, per_domain=40)[0], x)
    assert len(unused_images(base, seed=3, per_domain=40)[1]) == 0             # no cap: every image is in a domain
