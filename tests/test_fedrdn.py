"""FedRDN: statistics computed by hand, the shared pool and its bytes, what training and testing draw,
the per-image / per-batch and paired / independent modes, FedRDN-V, composition with every algorithm,
and the cross-site accuracy matrix of the local models."""
import copy
import math

import numpy as np
import pytest
import torch

from fedlab_core import RunConfig
from fedlab_core.algorithms import ALGORITHMS
from fedlab_core.augment import AUGMENTS, FedRDN
from fedlab_core.augment.fedrdn import image_statistics
from fedlab_core.data.federation import ClientData, Federation
from fedlab_core.runs import run, trained


def _federation(means=(0.0, 10.0, 20.0, 30.0), n=6, channels=3, size=4):
    """Clients whose images sit around distinct levels, so every client's statistics are recognisable."""
    g = torch.Generator().manual_seed(0)
    clients = []
    for cid, level in enumerate(means):
        scale = torch.arange(1, channels + 1, dtype=torch.float32).view(1, -1, 1, 1) * (cid + 1)
        x = level + scale * torch.rand(n, channels, size, size, generator=g)
        y = torch.randint(3, (n,), generator=g)
        clients.append(ClientData(x, y, x[:2].clone(), y[:2].clone(), cid))
    return Federation(clients, torch.cat([c.x_test for c in clients]), torch.cat([c.y_test for c in clients]),
                      3, (channels, size, size), np.zeros((len(means), 3)), "toy", "toy")


def _by_hand(x, correction):
    """Eq. 5 with Python loops over images and channels, then the mean over images."""
    n, c = x.shape[:2]
    means, stds = torch.zeros(c, dtype=torch.float64), torch.zeros(c, dtype=torch.float64)
    for i in range(n):
        for ch in range(c):
            pixels = [float(v) for v in x[i, ch].flatten()]
            mu = sum(pixels) / len(pixels)
            var = sum((p - mu) ** 2 for p in pixels) / (len(pixels) - correction)
            means[ch] += mu / n
            stds[ch] += math.sqrt(var) / n
    return means, stds


