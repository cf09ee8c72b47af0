"""The baseline augmentations mixup, AdvProp, NaiveMix and conventional normalisation: their output on fixed
batches by hand, their set-up exchanges and bytes, and FedAvg + each one learning the digits task."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlab_core.algorithms import FedAvg, Training
from fedlab_core.augment.advprop import AdvProp, DualBatchNorm
from fedlab_core.augment.mixup import Mixup, draw_beta
from fedlab_core.augment.naivemix import NaiveMix, mean_batches
from fedlab_core.augment.normalize import Normalize
from fedlab_core.data import federate, load_dataset
from fedlab_core.data.federation import ClientData, Federation
from fedlab_core.engine import Simulation
from fedlab_core.models import build_model


class SmallBN(nn.Module):
    """A conv net with batch norm for 8x8 digits, to exercise AdvProp's auxiliary BN."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8 * 64, 10)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def _digits(scheme="iid"):
    return federate(load_dataset("digits"), scheme, 4, seed=0)


def _toy_federation(sizes=(7, 12), channels=3, num_classes=4):
    """Random 3-channel 2x2 images with values far from standardised, split over clients."""
    g = torch.Generator().manual_seed(0)
    clients = []
    for cid, n in enumerate(sizes):
        x = 3.0 + 2.0 * torch.rand(n, channels, 2, 2, generator=g) * torch.arange(1, channels + 1).view(1, -1, 1, 1)
        y = torch.randint(num_classes, (n,), generator=g)
        clients.append(ClientData(x, y, x[:2], y[:2], cid))
    return Federation(clients, torch.cat([c.x_test for c in clients]), torch.cat([c.y_test for c in clients]),
                      num_classes, (channels, 2, 2), np.zeros((len(sizes), num_classes)), "toy", "toy")


def _batch(n=16):
    data = _digits().clients[0]
    return data.x_train[:n], data.y_train[:n]


# ---------------------------------------------------------------------- mixup


def test_mixup_batch_is_the_convex_combination_of_a_permuted_batch():
    x, y = _batch()
    aug = Mixup(alpha=0.2)
    aug.setup(_digits(), 0)
    xm, ym = aug.train_batch(None, x, y, 0, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    lam = draw_beta(0.2, g)
    perm = torch.randperm(len(x), generator=g)
    assert sorted(perm.tolist()) == list(range(len(x))) and 0 < lam < 1
    assert torch.allclose(xm, lam * x + (1 - lam) * x[perm])
    for i in range(len(x)):
        expected = torch.zeros(10)
        expected[y[i]] += lam
        expected[y[perm[i]]] += 1 - lam
        assert torch.allclose(ym[i], expected)
    # soft-target cross-entropy is the paper's lam CE(y) + (1 - lam) CE(y[perm])
    logits = torch.randn(len(x), 10, generator=g)
    assert torch.allclose(F.cross_entropy(logits, ym),
                          lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm]))
    assert torch.equal(aug.eval_input(x, 0), x)


def test_mixup_weights_follow_beta_alpha_alpha():
    g = torch.Generator().manual_seed(0)
    lams = np.array([draw_beta(0.2, g) for _ in range(4000)])
    assert abs(lams.mean() - 0.5) < 0.03
    assert abs(lams.var() - 1 / (4 * (2 * 0.2 + 1))) < 0.01  # Var Beta(a, a) = 1 / (4 (2a + 1))
    x, y = _batch()
    aug = Mixup(alpha=0.0)
    aug.setup(_digits(), 0)
    xm, ym = aug.train_batch(None, x, y, 0, g)
    assert torch.equal(xm, x) and torch.equal(ym, F.one_hot(y, 10).float())


# ---------------------------------------------------------------------- AdvProp


