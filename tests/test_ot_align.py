"""OT-based preprocessing: 1-D barycenters and maps, the set-up protocol and its messages, the variants."""
import math

import numpy as np
import ot
import pytest
import torch

from fedlab_core import RunConfig, run
from fedlab_core.algorithms import FedAvg
from fedlab_core.augment import AUGMENTS, OTAlign
from fedlab_core.augment.ot_align import (
    AlignmentCost, alignment_cost, barycenter_1d, channel_histograms, cost_sweep, histogram_distance,
    intensity_support, monotone_map, quantile_average, quantile_points, sinkhorn_map,
)
from fedlab_core.data import load_dataset
from fedlab_core.data.federation import ClientData, Federation
from fedlab_core.engine import Simulation
from fedlab_core.models import build_model

SUPPORT = intensity_support(256)


def _beta_histogram(a: float, b: float, support=SUPPORT) -> torch.Tensor:
    dist = torch.distributions.Beta(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
    p = dist.log_prob(support.clamp(1e-6, 1 - 1e-6)).exp()
    return p / p.sum()


def _images(n: int, channels: int, size: int, a: float, b: float, seed: int) -> torch.Tensor:
    """Images whose pixels are Beta(a, b) draws on the 8-bit grid, (n, C, size, size)."""
    x = torch.from_numpy(np.random.default_rng(seed).beta(a, b, size=(n, channels, size, size)))
    return (x * 255).round().float() / 255


def _federation(xs_train, xs_test) -> Federation:
    clients = []
    for i, (xtr, xte) in enumerate(zip(xs_train, xs_test)):
        clients.append(ClientData(xtr, torch.arange(len(xtr)) % 2, xte, torch.arange(len(xte)) % 2, cid=i))
    x_test = torch.cat(list(xs_test))
    return Federation(clients=clients, x_test=x_test, y_test=torch.arange(len(x_test)) % 2, num_classes=2,
                      input_shape=tuple(x_test.shape[1:]), class_counts=np.array([[len(x) // 2] * 2 for x in xs_train]),
                      scheme="iid", dataset="synthetic")


def _digits() -> torch.Tensor:
    return load_dataset("digits").x_train  # (1347, 1, 8, 8), 17 grey levels in [0, 1]


def _styled_federation(channels: int, n: int = 60) -> tuple[Federation, list]:
    """Three clients hold the same digits under different increasing intensity curves (per channel)."""
    base = _digits()[:n].repeat(1, channels, 1, 1)  # (n, C, 8, 8)
    curves = [lambda x: x, lambda x: x ** 2, lambda x: 0.2 + 0.6 * x ** 0.5]
    styled = []
    for k, curve in enumerate(curves):
        x = base.clone()
        for ch in range(channels):  # each channel its own curve, so RGB channels really differ
            x[:, ch] = curves[(k + ch) % 3](base[:, ch])
        styled.append((x * 255).round() / 255)
    return _federation([x[: n // 2] for x in styled], [x[n // 2:] for x in styled]), styled


# ---------------------------------------------------------------------- 1-D barycenters


def test_histogram_distance_is_pots_wasserstein_1d():
    a, b = _beta_histogram(2, 5), _beta_histogram(4, 3)
    expected = ot.wasserstein_1d(SUPPORT.numpy(), SUPPORT.numpy(), a.numpy(), b.numpy(), p=1)
    assert histogram_distance(a, b, SUPPORT).item() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("solver,tolerance", [("exact", 1e-12), ("debiased", 1e-3), ("entropic", 1.5e-2)])
def test_barycenter_of_identical_histograms_is_that_histogram(solver, tolerance):
    h = _beta_histogram(2, 5)
    bary = barycenter_1d(h[None].repeat(4, 1), SUPPORT, solver, reg=1e-2, num_iter=5000, tol=1e-6)
    assert bary.sum().item() == pytest.approx(1.0, abs=1e-9)
    assert histogram_distance(bary, h, SUPPORT).item() < tolerance
    if solver == "exact":
        assert torch.allclose(bary, h, atol=1e-12)
    # a histogram shifted by 0.1 is 0.1 away: the tolerances above tell a barycenter from a wrong one
    assert histogram_distance(h.roll(26), h, SUPPORT).item() > 0.09


def test_quantile_average_is_the_average_of_quantile_functions():
    g = torch.Generator().manual_seed(0)
    hists = torch.rand(5, 16, generator=g, dtype=torch.float64) ** 4
    hists[:, 3] = 0  # empty levels must be skipped
    hists[2, :8] = 0
    hists /= hists.sum(1, keepdim=True)
    support = intensity_support(16)
    weights = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=torch.float64)
    values, masses = quantile_average(hists, support, weights)
    assert masses.sum().item() == pytest.approx(1.0, abs=1e-12) and (values.diff() >= 0).all()
    # brute force: each quantile function evaluated between consecutive breakpoints, averaged
    cum = hists.cumsum(1).numpy()
    breaks = np.unique(np.concatenate([[0.0, 1.0], cum.ravel()]))
    breaks = breaks[breaks < 1 - 1e-12]  # the last level ends at 1 up to rounding
    breaks = np.append(breaks, 1.0)
    mids = (breaks[1:] + breaks[:-1]) / 2
    quantiles = np.stack([support.numpy()[np.minimum(np.searchsorted(cum[i], mids), 15)] for i in range(5)])
    expected = weights.numpy() @ quantiles
    edges = np.concatenate([[0.0], np.cumsum(masses.numpy())])
    ours = values.numpy()[np.minimum(np.searchsorted(edges, mids, side="right") - 1, len(values) - 1)]
    assert np.abs(ours - expected).max() < 1e-12
    # the exact barycenter's mean is the weighted mean of the means (put back on the support exactly)
    bary = barycenter_1d(hists, support, "exact", weights=weights)
    assert (bary * support).sum().item() == pytest.approx((weights @ (hists @ support)).item(), abs=1e-12)


def test_exact_barycenter_of_shifted_histograms_is_the_middle_shift():
    h = torch.zeros(64, dtype=torch.float64)
    h[5:12] = torch.tensor([1, 3, 6, 7, 6, 3, 1], dtype=torch.float64)
    h /= h.sum()
    support = intensity_support(64)
    bary = barycenter_1d(torch.stack([h, h.roll(20)]), support, "exact")
    assert torch.allclose(bary, h.roll(10), atol=1e-12)
    mixture = (h + h.roll(20)) / 2  # the Euclidean average is a different thing: two bumps
    assert histogram_distance(mixture, bary, support).item() > 0.07


def test_entropic_barycenter_approximates_the_exact_one_and_improves_as_reg_shrinks():
    hists = torch.stack([_beta_histogram(2, 5), _beta_histogram(5, 2), _beta_histogram(3, 3), _beta_histogram(8, 8)])
    exact = barycenter_1d(hists, SUPPORT, "exact")
    gaps = {reg: histogram_distance(barycenter_1d(hists, SUPPORT, "entropic", reg=reg, num_iter=5000, tol=1e-6),
                                    exact, SUPPORT).item() for reg in (1e-2, 1e-3)}
    assert gaps[1e-3] < 2e-3 < gaps[1e-2] < 1.5e-2
    assert histogram_distance(hists.mean(0), exact, SUPPORT).item() > 0.04  # not the mixture
    debiased = barycenter_1d(hists, SUPPORT, "debiased", reg=1e-2, num_iter=5000, tol=1e-6)
    assert histogram_distance(debiased, exact, SUPPORT).item() < 1e-3


def test_monotone_map_sends_each_histogram_onto_the_target_and_keeps_order():
    g = torch.Generator().manual_seed(1)
    source = torch.rand(3, 256, generator=g, dtype=torch.float64) ** 3
    source[:, 100:140] = 0
    source /= source.sum(1, keepdim=True)
    target = _beta_histogram(6, 2)
    table = monotone_map(source, target, SUPPORT)  # (3, 256)
    occupied = source > 0
    for i in range(3):
        values = table[i][occupied[i]]
        assert (values.diff() >= 0).all()  # order kept
        # pushing the source through the map gives the target, up to one level of rounding
        mapped = torch.zeros(256, dtype=torch.float64).index_add_(
            0, (values * 255).round().long(), source[i][occupied[i]])
        assert histogram_distance(mapped, target, SUPPORT).item() < 1 / 255
    # every level's value is the mean of the target over its share of mass: the means agree
    assert torch.allclose((table * source).sum(1), (target * SUPPORT).sum().expand(3), atol=1e-12)


# ---------------------------------------------------------------------- the protocol


@pytest.mark.parametrize("channels", [1, 3])
def test_alignment_brings_every_image_to_the_target(channels):
    fed, _ = _styled_federation(channels)
    aug = OTAlign(solver="exact")
    aligned, _, _ = aug.setup(fed, 0)
    support = SUPPORT.numpy()

    def distance_to_target(x):  # mean over images and channels of POT's W1 to the target
        hists = channel_histograms(x, 256)  # (N, C, B)
        return np.mean([ot.wasserstein_1d(support, support, hists[i, ch].numpy(), aug.target[ch].double().numpy())
                        for i in range(len(x)) for ch in range(channels)])

    for before, after in zip(fed.clients, aligned.clients):
        for name in ("x_train", "x_test"):
            d_before, d_after = distance_to_target(getattr(before, name)), distance_to_target(getattr(after, name))
            assert d_after < 0.25 * d_before and d_after < 0.02
    assert aligned.x_test is fed.x_test  # the global test set belongs to no client: left as it is


@pytest.mark.parametrize("cdf", ["image", "client"])
def test_alignment_undoes_a_clients_increasing_intensity_curve(cdf):
    # the three clients hold the same images under different increasing curves: once each is mapped
    # onto the shared target, the copies coincide (quantile maps ignore increasing transforms)
    fed, styled = _styled_federation(3)
    aligned, _, _ = OTAlign(solver="exact", cdf=cdf).setup(fed, 0)
    reference = aligned.clients[0]
    raw_gap = (styled[1] - styled[0]).abs().mean().item()
    for other in aligned.clients[1:]:
        for name in ("x_train", "x_test"):
            gap = (getattr(other, name) - getattr(reference, name)).abs().max().item()
            assert gap < 1e-6, (cdf, name, gap)
    assert raw_gap > 0.05


def test_projection_onto_a_clients_own_barycenter_changes_its_images_little():
    # 32x32 images of i.i.d. Beta(2, 5) pixels: each image's histogram is the client's barycenter up to
    # sampling noise, so mapping onto it moves pixels by that noise only (plus the entropic blur)
    x = _images(100, 1, 32, 2.0, 5.0, seed=0)
    other = _images(100, 1, 32, 5.0, 2.0, seed=1)
    for solver, bound in (("exact", 0.008), ("debiased", 0.008), ("entropic", 0.02)):
        aug = OTAlign(solver=solver)
        own, _, _ = aug.setup(_federation([x], [x[:10]]), 0)
        change = (own.clients[0].x_train - x).abs().mean().item()
        assert change < bound, (solver, change)
        mixed, _, _ = OTAlign(solver=solver).setup(_federation([x, other], [x[:10], other[:10]]), 0)
        assert (mixed.clients[0].x_train - x).abs().mean().item() > 0.2  # a shared target moves them far


@pytest.mark.parametrize("variant,shape", [("sound", lambda c, p: (c, 256)), ("channel", lambda c, p: (c, 256)),
                                           ("joint", lambda c, p: (p, c)),
                                           ("paper-code", lambda c, p: (c, p))])
@pytest.mark.parametrize("channels", [1, 3])
def test_the_server_receives_only_barycenters_and_their_bytes_are_counted(variant, shape, channels):
    fed, _ = _styled_federation(channels, n=16)
    pixels = 20
    aug = OTAlign(variant=variant, pixels=None if variant == "sound" else pixels, num_iter=50)
    aligned, up, down = aug.setup(fed, 0)
    assert len(up) == len(down) == 3
    for m in up + down:
        assert list(m.tensors) == ["barycenter"] and m.num_samples == 0 and not m.metrics
        assert tuple(m.tensors["barycenter"].shape) == shape(channels, pixels)
        assert m.tensors["barycenter"].dtype == torch.float32
        assert m.nbytes == 4 * math.prod(shape(channels, pixels))
    # the target is computed from the uploads alone
    again = aug.server_barycenter(torch.stack([m.tensors["barycenter"] for m in up]), 0)
    assert torch.allclose(again.float(), aug.target)
    assert all(torch.equal(m.tensors["barycenter"], aug.target) for m in down)
    for before, after in zip(fed.clients, aligned.clients):
        assert after.x_train.shape == before.x_train.shape and after.x_test.shape == before.x_test.shape
        assert torch.isfinite(after.x_train).all() and not torch.equal(after.x_train, before.x_train)
    torch.manual_seed(0)
    sim = Simulation(FedAvg(), fed, build_model("mlp", fed.input_shape, 2), seed=0, num_rounds=1,
                     augment=OTAlign(variant=variant, pixels=None if variant == "sound" else pixels, num_iter=50),
                     progress=False)
    assert sim.initial_state().setup_bytes == (sum(m.nbytes for m in up), sum(m.nbytes for m in down))


def test_same_seed_same_output_and_the_seed_matters_where_pixels_are_sampled():
    fed, _ = _styled_federation(3, n=12)
    for params in ({}, {"pixels": 30}, {"variant": "joint", "pixels": 15, "num_iter": 20},
                   {"variant": "paper-code", "pixels": 15}):
        a, up_a, _ = OTAlign(**params).setup(fed, 3)
        b, up_b, _ = OTAlign(**params).setup(fed, 3)
        c, _, _ = OTAlign(**params).setup(fed, 4)
        assert all(torch.equal(x.tensors["barycenter"], y.tensors["barycenter"]) for x, y in zip(up_a, up_b))
        assert all(torch.equal(x.x_train, y.x_train) and torch.equal(x.x_test, y.x_test)
                   for x, y in zip(a.clients, b.clients))
        differs = any(not torch.equal(x.x_train, y.x_train) for x, y in zip(a.clients, c.clients))
        assert differs == bool(params), params  # all pixels and all images: nothing is drawn


def test_align_maps_new_images_as_a_client_would():
    fed, _ = _styled_federation(1)
    for cdf in ("image", "client"):
        aug = OTAlign(solver="exact", cdf=cdf)
        aligned, _, _ = aug.setup(fed, 0)
        for c in aligned.clients:
            assert torch.equal(aug.align(fed.clients[c.cid].x_test, cid=c.cid), c.x_test)
    with pytest.raises(RuntimeError, match="setup"):
        OTAlign().align(fed.x_test)


@pytest.mark.parametrize("variant,cdf", [("sound", "image"), ("sound", "client"), ("channel", "image")])
def test_a_monitored_validation_set_is_mapped_as_the_clients_test_set(variant, cdf):
    # the convergence test reads x_val: a run on aligned images must be validated on aligned images, and holding
    # a validation set must not change how any other image is mapped
    from dataclasses import replace

    fed, styled = _styled_federation(1)
    held = replace(fed, clients=[replace(c, x_val=styled[c.cid][:10], y_val=torch.arange(10) % 2) for c in fed.clients])
    params = dict(variant=variant, pixels=20) if variant == "channel" else dict(variant=variant, cdf=cdf, solver="exact")
    plain, _, _ = OTAlign(**params).setup(fed, 0)
    aug = OTAlign(**params)
    aligned, _, _ = aug.setup(held, 0)
    for before, without, c in zip(held.clients, plain.clients, aligned.clients):
        assert torch.equal(c.x_train, without.x_train) and torch.equal(c.x_test, without.x_test)
        assert not torch.equal(c.x_val, before.x_val)   # mapped, not left raw
        if variant == "sound":                          # deterministic maps: exactly the client's own
            assert torch.equal(c.x_val, aug.align(before.x_val, cid=c.cid))
    with pytest.raises(ValueError, match="validation images"):
        bad = replace(held, clients=[replace(held.clients[0], x_val=held.clients[0].x_val * 2), *held.clients[1:]])
        OTAlign(**params).setup(bad, 0)


def test_client_cdf_uses_one_map_per_client_for_train_and_test():
    fed, _ = _styled_federation(1)
    aug = OTAlign(cdf="client")
    aligned, _, _ = aug.setup(fed, 0)
    for before, after in zip(fed.clients, aligned.clients):
        x = torch.cat([before.x_train, before.x_test]).flatten()
        y = torch.cat([after.x_train, after.x_test]).flatten()
        for level in x.unique():
            assert y[x == level].unique().numel() == 1  # one value per input level, train and test alike


def test_bad_parameters_and_inputs_raise_clear_errors():
    for params, match in (({"variant": "colour"}, "variant"), ({"solver": "lp"}, "solver"), ({"bins": 1}, "bins"),
                          ({"pixels": 0}, "pixels"), ({"reg": 0.0}, "reg"), ({"reg": float("nan")}, "reg"),
                          ({"reg_map": -1.0}, "reg_map"), ({"tol": 0}, "tol"), ({"num_iter": 0}, "num_iter"),
                          ({"max_images": -1}, "max_images"), ({"cdf": "pooled"}, "cdf"),
                          ({"out_of_sample_map": "nearest"}, "out_of_sample_map"),
                          ({"variant": "joint", "solver": "exact"}, "sound and channel variants"),
                          ({"variant": "paper-code", "cdf": "client"}, "sound variant")):
        with pytest.raises(ValueError, match=match):
            OTAlign(**params)
    fed, _ = _styled_federation(1, n=8)
    fed.clients[0].x_train = fed.clients[0].x_train * 2 - 1  # normalised to [-1, 1]: not intensities
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        OTAlign().setup(fed, 0)
    with pytest.raises(ValueError, match="augment_params: 'ot_align' has no parameter 'epsilon'"):
        RunConfig(augment="ot_align", augment_params={"epsilon": 1})
    assert AUGMENTS["ot_align"] is OTAlign


# ---------------------------------------------------------------------- the paper's colour readings


def test_sinkhorn_map_is_pinned_to_the_nearest_sample_map():
    g = torch.Generator().manual_seed(0)
    sample = torch.rand(12, 3, generator=g, dtype=torch.float64).numpy()
    target = torch.rand(9, 3, generator=g, dtype=torch.float64).numpy()
    image = np.concatenate([sample[:4], sample[:4] + 0.01])  # 4 sample points, then slightly moved copies
    out = sinkhorn_map(image, sample, target, reg_map=0.1, map_iter=1000, out_of_sample_map="ferradans")
    plan = ot.sinkhorn(np.full(12, 1 / 12), np.full(9, 1 / 9), ot.dist(sample, target), 0.1, method="sinkhorn")
    moved = (plan / plan.sum(1, keepdims=True)) @ target  # where each fitted sample goes
    assert np.allclose(out[:4], moved[:4], atol=1e-6)
    assert np.allclose(out[4:], moved[:4] + 0.01, atol=1e-6)  # nearest sample's image plus the offset
    smooth = sinkhorn_map(image, sample, target, 0.1, 1000, "continuous")
    assert not np.allclose(smooth[4:], out[4:], atol=1e-3)


def test_quantile_points_stand_for_a_histogram_with_equal_weights():
    support = torch.linspace(0, 1, 5)  # 0, .25, .5, .75, 1
    hists = torch.tensor([[0.5, 0.0, 0.0, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0, 0.0]])
    points = quantile_points(hists, support, 4)  # quantiles at 1/8, 3/8, 5/8, 7/8
    assert torch.equal(points, torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64))


def test_channel_variant_maps_each_channel_on_its_own_with_the_papers_entropic_map():
    fed, _ = _styled_federation(3, n=10)
    aug = OTAlign(variant="channel", pixels=40, num_iter=100)
    assert (aug.pixels, aug.reg_map) == (40, 0.1)
    aligned, _, _ = aug.setup(fed, 0)
    x = fed.clients[0].x_train[:4]
    one = aug.align(x, seed=5)
    other = x.clone()
    other[:, 1] = 1 - other[:, 1]  # change channel 1 only
    two = aug.align(other, seed=5)
    assert torch.allclose(one[:, 0], two[:, 0]) and torch.allclose(one[:, 2], two[:, 2])
    assert not torch.allclose(one[:, 1], two[:, 1])
    # the entropic map at reg 0.1 pulls values towards the target's mean: contrast shrinks, order stays
    for i in range(4):
        a, b = x[i, 0].flatten(), one[i, 0].flatten()
        assert b.std() < a.std()
        assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.9
    assert OTAlign(variant="channel", solver="exact").solver == "exact"  # its barycenters are the sound ones


def test_paper_code_variant_erases_the_images_and_joint_colour_keeps_them():
    fed, _ = _styled_federation(3, n=16)
    x = torch.cat([c.x_train for c in fed.clients])
    for variant in ("paper-code", "joint"):
        aug = OTAlign(variant=variant, pixels=50, num_iter=30)
        aligned, _, _ = aug.setup(fed, 0)
        y = torch.cat([c.x_train for c in aligned.clients])
        spread = y.flatten(1).std(1).mean() / x.flatten(1).std(1).mean()  # per-image contrast kept
        if variant == "paper-code":
            # the target "colours" are probabilities over 50 sample positions: about 1/50 each
            assert aug.target.min() > 0.2 / 50 and aug.target.max() < 5 / 50
            assert spread < 0.1
        else:
            assert spread > 0.5
            corr = [torch.corrcoef(torch.stack([a, b]))[0, 1] for a, b in zip(x.flatten(1), y.flatten(1))]
            assert torch.stack(corr).median() > 0.8
    aug = OTAlign(variant="paper-code", pixels=50, out_of_sample_map="continuous")
    aligned, _, _ = aug.setup(fed, 0)
    y = torch.cat([c.x_train for c in aligned.clients])
    assert (y - 1 / 50).abs().max() < 1e-3  # every pixel of every image lands on the same value


# ---------------------------------------------------------------------- end to end and cost


def test_fedavg_with_ot_align_through_run_config(tiny):
    config = tiny.replace(augment="ot_align", num_rounds=5)
    history = run(config, use_cache=False, progress=False)
    assert history.meta["setup_bytes"] == [4 * 256 * 4, 4 * 256 * 4]  # four clients, one (1, 256) float32 each way
    assert history.final["mean_client_accuracy"] > 0.6 and history.final["global_accuracy"] > 0.6
    assert history.rounds[0]["bytes_up"] > history.rounds[1]["bytes_up"]  # the set-up is charged to round 1


def test_alignment_cost_times_every_stage():
    x = _images(40, 1, 8, 2.0, 5.0, seed=0)
    cost = alignment_cost(x, images_per_client=30, num_clients=3, solver="exact")
    assert isinstance(cost, AlignmentCost)
    assert len(cost.client_barycenter) == len(cost.projection) == 3
    assert all(t > 0 for t in cost.client_barycenter + cost.projection) and cost.server_barycenter > 0
    assert cost.parallel <= cost.total


def test_a_cost_sweep_times_every_point_of_every_repeat_and_refuses_no_repeats():
    x = _images(40, 1, 8, 2.0, 5.0, seed=0)
    points = [(10, {"solver": "exact"}), (20, {"variant": "channel", "pixels": 16})]
    seconds = cost_sweep(x, points, repeats=2)
    assert seconds.shape == (2, 2, 2) and (seconds > 0).all()
    with pytest.raises(ValueError, match="^repeats: must be >= 1"):
        cost_sweep(x, points, repeats=0)


def test_exact_barycenter_of_a_hand_computed_case():
    # levels 0, 1/2, 1; a holds {0, 1/2} and b {1/2, 1} in halves: their quantile functions are 0 then 1/2, and
    # 1/2 then 1, whose average is 1/4 then 3/4; put back on the levels, each atom splits evenly between its two
    # neighbours: masses 1/4, 1/2, 1/4. Point masses at 0 and 1 meet at 1/2.
    support = intensity_support(3)
    halves = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]], dtype=torch.float64)
    assert torch.allclose(barycenter_1d(halves, support, "exact"), torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64))
    ends = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    assert torch.allclose(barycenter_1d(ends, support, "exact"), torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))