@pytest.mark.parametrize("unbiased", [False, True])
def test_statistics_equal_a_direct_computation(unbiased):
    x = _federation().clients[2].x_train
    mean, std = image_statistics(x, unbiased)
    want_mean, want_std = _by_hand(x, 1 if unbiased else 0)
    torch.testing.assert_close(mean.double(), want_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(std.double(), want_std, rtol=1e-6, atol=1e-6)
    # the mean of per-image stds is not the pooled std: the difference between images is left out
    pooled = x.transpose(0, 1).flatten(1).std(1, correction=0)
    assert (pooled > image_statistics(x)[1]).all()


def test_setup_shares_every_clients_statistics_and_counts_their_bytes():
    fed = _federation()
    aug = FedRDN()
    same, up, down = aug.setup(fed, seed=0)
    assert same is fed
    k, c = 4, 3
    assert [sorted(m.tensors) for m in up] == [["mean", "std"]] * k
    assert sum(m.nbytes for m in up) == k * 2 * c * 4           # 2 x C float32 per client
    assert sum(m.nbytes for m in down) == k * (k * 2 * c * 4)   # the whole list to every client
    for cid, client in enumerate(fed.clients):
        mean, std = image_statistics(client.x_train)
        torch.testing.assert_close(aug.means[cid], mean)
        torch.testing.assert_close(aug.stds[cid], std)


def _drawn_statistics(aug, x, normalised):
    """Recover, image by image, which (mean, std) produced `normalised` from `x`: x = z * std + mean."""
    # with two different pixels per channel the affine map is determined
    a, b = x[:, :, 0, 0], x[:, :, 0, 1]
    za, zb = normalised[:, :, 0, 0], normalised[:, :, 0, 1]
    std = (a - b) / (za - zb)
    mean = a - za * std
    return mean, std  # (B, C)


def _pool_index(pool, values):
    """Index of each row of `values` (B, C) in `pool` (K, C); -1 when not in the pool."""
    d = (values[:, None, :] - pool[None]).abs().amax(-1)  # (B, K)
    best = d.argmin(1)
    return torch.where(d.gather(1, best[:, None])[:, 0] < 1e-3 * pool.abs().max(), best, torch.tensor(-1))


def test_training_draws_per_image_only_from_the_shared_pool_and_testing_uses_the_own_statistics():
    fed = _federation()
    aug = FedRDN()
    aug.setup(fed, seed=0)
    x = fed.clients[1].x_train.repeat(40, 1, 1, 1)  # 240 images of client 1
    out, _ = aug.train_batch(None, x, torch.zeros(len(x), dtype=torch.long), 1, torch.Generator().manual_seed(3))
    mean, std = _drawn_statistics(aug, x, out)
    i, j = _pool_index(aug.means, mean), _pool_index(aug.stds, std)
    assert (i >= 0).all() and (j >= 0).all()       # only statistics from the pool
    assert (i == j).all()                         # paired: mean and std of the same client
    counts = torch.bincount(i, minlength=4)
    assert (counts > 30).all()                    # every client's statistics, own included, are drawn
    # testing: the client's own statistics, deterministically
    test = fed.clients[2].x_test
    torch.testing.assert_close(aug.eval_input(test, 2),
                               (test - aug.means[2].view(1, -1, 1, 1)) / aug.stds[2].view(1, -1, 1, 1))
    torch.testing.assert_close(aug.eval_input(test, 2), aug.eval_input(test, 2))
    # the global test set belongs to no client: the average statistics
    torch.testing.assert_close(aug.eval_input(test, None), (test - aug.means.mean(0).view(1, -1, 1, 1))
                               / aug.stds.mean(0).view(1, -1, 1, 1))


def test_per_batch_draws_one_pair_and_independent_mixes_clients():
    fed = _federation()
    x = fed.clients[0].x_train.repeat(10, 1, 1, 1)
    y = torch.zeros(len(x), dtype=torch.long)
    batch = FedRDN(draw="per_batch")
    batch.setup(fed, 0)
    chosen = set()
    for s in range(30):
        out, _ = batch.train_batch(None, x, y, 0, torch.Generator().manual_seed(s))
        i = _pool_index(batch.means, _drawn_statistics(batch, x, out)[0])
        assert (i >= 0).all() and (i == i[0]).all()  # one client's statistics for the whole batch
        chosen.add(int(i[0]))
    assert chosen == {0, 1, 2, 3}                    # re-drawn batch to batch
    independent = FedRDN(pairing="independent")
    independent.setup(fed, 0)
    out, _ = independent.train_batch(None, x, y, 0, torch.Generator().manual_seed(0))
    mean, std = _drawn_statistics(independent, x, out)
    i, j = _pool_index(independent.means, mean), _pool_index(independent.stds, std)
    assert (i >= 0).all() and (j >= 0).all()
    assert (i != j).float().mean() > 0.5            # about 3/4 of images mix two clients' statistics


def test_draws_are_reproducible_and_change_with_the_stream():
    fed = _federation()
    aug = FedRDN()
    aug.setup(fed, 0)
    x, y = fed.clients[0].x_train, fed.clients[0].y_train
    a, _ = aug.train_batch(None, x, y, 0, torch.Generator().manual_seed(5))
    b, _ = aug.train_batch(None, x, y, 0, torch.Generator().manual_seed(5))
    c, _ = aug.train_batch(None, x, y, 0, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_fedrdn_v_uses_the_average_statistics_for_training_and_testing():
    fed = _federation()
    aug = FedRDN(variant="average")
    aug.setup(fed, 0)
    x, y = fed.clients[3].x_train, fed.clients[3].y_train
    want = (x - aug.means.mean(0).view(1, -1, 1, 1)) / aug.stds.mean(0).view(1, -1, 1, 1)
    out, same_y = aug.train_batch(None, x, y, 3, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, want)
    assert same_y is y
    torch.testing.assert_close(aug.eval_input(x, 3), want)


@pytest.mark.parametrize("bad", [dict(variant="v"), dict(draw="per_epoch"), dict(pairing="mixed")])
def test_bad_options_are_rejected_with_the_allowed_values(bad):
    with pytest.raises(ValueError, match="must be one of"):
        FedRDN(**bad)


def test_statistics_reject_non_images():
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        image_statistics(torch.zeros(5, 4))


def test_registered_and_configurable_by_name():
    assert AUGMENTS["fedrdn"] is FedRDN
    with pytest.raises(ValueError, match="'fedrdn' has no parameter 'lam'"):
        RunConfig(augment="fedrdn", augment_params={"lam": 0.1})


MODEL_FOR = {"fedbn": "mlp_bn", "partialfed": "mlp_bn", "fraug": "mlp_bn", "fedfa": "digit"}  # they need batch norm or conv layers


@pytest.mark.parametrize("algorithm", sorted(set(ALGORITHMS) - {"fedaws"}))
def test_fedrdn_composes_with_every_algorithm(algorithm, tiny):
    config = tiny.replace(algorithm=algorithm, augment="fedrdn", partition="dirichlet", alpha=0.5,
                          num_rounds=2, local_steps=4, model=MODEL_FOR.get(algorithm, "mlp"))
    history = run(config, use_cache=False, progress=False)
    final = history.final
    assert final["global_accuracy"] is None if not ALGORITHMS[algorithm].global_model else 0.0 <= final["global_accuracy"] <= 1.0
    assert not math.isnan(final["mean_client_accuracy"])
    assert history.meta["setup_bytes"] == [4 * 2 * 1 * 4, 4 * (4 * 2 * 1 * 4)]  # 4 clients, 1 channel


def test_fedrdn_composes_with_fedaws_on_positive_labels(tiny):
    history = run(tiny.replace(algorithm="fedaws", augment="fedrdn", partition="one_class", num_rounds=2,
                               local_steps=4), use_cache=False, progress=False)
    assert 0.0 <= history.final["global_accuracy"] <= 1.0


def test_fedavg_with_fedrdn_learns_digits_as_well_as_without(tiny):
    plain = run(tiny.replace(num_rounds=5), use_cache=False, progress=False).final["global_accuracy"]
    rdn = run(tiny.replace(num_rounds=5, augment="fedrdn"), use_cache=False, progress=False)
    assert rdn.final["global_accuracy"] > 0.6 and rdn.final["global_accuracy"] > plain - 0.1


def test_cross_site_accuracy_matrix(tiny, tmp_path):
    config = tiny.replace(augment="fedrdn", partition="dirichlet", alpha=0.5, num_rounds=2)
    sim, state = trained(config, cache_dir=tmp_path, progress=False)
    # scoring any images as evaluation does reproduces the run's recorded numbers
    final = run(config, cache_dir=tmp_path, progress=False).final
    fed = sim.federation
    assert sim.accuracy(state, fed.x_test, fed.y_test) == pytest.approx(final["global_accuracy"])
    assert [sim.accuracy(state, c.x_test, c.y_test, c.cid) for c in fed.clients] == pytest.approx(
        final["client_accuracy"])
    before = {k: v.clone() for k, v in state.server.items() if torch.is_tensor(v)}
    acc = sim.cross_site_accuracy(state)
    again = sim.cross_site_accuracy(state)
    assert acc.shape == (4, 4) and np.array_equal(acc, again)  # deterministic
    assert ((acc >= 0) & (acc <= 1)).all()
    for k, v in before.items():
        assert torch.equal(state.server[k], v)                   # the final state is left alone
    # entry (0, 2) by hand: client 0 trains one more round on that round's stream, then scores client 2's
    # test images normalised with client 2's own statistics
    from fedlab_core.engine import derive_seed

    seed = derive_seed(config.seed, state.next_round, 0)
    algo, aug = sim.algorithm, sim.augment
    algo.local_update(algo.server_message(state.server, 0), copy.deepcopy(state.clients[0]),
                      sim.federation.clients[0], torch.Generator().manual_seed(seed))
    algo.model.eval()
    data = sim.federation.clients[2]
    x = (data.x_test - aug.means[2].view(1, -1, 1, 1)) / aug.stds[2].view(1, -1, 1, 1)
    with torch.no_grad():
        want = (algo.model(x).argmax(1) == data.y_test).float().mean().item()
    assert acc[0, 2] == pytest.approx(want)


def test_a_channel_without_spread_is_centred_not_divided_by_zero():
    fed = _federation()
    flat = fed.clients[1]
    flat.x_train[:, 2] = 0.5  # channel 2 constant in every training image of client 1
    aug = FedRDN()
    aug.setup(fed, seed=0)
    assert aug.stds[1, 2] == 1.0 and (aug.stds[[0, 2, 3]] != 1.0).all()
    x = fed.clients[0].x_train[:2]
    out = aug.eval_input(x, 1)  # another client's images with client 1's statistics
    torch.testing.assert_close(out[:, 2], x[:, 2] - aug.means[1, 2])  # centred only
    assert out.abs().max() < 100  # nothing scaled by 1e8


def test_every_embedded_domain_has_spread_in_every_channel():
    from fedlab_core.data import TEN_DOMAINS, load_dataset

    data = load_dataset("fashion_mnist_domains", domains=list(TEN_DOMAINS), samples_per_domain=30, test_per_domain=5)
    for d, name in enumerate(TEN_DOMAINS):
        _, std = image_statistics(data.x_train[data.domain_train == d])
        assert (std > 0.02).all(), (name, std)  # FedRDN divides by it
