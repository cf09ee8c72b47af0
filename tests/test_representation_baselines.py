"""MOON, FedProto, FedAwS and FedFA: their defining maths on tiny cases, and that they learn on real digits."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlab_core.algorithms import FedAvg, Message, Training
from fedlab_core.algorithms.fedaws import FedAwS, positive_loss, spreadout_regulariser, spreadout_step
from fedlab_core.algorithms.fedfa import FedFA, batch_mean, batch_var, client_sharing_factor, resample_statistics
from fedlab_core.algorithms.fedproto import FedProto, FedProtoShared, class_means, prototype_regulariser
from fedlab_core.algorithms.moon import MOON, ProjectionHead, model_contrastive_loss
from fedlab_core.data import federate, load_dataset
from fedlab_core.engine import Simulation, client_generator
from fedlab_core.models import build_model


@pytest.fixture(scope="module")
def digits_iid():
    return federate(load_dataset("digits"), "iid", 4, seed=0)


def _run(algo, fed, num_rounds, make_model=None):
    torch.manual_seed(0)  # the same initial model for every run
    model = make_model() if make_model else build_model("mlp", fed.input_shape, fed.num_classes)
    return Simulation(algo, fed, model, seed=0, num_rounds=num_rounds, progress=False).run()


def _curve(state, key="global_accuracy"):
    return [(row["train_loss"], row[key]) for row in state.rows]


class SmallCNN(nn.Module):
    """Two 3x3 conv + batch-norm blocks on 8x8 digits: a small model with feature maps for FedFA to re-style."""

    blocks = ("conv.2", "conv.6")  # after conv-BN-ReLU, and after conv-BN-ReLU-pool

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(16 * 4 * 4, 32)
        self.feature_dim = 32
        self.head = nn.Linear(32, num_classes)

    def features(self, x):
        return F.relu(self.fc(self.conv(x).flatten(1)))  # (B, 32)

    def forward(self, x):
        return self.head(self.features(x))


# ----------------------------------------------------------------------------- MOON

def test_moon_contrastive_loss_matches_the_formula_and_is_log2_when_representations_coincide():
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    z_glob = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
    z_prev = torch.tensor([[0.0, 3.0], [-1.0, -1.0]])
    t = 0.5
    # cosines by hand: sample 1: glob 1/sqrt2, prev 0; sample 2: glob 1/sqrt2, prev -1
    per_sample = [-math.log(math.exp(a / t) / (math.exp(a / t) + math.exp(b / t)))
                  for a, b in [(1 / math.sqrt(2), 0.0), (1 / math.sqrt(2), -1.0)]]
    assert model_contrastive_loss(z, z_glob, z_prev, t).item() == pytest.approx(sum(per_sample) / 2, rel=1e-6)
    same = torch.randn(5, 3)
    assert model_contrastive_loss(same, same, same, t).item() == pytest.approx(math.log(2), rel=1e-6)


def test_moon_first_participation_is_fedavg_plus_log2_and_keeps_the_local_model(digits_iid):
    data = digits_iid.clients[0]
    runs = {}
    # the head-less form: the same model as FedAvg's
    for algo in (FedAvg(Training(lr=0.1)), MOON(Training(lr=0.1), mu=1.0, projection_dim=0)):
        torch.manual_seed(0)
        server = algo.init(build_model("mlp", digits_iid.input_shape, 10), digits_iid)
        state = algo.init_client(0)
        runs[algo.name] = algo.local_update(algo.server_message(server, 0), state, data, client_generator(0, 1, 0))
    (avg_up, _), (moon_up, moon_state) = runs["fedavg"], runs["moon"]
    # no previous model yet: the global model stands in, l_con = log 2 with zero gradient
    assert torch.allclose(moon_up.tensors["weights"], avg_up.tensors["weights"], atol=1e-6)
    assert moon_up.metrics["loss"] == pytest.approx(avg_up.metrics["loss"] + math.log(2), rel=1e-5)
    assert torch.equal(moon_state["previous"], moon_up.tensors["weights"])
    assert set(moon_up.tensors) == {"weights"}  # the previous model never leaves the client
    assert data.num_train == moon_up.num_samples


def test_moon_learns_digits_and_is_deterministic(digits_iid):
    runs = [_run(MOON(Training(lr=0.3), mu=1.0), digits_iid, 8) for _ in range(2)]  # with its projection head
    assert runs[0].rows[-1]["global_accuracy"] > 0.6
    assert _curve(runs[0]) == _curve(runs[1])
    assert all(torch.equal(runs[0].clients[c]["previous"], runs[1].clients[c]["previous"]) for c in range(4))


def test_moon_resumed_run_matches_an_uninterrupted_one(digits_iid):
    def sim(num_rounds):
        torch.manual_seed(0)
        model = build_model("mlp", digits_iid.input_shape, 10)
        return Simulation(MOON(Training(lr=0.1)), digits_iid, model, seed=0, num_rounds=num_rounds, progress=False)

    straight = sim(4).run()
    halfway = sim(2).run()
    resumed = sim(4).run(halfway)  # a fresh algorithm object: the previous models come from the client states
    assert _curve(resumed) == _curve(straight)


def test_moon_projection_head_is_the_papers_and_the_contrast_uses_its_projections(digits_iid, monkeypatch):
    model = build_model("mlp", digits_iid.input_shape, 10)
    d, before = model.head.in_features, sum(p.numel() for p in model.parameters())
    algo = MOON(Training(lr=0.1), mu=1.0, projection_dim=16)
    server = algo.init(model, digits_iid)
    head = model.head
    assert isinstance(head, ProjectionHead) and (head.l1.in_features, head.l1.out_features) == (d, d)
    assert (head.l2.out_features, head.l3.in_features, head.l3.out_features) == (16, 16, 10)
    # the head and the new output layer travel with the model; the backbone's own linear head is gone
    added = (d * d + d) + (d * 16 + 16) + (16 * 10 + 10) - (d * 10 + 10)
    assert server["weights"].numel() == before + added
    x = digits_iid.clients[0].x_train[:5]
    assert algo.representation(model, x).shape == (5, 16)
    assert torch.equal(model(x), head.l3(head.l2(F.relu(head.l1(model.features(x))))))
    compared = []
    real = model_contrastive_loss

    def spy(z, z_glob, z_prev, temperature):
        compared.append(z.shape[1])
        return real(z, z_glob, z_prev, temperature)
    monkeypatch.setattr("fedlab_core.algorithms.moon.model_contrastive_loss", spy)
    algo.loss(x, digits_iid.clients[0].y_train[:5], {})
    assert compared == [16]


def test_moon_with_a_projection_head_learns_and_differs_from_the_headless_form(digits_iid):
    # (the two extra layers learn more slowly: 0.42 after 8 rounds at lr 0.1, where the head-less form has 0.81)
    headed = [_run(MOON(Training(lr=0.3), mu=1.0, projection_dim=32), digits_iid, 8) for _ in range(2)]
    headless = _run(MOON(Training(lr=0.3), mu=1.0, projection_dim=0), digits_iid, 8)
    assert headed[0].rows[-1]["global_accuracy"] > 0.6
    assert _curve(headed[0]) == _curve(headed[1])  # deterministic: the head is drawn from the seeded stream
    assert _curve(headed[0]) != _curve(headless)


# ----------------------------------------------------------------------------- FedProto

def test_class_means_and_client_prototypes_equal_direct_class_means(digits_iid):
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [10.0, 0.0]])
    means, counts = class_means(z, torch.tensor([2, 2, 0]), 3)
    assert torch.equal(means, torch.tensor([[10.0, 0.0], [0.0, 0.0], [2.0, 3.0]]))
    assert torch.equal(counts, torch.tensor([1.0, 0.0, 2.0]))

    data = digits_iid.clients[1]
    algo = FedProtoShared(Training(lr=0.1))
    torch.manual_seed(0)
    server = algo.init(build_model("mlp", digits_iid.input_shape, 10), digits_iid)
    upload, _ = algo.local_update(algo.server_message(server, 1), algo.init_client(1), data, client_generator(0, 1, 1))
    algo.shared.set(upload.tensors["weights"])  # the trained model
    with torch.no_grad():
        z = algo.model.eval().features(data.x_train)
    for row, c in enumerate(upload.tensors["classes"].tolist()):
        mask = data.y_train == c
        assert torch.allclose(upload.tensors["prototypes"][row], z[mask].mean(0), atol=1e-5)
        assert upload.tensors["counts"][row] == mask.sum()


def test_fedproto_server_prototypes_are_count_weighted_means(digits_iid):
    algo = FedProto()
    server = algo.init(build_model("mlp", digits_iid.input_shape, 10), digits_iid)
    dim = algo.model.feature_dim
    p0, p1 = torch.randn(2, dim), torch.randn(2, dim)
    uploads = [  # client 0 holds classes 3 (10 samples) and 5 (2); client 1 holds class 3 (30 samples) and 7 (4)
        (0, Message({"prototypes": p0, "classes": torch.tensor([3, 5]), "counts": torch.tensor([10.0, 2.0])})),
        (1, Message({"prototypes": p1, "classes": torch.tensor([3, 7]), "counts": torch.tensor([30.0, 4.0])})),
    ]
    new = algo.aggregate(server, uploads, 1)
    assert torch.allclose(new["prototypes"][3], (10 * p0[0] + 30 * p1[0]) / 40, atol=1e-6)
    assert torch.allclose(new["prototypes"][5], p0[1]) and torch.allclose(new["prototypes"][7], p1[1])
    assert new["proto_counts"].tolist() == [0, 0, 0, 40, 0, 2, 0, 4, 0, 0]
    assert not new["prototypes"][0].any()
    message = algo.server_message(new, 0)  # only prototypes that exist travel, and no weights in this variant
    assert message.tensors["classes"].tolist() == [3, 5, 7] and "weights" not in message.tensors


def test_prototype_regulariser_by_hand():
    protos = torch.tensor([[1.0, 1.0], [0.0, 2.0], [5.0, 5.0]])
    has = torch.tensor([True, True, False])
    y = torch.tensor([0, 1, 2])
    assert prototype_regulariser(protos[y], y, protos, has).item() == 0.0  # features on their prototypes
    z = torch.tensor([[2.0, 1.0], [0.0, 5.0], [0.0, 0.0]])  # squared distances 1 and 9; class 2 has none
    assert prototype_regulariser(z, y, protos, has).item() == pytest.approx(5.0)
    assert prototype_regulariser(z, y, protos, torch.zeros(3, dtype=torch.bool)).item() == 0.0


@pytest.mark.parametrize("distance,scale", [("mse", 1 / 64), ("sqeuclidean", 1.0)])
def test_fedproto_loss_scales_the_regulariser_by_its_distance(digits_iid, distance, scale):
    algo = FedProto(mu=2.0, distance=distance)
    algo.init(build_model("mlp", digits_iid.input_shape, 10), digits_iid)  # 64 features
    data = digits_iid.clients[0]
    x, y = data.x_train[:16], data.y_train[:16]
    algo.received.prototypes.copy_(torch.randn(10, 64, generator=torch.Generator().manual_seed(0)))
    algo.received.known.fill_(True)
    with torch.no_grad():
        z = algo.model.features(x)
        ce = F.cross_entropy(algo.model.head(z), y)
        squared = (z - algo.received.prototypes[y]).pow(2).sum(1).mean()  # mean over samples of the summed squares
        assert algo.loss(x, y, {}).item() == pytest.approx((ce + 2.0 * scale * squared).item(), rel=1e-5)


def test_fedproto_regulariser_on_a_padded_batch_is_its_mean_over_the_real_samples():
    g = torch.Generator().manual_seed(0)
    z, prototypes = torch.randn(6, 4, generator=g), torch.randn(3, 4, generator=g)
    y, known = torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([True, False, True])
    real = torch.tensor([True, True, True, True, False, False])  # the last two: padding
    padded = prototype_regulariser(z, y, prototypes, known, real)
    assert padded.item() == pytest.approx(prototype_regulariser(z[:4], y[:4], prototypes, known).item(), rel=1e-6)
    none = prototype_regulariser(z, y, prototypes, torch.zeros(3, dtype=torch.bool), real)
    assert none.item() == 0.0


def test_fedproto_rejects_an_unknown_distance():
    with pytest.raises(ValueError, match="distance"):
        FedProto(distance="cosine")


def test_fedproto_learns_digits_with_and_without_model_sharing(digits_iid):
    shared = [_run(FedProtoShared(Training(lr=0.1)), digits_iid, 8) for _ in range(2)]
    assert shared[0].rows[-1]["global_accuracy"] > 0.6
    assert _curve(shared[0]) == _curve(shared[1])
    assert torch.equal(shared[0].server["prototypes"], shared[1].server["prototypes"])
    # one model per client, trained on a quarter of the data: more local epochs to get there in 5 rounds
    local = _run(FedProto(Training(lr=0.1, local_epochs=3)), digits_iid, 5)
    assert local.rows[-1]["mean_client_accuracy"] > 0.6
    assert local.rows[0]["bytes_up"] < 4 * 10 * (64 + 2) * 8  # prototypes only, never weights
    assert math.isnan(local.rows[-1]["global_accuracy"])  # no global model, and no stand-in number
    assert FedProto.global_model is False and FedProtoShared.global_model is True


def test_fedproto_with_every_client_taking_part_regularises_every_sample_from_round_2():
    # the case where the paper's-code denominator (the whole batch) and ours (samples with a prototype) agree
    fed = federate(load_dataset("digits"), "pathological", 5, seed=0, classes_per_client=2)
    algo = FedProto(Training(lr=0.1))
    state = _run(algo, fed, 1)
    for cid, client in enumerate(fed.clients):
        sent = set(algo.server_message(state.server, cid).tensors["classes"].tolist())
        assert set(client.y_train.unique().tolist()) <= sent


# ----------------------------------------------------------------------------- FedAwS

def test_spreadout_regulariser_by_hand():
    w = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])  # normalised: e1, e2, e1
    # squared distances: (0,1) = 2, (0,2) = 0, (1,2) = 2; ordered pairs count twice
    assert spreadout_regulariser(w, margin=0.9).item() == pytest.approx(2 * 0.9 ** 2)
    assert spreadout_regulariser(w, margin=2.5).item() == pytest.approx(2 * 2.5 ** 2 + 4 * 0.5 ** 2)
    assert spreadout_regulariser(torch.eye(3), margin=2.0).item() == 0.0


def test_one_spreadout_step_spreads_nearly_identical_class_embeddings():
    g = torch.Generator().manual_seed(0)
    w = torch.ones(5, 8) + 0.05 * torch.randn(5, 8, generator=g)

    def mean_cos(m):
        c = F.normalize(m, dim=1) @ F.normalize(m, dim=1).T
        return c[~torch.eye(5, dtype=torch.bool)].mean().item()

    stepped = spreadout_step(w, lr=0.1, margin=0.9)
    assert mean_cos(stepped) < mean_cos(w) - 1e-3
    assert spreadout_regulariser(stepped, 0.9) < spreadout_regulariser(w, 0.9)


def test_positive_loss_uses_only_the_own_class_embedding():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    w = torch.tensor([[1.0, 1.0], [0.0, 3.0], [-1.0, 0.0]])
    y = torch.tensor([0, 1])
    # cos(z0, w0) = 1/sqrt2 -> (0.9 - 0.7071)^2; cos(z1, w1) = 1 -> 0
    assert positive_loss(z, w, y, 0.9).item() == pytest.approx((0.9 - 1 / math.sqrt(2)) ** 2 / 2, rel=1e-5)
    w = w.requires_grad_(True)
    positive_loss(z, w, y, 0.9).backward()
    assert not w.grad[2].any()  # a class nobody in the batch holds is untouched


def test_fedaws_server_takes_owner_rows_then_spreads(digits_iid):
    algo = FedAwS(server_lr=0.0)  # no spread-out step: only the row collection
    server = algo.init(build_model("mlp", digits_iid.input_shape, 10), digits_iid)
    size = algo.shared.size
    w0, w1 = torch.randn(size), torch.randn(size)
    counts0, counts1 = torch.zeros(10), torch.zeros(10)
    counts0[2], counts1[2], counts1[4] = 10.0, 30.0, 5.0
    uploads = [(0, Message({"weights": w0, "class_counts": counts0}, num_samples=10)),
               (1, Message({"weights": w1, "class_counts": counts1}, num_samples=35))]
    new = algo.aggregate(server, uploads, 1)["weights"]
    rows = lambda v: algo.shared.view(v, "head.weight")
    assert torch.allclose(rows(new)[2], (10 * rows(w0)[2] + 30 * rows(w1)[2]) / 40, atol=1e-6)
    assert torch.allclose(rows(new)[4], rows(w1)[4])
    assert torch.equal(rows(new)[0], rows(server["weights"])[0])  # nobody holds class 0
    fc = algo.shared.view(new, "fc.weight")
    assert torch.allclose(fc, (10 * algo.shared.view(w0, "fc.weight") + 35 * algo.shared.view(w1, "fc.weight")) / 45,
                          atol=1e-6)


def test_fedaws_beats_fedavg_with_positive_labels_only():
    fed = federate(load_dataset("digits"), "one_class", 10, seed=0)
    avg = _run(FedAvg(Training(lr=0.1)), fed, 20)
    aws = [_run(FedAwS(Training(lr=0.1)), fed, 20) for _ in range(2)]
    no_spread = FedAwS(Training(lr=0.1), spreadout_weight=0.0)
    plain = _run(no_spread, fed, 20)
    # measured after 20 rounds: FedAwS 0.813, without the spread-out step 0.773, FedAvg 0.736 (clients
    # tested on their positives plus as many negatives); split seeds 1 and 2 give the same order
    assert aws[0].rows[-1]["mean_client_accuracy"] > avg.rows[-1]["mean_client_accuracy"] + 0.05
    assert _curve(aws[0], "mean_client_accuracy") == _curve(aws[1], "mean_client_accuracy")

    def mean_cos(state):
        w = F.normalize(no_spread.shared.view(state.server["weights"], "head.weight"), dim=1)
        return (w @ w.T)[~torch.eye(10, dtype=torch.bool)].mean().item()

    assert mean_cos(aws[0]) < mean_cos(plain) - 0.2  # the server's step keeps the classes apart


# ----------------------------------------------------------------------------- FedFA

def test_client_sharing_factor_by_hand():
    # r = V / (1 + V) = [0.5, 0.75]; gamma = 2 r / 1.25
    assert torch.allclose(client_sharing_factor(torch.tensor([1.0, 3.0]), eps=0.0), torch.tensor([0.8, 1.2]))
    assert torch.allclose(client_sharing_factor(torch.full((4,), 7.0)), torch.ones(4))


def test_resampled_maps_carry_the_sampled_statistics_and_zero_noise_is_identity():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, 5, generator=g) * 2 + 1
    v_mean, v_std = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([1.0, 1.0, 0.1])
    zero = torch.zeros(4, 3)
    assert torch.allclose(resample_statistics(x, v_mean, v_std, zero, zero), x, atol=1e-5)

    n_mean, n_std = torch.randn(4, 3, generator=g), torch.rand(4, 3, generator=g)  # std noise >= 0 keeps std > 0
    out = resample_statistics(x, v_mean, v_std, n_mean, n_std, eps=1e-6)
    mu = x.mean(dim=(2, 3))
    sigma = (x.var(dim=(2, 3)) + 1e-6).sqrt()
    r_mean, r_std = v_mean / (1 + v_mean), v_std / (1 + v_std)
    s_mean = ((3 * r_mean / r_mean.sum() + 1) * (mu.var(0) + 1e-6)).sqrt()
    s_std = ((3 * r_std / r_std.sum() + 1) * (sigma.var(0) + 1e-6)).sqrt()
    assert torch.allclose(out.mean(dim=(2, 3)), mu + n_mean * s_mean, atol=1e-5)
    assert torch.allclose(out.var(dim=(2, 3)).sqrt(), sigma + n_std * s_std, atol=1e-4)


def test_a_padded_batch_is_re_styled_as_its_real_samples_alone():  # the batched executor's padded batches
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 4, 4, generator=g) * 2 + 1
    v_mean, v_std = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([1.0, 1.0, 0.1])
    n_mean, n_std = torch.randn(5, 3, generator=g), torch.rand(5, 3, generator=g)
    padded = torch.cat([x, torch.randn(3, 3, 4, 4, generator=g)])  # three padding rows of other values
    real = torch.tensor([True] * 5 + [False] * 3)
    zeros = torch.zeros(3, 3)
    alone = resample_statistics(x, v_mean, v_std, n_mean, n_std)
    together = resample_statistics(padded, v_mean, v_std, torch.cat([n_mean, zeros]), torch.cat([n_std, zeros]),
                                   real=real)
    assert torch.allclose(together[:5], alone, atol=1e-5)
    stat = x.mean(dim=(2, 3))
    assert torch.allclose(batch_mean(torch.cat([stat, torch.full((3, 3), 9.0)]), real), stat.mean(0))
    assert torch.allclose(batch_var(torch.cat([stat, torch.full((3, 3), 9.0)]), real), stat.var(0))


def test_fedfa_hooks_live_only_in_local_training_use_the_client_rng_and_are_identity_at_eval(digits_iid):
    data = digits_iid.clients[0]

    def update(p, seed, algo_class=FedFA):
        torch.manual_seed(0)
        training = Training(lr=0.1, local_steps=3)  # 3 batches of one shuffled pass: the coins never move it
        algo = algo_class(training, p=p) if algo_class is FedFA else algo_class(training)
        server = algo.init(SmallCNN(), digits_iid)
        torch.manual_seed(123)  # the global stream must not matter: every draw is from the client's rng
        up, state = algo.local_update(algo.server_message(server, 0), algo.init_client(0), data,
                                      client_generator(seed, 1, 0))
        return algo, server, up, state

    algo, server, up, state = update(1.0, 0)
    assert [n for n, _ in algo.hooked] == ["conv.2", "conv.6"]  # each block's output, after ReLU (and pooling)
    assert all(not m._forward_hooks for m in algo.model.modules())  # only inside the loss of a training step
    assert torch.equal(up.tensors["running_mean"], state["running_mean"]) and up.tensors["running_mean"].shape == (24,)
    assert not torch.equal(state["running_std"], torch.ones(24))

    again = update(1.0, 0)[2]
    assert all(torch.equal(up.tensors[k], again.tensors[k]) for k in up.tensors)
    other_seed = update(1.0, 1)[2]
    assert not torch.equal(up.tensors["weights"], other_seed.tensors["weights"])
    never = update(0.0, 0)[2]
    assert torch.equal(never.tensors["weights"], update(None, 0, FedAvg)[2].tensors["weights"])  # p = 0: FedAvg
    assert not torch.equal(up.tensors["weights"], never.tensors["weights"])  # the augmentation changed training

    x = data.x_test[:16]
    step = {"draws": algo.draws(x, None, torch.Generator().manual_seed(0))}  # p = 1: every coin says re-style
    assert all(bool(step["draws"][f"augment.{i}"].all()) for i in range(len(algo.hooked)))
    handles = [m.register_forward_hook(algo._hook(i, step)) for i, (_, m) in enumerate(algo.hooked)]
    try:
        hooked_eval = algo.predict(server, None, x)  # eval mode: the hooks return the map unchanged
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(hooked_eval, algo.predict(server, None, x))


def test_fedfa_server_measures_the_variance_of_client_statistics(digits_iid):
    algo = FedFA()
    server = algo.init(SmallCNN(), digits_iid)
    size = algo.shared.size
    means = torch.randn(3, 24, generator=torch.Generator().manual_seed(0))  # (clients, 8 + 16 channels)
    uploads = [(c, Message({"weights": torch.zeros(size), "running_mean": means[c], "running_std": means[c] ** 2},
                           num_samples=10)) for c in range(3)]
    new = algo.aggregate(server, uploads, 1)
    assert torch.allclose(new["client_var_mean"], means.var(0))  # per channel, across the 3 clients
    assert torch.allclose(new["client_var_std"], (means ** 2).var(0))
    algo.pooled_client_variance = True  # the official code: one variance per layer
    pooled = algo.aggregate(server, uploads, 1)["client_var_mean"]
    assert torch.allclose(pooled[:8], means[:, :8].var().expand(8))
    assert torch.allclose(pooled[8:], means[:, 8:].var().expand(16))


def test_fedfa_learns_digits_and_is_deterministic(digits_iid):
    runs = [_run(FedFA(Training(lr=0.1)), digits_iid, 6, make_model=SmallCNN) for _ in range(2)]
    assert runs[0].rows[-1]["global_accuracy"] > 0.6
    assert _curve(runs[0]) == _curve(runs[1])
    assert torch.equal(runs[0].server["client_var_mean"], runs[1].server["client_var_mean"])