def _dark_images(n: int, seed: int) -> torch.Tensor:
    """Fashion-MNIST-like images: a black background (about 60% of the pixels at 0) and a bright object."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, 1, 12, 12)
    brightness = 0.4 + 0.5 * torch.rand(n, 1, 1, 1, generator=g)
    x[:, :, 3:10, 3:10] = (brightness + 0.1 * torch.rand(n, 1, 7, 7, generator=g)).clamp(0, 1)
    return (x * 255).round() / 255


def test_the_sound_default_is_the_exact_barycenter_and_keeps_backgrounds_black():
    # The entropic barycenter at the paper's reg smears the mass at level 0 over its neighbours: aligned
    # backgrounds turn grey. The exact barycenter (the default) keeps the black mass and black pixels.
    xs = [_dark_images(40, s) for s in (0, 1)]
    fed = _federation(xs, [x[:5] for x in xs])
    exact = OTAlign()
    assert exact.solver == "exact"
    aligned, _, _ = exact.setup(fed, 0)
    entropic = OTAlign(solver="entropic")
    blurred, _, _ = entropic.setup(fed, 0)
    black = 1 - 49 / 144  # the share of background pixels
    assert exact.target[0, 0].item() == pytest.approx(black, abs=0.02)
    assert entropic.target[0, 0].item() < black / 3
    background = xs[0][:, :, 0, 0]  # a corner pixel: background in every image
    assert aligned.clients[0].x_train[:, :, 0, 0].max().item() < 1e-6
    assert blurred.clients[0].x_train[:, :, 0, 0].min().item() > 0.01
    assert background.max().item() == 0.0


def test_variant_defaults_pin_the_map_and_solver_each_source_ran():
    assert OTAlign(variant="channel").solver == "entropic"  # the paper's literal barycenter
    assert OTAlign(variant="channel").out_of_sample_map == "ferradans"
    assert OTAlign(variant="joint").out_of_sample_map == "ferradans"
    assert OTAlign(variant="paper-code").out_of_sample_map == "continuous"  # POT 0.9.5's default, the code's pin
    with pytest.raises(ValueError, match="out_of_sample_map belongs"):
        OTAlign(out_of_sample_map="continuous")


def test_paper_code_default_is_what_pot_0_9_5_runs_and_the_older_map_differs():
    xs = [_images(6, 1, 8, 2, 5, seed=s) for s in (0, 1)]
    fed = _federation(xs, [x[:2] for x in xs])
    code, _, _ = OTAlign(variant="paper-code", pixels=30).setup(fed, 0)
    older, _, _ = OTAlign(variant="paper-code", pixels=30, out_of_sample_map="ferradans").setup(fed, 0)
    assert not torch.allclose(code.clients[0].x_train, older.clients[0].x_train)


def test_cleaned_code_options_each_change_the_barycenters_or_the_aligned_images():
    from fedlab_core.augment.ot_align import CLEANED_CODE, pixel_positions

    # without replacement, an image's positions are distinct; with, 64 draws of 64 positions repeat some
    g = torch.Generator().manual_seed(0)
    assert all(len(set(row.tolist())) == 64 for row in pixel_positions(5, 64, 64, g, replace=False)[:, 0])
    assert any(len(set(row.tolist())) < 64 for row in pixel_positions(5, 64, 64, g, replace=True)[:, 0])
    with pytest.raises(ValueError, match="without replacement"):
        pixel_positions(1, 64, 65, g, replace=False)
    xs = [_images(6, 1, 8, 2, 5, seed=s) for s in (0, 1)]
    fed = _federation(xs, [x[:2] for x in xs])
    base = OTAlign(variant="paper-code", pixels=30)
    base_fed, _, _ = base.setup(fed, 0)
    for change in ({"barycenter_pixels": 60}, {"barycenter_replace": False}, {"reg_server": 0.1},
                   {"reg_map": 0.01}):
        aug = OTAlign(variant="paper-code", pixels=30, **change)
        out, _, _ = aug.setup(fed, 0)
        moved_target = aug.target.shape != base.target.shape or not torch.allclose(aug.target, base.target)
        assert moved_target or not torch.allclose(out.clients[0].x_train, base_fed.clients[0].x_train), change
    assert OTAlign(variant="paper-code", **{**CLEANED_CODE, "barycenter_pixels": 50}).barycenter_pixels == 50
    # the server's regularisation reaches the sound/channel server barycenter too
    hists = torch.stack([_beta_histogram(2, 5), _beta_histogram(5, 2)])
    a = OTAlign(variant="channel").server_barycenter(hists[:, None].float())
    b = OTAlign(variant="channel", reg_server=0.1).server_barycenter(hists[:, None].float())
    assert histogram_distance(a[0], b[0], SUPPORT).item() > 1e-3