def test_dual_bn_normalises_each_half_with_its_own_statistics():
    torch.manual_seed(0)
    dual = DualBatchNorm(nn.BatchNorm1d(3))
    clean, adv = torch.randn(4, 3), 5 + 3 * torch.randn(4, 3)
    dual.train()
    dual.split_at = 4
    out = dual(torch.cat([clean, adv]))

    def by_hand(h):
        return (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5)

    assert torch.allclose(out[:4], by_hand(clean), atol=1e-5)
    assert torch.allclose(out[4:], by_hand(adv), atol=1e-5)
    assert torch.allclose(dual.main_bn.running_mean, 0.1 * clean.mean(0))
    assert torch.allclose(dual.aux_bn.running_mean, 0.1 * adv.mean(0))
    assert dual(clean).shape == (4, 3) and torch.allclose(dual.main_bn.running_mean, 0.19 * clean.mean(0))
    dual.eval()  # evaluation uses the main BN's running statistics, whatever the batch
    x = torch.randn(8, 3)
    main = dual.main_bn
    expected = (x - main.running_mean) / torch.sqrt(main.running_var + 1e-5)
    assert torch.allclose(dual(x), expected, atol=1e-5)


def test_prepare_model_swaps_every_bn_once_with_distinct_names():
    model = AdvProp().prepare_model(SmallBN())
    keys = model.state_dict().keys()
    assert "conv.1.main_bn.running_mean" in keys and "conv.1.aux_bn.running_mean" in keys
    assert not any(isinstance(m, nn.BatchNorm2d) and not isinstance(p, DualBatchNorm)
                   for p in model.modules() for m in p.children())
    again = AdvProp().prepare_model(model)
    assert list(again.state_dict().keys()) == list(keys)


def test_adversarial_half_is_the_signed_gradient_step_within_epsilon():
    x, y = _batch()
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    model.train()
    aug = AdvProp(epsilon=4 / 255)
    xb, yb = aug.train_batch(model, x, y, 0, torch.Generator().manual_seed(0))
    assert xb.shape == (2 * len(x), 1, 8, 8) and torch.equal(yb, torch.cat([y, y]))
    assert torch.equal(xb[:len(x)], x)
    x_adv = xb[len(x):]
    assert (x_adv - x).abs().max() <= 4 / 255 + 1e-6 and not torch.equal(x_adv, x)
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    probe = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(F.cross_entropy(model(probe), y), probe)
    assert torch.allclose(x_adv, (x + 4 / 255 * grad.sign()).clamp(0, 1))
    assert all(p.grad is None for p in model.parameters())  # only the inputs were differentiated
    assert F.cross_entropy(model(x_adv), y) > F.cross_entropy(model(x), y)


def test_pgd_with_random_start_stays_in_the_ball():
    x, y = _batch()
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10)
    aug = AdvProp(epsilon=8 / 255, steps=3, step_size=2 / 255, random_start=True, clip=None)
    x_adv = aug.attack(model, x, y, torch.Generator().manual_seed(1))
    assert (x_adv - x).abs().max() <= 8 / 255 + 1e-6 and not torch.equal(x_adv, x)


def test_on_a_bn_model_the_adversarial_half_moves_only_the_auxiliary_statistics():
    x, y = _batch()
    torch.manual_seed(0)
    plain = SmallBN()
    reference = copy.deepcopy(plain)
    aug = AdvProp(epsilon=8 / 255)
    model = aug.prepare_model(plain)
    model.train()
    reference.train()
    xb, yb = aug.train_batch(model, x, y, 0, torch.Generator().manual_seed(0))
    logits = model(xb)  # the training forward: [clean; adversarial]
    clean_logits = reference(x)  # a plain BN that only ever saw the clean batch
    dual, bn = model.conv[1], reference.conv[1]
    assert torch.allclose(dual.main_bn.running_mean, bn.running_mean, atol=1e-6)
    assert torch.allclose(dual.main_bn.running_var, bn.running_var, atol=1e-6)
    assert int(dual.main_bn.num_batches_tracked) == 1
    assert dual.aux_bn.running_mean.abs().sum() > 0 and int(dual.aux_bn.num_batches_tracked) == 2  # attack + step
    assert not torch.allclose(dual.aux_bn.running_mean, dual.main_bn.running_mean)
    assert torch.allclose(logits[:len(x)], clean_logits, atol=1e-5)  # clean half: as without AdvProp
    model.eval()
    reference.eval()
    assert torch.allclose(model(x), reference(x), atol=1e-5)  # eval: the main BN


# ---------------------------------------------------------------------- NaiveMix


def test_mean_batches_are_the_means_of_disjoint_groups():
    n, m = 11, 3
    x = (2.0 ** torch.arange(n)).view(n, 1, 1, 1)   # each subset of images has a unique sum
    y = torch.arange(n) % 4
    images, labels = mean_batches(x, y, 4, m, torch.Generator().manual_seed(0))
    assert images.shape == (n // m, 1, 1, 1) and labels.shape == (n // m, 4)
    seen = set()
    for img, lab in zip(images, labels):
        bits = int(round(float(img) * m))
        members = [i for i in range(n) if bits >> i & 1]
        assert len(members) == m and not seen & set(members)
        seen |= set(members)
        assert torch.allclose(img, x[members].mean(0))
        assert torch.allclose(lab, F.one_hot(y[members], 4).float().mean(0))
    few, few_labels = mean_batches(x[:2], y[:2], 4, m, torch.Generator().manual_seed(0))
    assert torch.allclose(few[0], x[:2].mean(0)) and torch.allclose(few_labels[0], F.one_hot(y[:2], 4).float().mean(0))


def test_naivemix_setup_shares_the_pool_and_its_bytes_are_counted():
    fed = _digits()
    aug = NaiveMix(mean_batch_size=10)
    _, up, down = aug.setup(fed, 0)
    groups = [c.num_train // 10 for c in fed.clients]
    per_group = 4 * (64 + 10)  # one 8x8 image and one 10-class label, float32
    assert [m.nbytes for m in up] == [g * per_group for g in groups]
    assert [m.nbytes for m in down] == [sum(groups) * per_group] * 4
    assert aug.pool_x.shape == (sum(groups), 1, 8, 8)
    assert torch.allclose(aug.pool_y.sum(1), torch.ones(sum(groups)))
    torch.manual_seed(0)
    sim = Simulation(FedAvg(), fed, build_model("mlp", fed.input_shape, 10), seed=0, num_rounds=1,
                     augment=NaiveMix(), progress=False)
    assert sim.initial_state().setup_bytes == (sum(groups) * per_group, 4 * sum(groups) * per_group)
    _, up_again, _ = NaiveMix().setup(fed, 0)
    assert all(torch.equal(a.tensors["images"], b.tensors["images"]) for a, b in zip(up, up_again))


def test_naivemix_mixes_each_image_with_the_shared_pool():
    x, y = _batch()
    aug = NaiveMix(lam=0.05)
    aug.setup(_digits(), 0)
    xm, ym = aug.train_batch(None, x, y, 0, torch.Generator().manual_seed(3))
    pick = torch.randint(len(aug.pool_x), (len(x),), generator=torch.Generator().manual_seed(3))
    assert torch.allclose(xm, 0.95 * x + 0.05 * aug.pool_x[pick])
    assert torch.allclose(ym, 0.95 * F.one_hot(y, 10).float() + 0.05 * aug.pool_y[pick])
    assert torch.allclose(ym.sum(1), torch.ones(len(x)))
    assert torch.equal(aug.eval_input(x, 0), x)


# ---------------------------------------------------------------------- normalisation


def test_normalize_uses_the_statistics_of_the_union_of_the_clients():
    fed = _toy_federation()
    aug = Normalize()
    _, up, down = aug.setup(fed, 0)
    union = torch.cat([c.x_train for c in fed.clients]).double()
    assert torch.allclose(aug.mean.double(), union.mean((0, 2, 3)), atol=1e-5)
    assert torch.allclose(aug.std.double(), union.std((0, 2, 3), unbiased=False), atol=1e-5)
    z = torch.cat([aug.train_batch(None, c.x_train, c.y_train, c.cid, None)[0] for c in fed.clients])
    assert torch.allclose(z.mean((0, 2, 3)), torch.zeros(3), atol=1e-5)
    assert torch.allclose(z.std((0, 2, 3), unbiased=False), torch.ones(3), atol=1e-5)
    assert [m.nbytes for m in up] == [3 * 3 * 8] * 2 and [m.nbytes for m in down] == [2 * 3 * 4] * 2


def test_normalize_with_given_statistics_on_a_fixed_batch():
    x = torch.arange(8.0).view(1, 2, 2, 2)
    aug = Normalize(mean=[1.0, 5.0], std=[2.0, 0.5])
    fed, up, down = aug.setup(_toy_federation(channels=2), 0)
    assert up == [] and down == []
    expected = torch.tensor([[[-0.5, 0.0], [0.5, 1.0]], [[-2.0, 0.0], [2.0, 4.0]]]).unsqueeze(0)
    y = torch.zeros(1, dtype=torch.long)
    assert torch.equal(aug.train_batch(None, x, y, 0, None)[0], expected)
    assert torch.equal(aug.eval_input(x, None), expected)
    with pytest.raises(ValueError):
        Normalize(mean=[0.5])
    with pytest.raises(ValueError, match="'normalize' parameter 'mean' has 2 values, but the images have 3 channel"):
        Normalize(mean=[1.0, 5.0], std=[2.0, 0.5]).setup(_toy_federation(channels=3), 0)
    with pytest.raises(ValueError, match="'normalize' parameter 'std' must be"):
        Normalize(mean=0.5, std="wide")


# ---------------------------------------------------------------------- behaviour


def _run(augment, make_model=None, num_rounds=5):
    fed = _digits()
    torch.manual_seed(0)
    model = make_model() if make_model else build_model("mlp", fed.input_shape, 10)
    sim = Simulation(FedAvg(Training(lr=0.1)), fed, model, seed=0, num_rounds=num_rounds, augment=augment,
                     progress=False)
    return sim.run().rows


@pytest.mark.parametrize("make", [lambda: (Mixup(), None), lambda: (AdvProp(epsilon=8 / 255), SmallBN),
                                  lambda: (NaiveMix(), None), lambda: (Normalize(), None)],
                         ids=["mixup", "advprop-bn", "naivemix", "normalize"])
def test_fedavg_with_each_augmentation_learns_digits(make):
    augment, make_model = make()
    rows = _run(augment, make_model)
    assert rows[-1]["global_accuracy"] > 0.6


def test_advprop_refuses_a_model_without_batch_norm():
    # with nothing to route, AdvProp would silently be plain adversarial training
    with pytest.raises(ValueError, match="'advprop' .* MLP has no batch-norm layer; use a model that has one"):
        _run(AdvProp(), None, num_rounds=1)


def test_augmented_runs_are_deterministic():
    for make, make_model in ((lambda: Mixup(), None), (lambda: AdvProp(epsilon=8 / 255), SmallBN),
                             (lambda: NaiveMix(), None)):
        a, b = _run(make(), make_model, num_rounds=2), _run(make(), make_model, num_rounds=2)
        assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
        assert [r["global_accuracy"] for r in a] == [r["global_accuracy"] for r in b]


def test_normalize_with_the_codes_constants_uses_them_and_not_the_clients_statistics():
    from fedlab_core.augment.normalize import CODE_CONSTANTS

    x = torch.rand(6, 3, 4, 4)
    fed = Federation(clients=[ClientData(x, torch.zeros(6, dtype=torch.long), x[:2], torch.zeros(2, dtype=torch.long), cid=0)],
                     x_test=x[:2], y_test=torch.zeros(2, dtype=torch.long), num_classes=2, input_shape=(3, 4, 4),
                     class_counts=np.full((1, 2), 3), scheme="iid", dataset="toy")
    code = Normalize(**CODE_CONSTANTS)
    _, up, down = code.setup(fed, 0)
    assert up == [] and down == []  # fixed constants: nothing exchanged
    out, _ = code.train_batch(None, x, None, 0, torch.Generator())
    mean = torch.tensor(CODE_CONSTANTS["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(CODE_CONSTANTS["std"]).view(1, 3, 1, 1)
    assert torch.allclose(out, (x - mean) / std)
    pooled = Normalize()
    pooled.setup(fed, 0)
    assert not torch.allclose(pooled.train_batch(None, x, None, 0, torch.Generator())[0], out)
