"""DisTrans: the two channels, the alternating offset/model steps, test-time offsets, offset aggregation,
its bytes, and that it learns."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlab_core import RunConfig
from fedlab_core.algorithms import FedAvg, Message, Training
from fedlab_core.algorithms.base import frozen_statistics
from fedlab_core.algorithms.distrans import DisTrans, DoubleChannel, OffsetNetwork, shift
from fedlab_core.data import federate, load_dataset
from fedlab_core.engine import Simulation
from fedlab_core.runs import run


class SmallCNN(nn.Module):
    """A conv + batch-norm block on 8x8 digits, with ``features``/``head``."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(4 * 4 * 4, 16)
        self.feature_dim = 16
        self.head = nn.Linear(16, num_classes)

    def features(self, x):
        return F.relu(self.fc(self.conv(x).flatten(1)))

    def forward(self, x):
        return self.head(self.features(x))


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def iid(digits):
    return federate(digits, "iid", 4, seed=0)


def _ready(algo, fed, seed=0):
    torch.manual_seed(seed)
    server = algo.init(SmallCNN(), fed)
    return server, {cid: algo.init_client(cid) for cid in range(fed.num_clients)}


# ----------------------------------------------------------------------------- the model

def test_the_two_channels_average_back_to_the_input_and_reveal_the_offset():
    g = torch.Generator().manual_seed(0)
    x, t = torch.rand(5, 3, 4, 4, generator=g), torch.rand(3, 4, 4, generator=g)
    for a in (0.1, 0.3, 0.9):
        first, second = shift(x, t, a)
        assert torch.allclose(first, 0.7 * x + 0.3 * t) if a == 0.3 else True
        assert torch.allclose((first + second) / 2, x, atol=1e-6)                 # the inverse recovers x
        assert torch.allclose(x + (first - second) / (2 * a), t.expand_as(x), atol=1e-5)  # and the offset


def test_double_channel_shares_one_backbone_and_adds_one_layer():
    torch.manual_seed(0)
    backbone = SmallCNN()
    single = sum(p.numel() for p in backbone.parameters())
    dense = DoubleChannel(copy.deepcopy(backbone), head="dense")
    wide = DoubleChannel(copy.deepcopy(backbone))
    assert sum(p.numel() for p in dense.parameters()) == single + 32 * 16 + 16   # plus Linear(2D, D)
    # the default: the logits layer reads 2D features instead of D (+ D x classes weights, as Table 7)
    assert sum(p.numel() for p in wide.parameters()) == single + 16 * 10
    x, t = torch.rand(6, 1, 8, 8), torch.rand(1, 8, 8)
    first, second = shift(x, t, 0.3)
    for model in (dense, wide):
        model.eval().offset = t
        z = torch.cat([model.backbone.features(first), model.backbone.features(second)], 1)
        expected = model.backbone.head(F.relu(model.dense(z)) if model is dense else z)
        assert torch.allclose(model(x), expected, atol=1e-5)
    one = DoubleChannel(copy.deepcopy(backbone), channels=1).eval()
    one.offset = t
    assert torch.allclose(one(x), one.backbone(first), atol=1e-6)
    assert not any("offset" in k for k in wide.state_dict())  # the offset never enters the model's state


def test_frozen_statistics_keeps_running_statistics_and_restores_momentum():
    model = SmallCNN().train()
    bn = model.conv[1]
    before = (bn.running_mean.clone(), bn.num_batches_tracked.clone())
    with frozen_statistics(model):
        model(torch.rand(8, 1, 8, 8))
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.num_batches_tracked, before[1])
    assert bn.momentum == 0.1
    model(torch.rand(8, 1, 8, 8))
    assert not torch.equal(bn.running_mean, before[0])


# ----------------------------------------------------------------------------- local steps

def _losses(model, x, y, t):
    model.offset = t
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("joint", [False, True])
def test_one_batch_steps_offset_then_model_as_algorithm_1(iid, joint):
    algo = DisTrans(Training(lr=0.5), offset_lr=2.0, joint=joint)
    _ready(algo, iid)
    model = algo.model.train()
    x, y = iid.clients[0].x_train[:16], iid.clients[0].y_train[:16]
    t0 = torch.rand(1, 8, 8)
    reference = copy.deepcopy(model)
    params0 = [p.detach().clone() for p in reference.parameters()]
    # by hand: the offset's gradient at (theta0, t0)
    t = t0.clone().requires_grad_(True)
    with frozen_statistics(reference):
        (g_t,) = torch.autograd.grad(_losses(reference, x, y, t), t)
    t1 = t0 - 2.0 * g_t
    # the model's gradient at (theta0, t1) for the paper, at (theta0, t0) for the code's joint step
    grads = torch.autograd.grad(_losses(reference, x, y, t0 if joint else t1), list(reference.parameters()))
    theta1 = [p - 0.5 * g for p, g in zip(params0, grads)]

    algo._offset = t0.clone().requires_grad_(True)
    model.offset = algo._offset
    algo.train_step(x, y, algo.make_optimizer(model.parameters()), {})
    assert torch.allclose(algo._offset.detach(), t1, atol=1e-5)
    for p, expected in zip(model.parameters(), theta1):
        assert torch.allclose(p.detach(), expected, atol=1e-5)


def test_the_offset_step_moves_only_the_offset_and_the_model_step_only_the_model(iid):
    x, y = iid.clients[0].x_train[:16], iid.clients[0].y_train[:16]
    for lr, offset_lr in ((0.0, 1.0), (1.0, 0.0)):
        algo = DisTrans(Training(lr=lr), offset_lr=offset_lr)
        _ready(algo, iid)
        weights = algo.shared.get()
        bn = algo.model.backbone.conv[1]
        stats = bn.running_mean.clone()
        t0 = torch.rand(1, 8, 8)
        algo._offset = t0.clone().requires_grad_(True)
        algo.model.train().offset = algo._offset
        algo.train_step(x, y, algo.make_optimizer(algo.model.parameters()), {})
        params = algo.shared.parameter_mask(algo.model)
        moved_model = not torch.equal(algo.shared.get()[params], weights[params])
        moved_offset = not torch.equal(algo._offset.detach(), t0)
        assert (moved_model, moved_offset) == (lr > 0, offset_lr > 0)
        # running statistics take their updates in the model step only, one per channel
        first, second = shift(x, algo._offset.detach(), 0.3)
        if lr == 0:
            conv = algo.model.backbone.conv[0]
            after_first = 0.9 * stats + 0.1 * conv(first).mean((0, 2, 3))
            assert torch.allclose(bn.running_mean, 0.9 * after_first + 0.1 * conv(second).mean((0, 2, 3)),
                                  atol=1e-5)


def test_two_passes_normalise_each_channel_by_its_own_statistics_and_one_pass_by_both():
    torch.manual_seed(0)
    backbone = SmallCNN()
    x, t = torch.rand(6, 1, 8, 8), torch.rand(1, 8, 8)
    first, second = shift(x, t, 0.3)
    two, one = DoubleChannel(copy.deepcopy(backbone)), DoubleChannel(copy.deepcopy(backbone), passes=1)
    for model in (two, one):
        model.train().offset = t
    reference = copy.deepcopy(two.backbone).train()
    by_channel = torch.cat([reference.features(first), reference.features(second)], 1)
    assert torch.allclose(two.features(x), by_channel, atol=1e-5)
    reference = copy.deepcopy(one.backbone).train()
    together = torch.cat(reference.features(torch.cat([first, second])).chunk(2), 1)
    assert torch.allclose(one.features(x), together, atol=1e-5)
    assert not torch.allclose(two.features(x), one.features(x), atol=1e-3)  # the statistics differ
    with pytest.raises(ValueError, match="passes"):
        DoubleChannel(copy.deepcopy(backbone), passes=3)


def test_server_mean_is_sample_weighted_unless_told_plain(iid):
    uploads = [(0, Message({"weights": torch.tensor([1.0, 0.0])}, num_samples=1)),
               (1, Message({"weights": torch.tensor([4.0, 3.0])}, num_samples=2))]
    for weighted, expected in ((True, [3.0, 2.0]), (False, [2.5, 1.5])):
        algo = DisTrans(aggregation="none", sample_weighted=weighted)
        server, _ = _ready(algo, iid)
        out = algo.aggregate({**server, "weights": torch.zeros(2)}, uploads, 1)
        assert torch.allclose(out["weights"], torch.tensor(expected))


def test_each_upload_reports_how_far_its_offset_moved_from_its_initial_noise(iid):
    algo = DisTrans(Training(lr=0.05, batch_size=32), offset_lr=5.0, aggregation="none")
    server, clients = _ready(algo, iid)
    data = iid.clients[2]
    initial = clients[2]["offset"].clone()
    upload, state = algo.local_update(algo.server_message(server, 2), clients[2], data, torch.Generator())
    change = float((state["offset"] - initial).norm() / initial.norm())
    assert change > 0 and upload.diagnostics["offset_change"] == pytest.approx(change)
    assert "offset_change" not in upload.metrics  # a diagnostic for the log: not counted as communication
    # the run's log carries the round's mean
    cfg = RunConfig(dataset="digits", partition="iid", num_clients=3, num_rounds=2, algorithm="distrans",
                    algorithm_params={"offset_lr": 5.0}, max_train_samples=300, max_test_samples=100)
    rows = run(cfg, use_cache=False, workers=1).rounds
    assert all(r["offset_change"] > 0 for r in rows) and rows[1]["offset_change"] > rows[0]["offset_change"]


# ----------------------------------------------------------------------------- prediction

def test_prediction_uses_the_clients_own_offset_and_the_mean_offset_globally(iid):
    algo = DisTrans()
    server, clients = _ready(algo, iid)
    x = iid.x_test[:20]
    by_client = [algo.predict(server, clients[c], x) for c in range(2)]
    assert not torch.allclose(by_client[0], by_client[1])
    algo.model.eval().offset = clients[1]["offset"]
    assert torch.allclose(by_client[1], algo.model(x))
    mean = torch.stack([s["offset"] for s in clients.values()]).mean(0)
    algo.model.offset = mean
    expected = algo.model(x)
    assert torch.allclose(algo.predict_global(server, clients, x), expected)


# ----------------------------------------------------------------------------- aggregation

def _upload(cid, offset, counts=None, n=10):
    tensors = {"weights": torch.zeros(3), "offset": offset}
    if counts is not None:
        tensors["class_counts"] = counts
    return cid, Message(tensors, num_samples=n)


def test_avg_aggregation_sends_every_client_the_mean_offset(iid):
    algo = DisTrans(aggregation="avg")
    server, clients = _ready(algo, iid)
    assert "offset" not in algo.server_message(server, 0).tensors  # nothing to send before round 1
    a, b = torch.full((1, 8, 8), 1.0), torch.full((1, 8, 8), 4.0)
    uploads = [_upload(0, a, n=10), _upload(2, b, n=30)]
    for cid, m in uploads:
        m.tensors["weights"] = server["weights"]
    new = algo.aggregate(server, uploads, 1)
    assert torch.allclose(new["offset"], torch.full((1, 8, 8), 2.5))  # the plain mean of the offsets
    for cid in range(4):
        assert torch.equal(algo.server_message(new, cid).tensors["offset"], new["offset"])


def test_none_aggregation_keeps_offsets_home(iid):
    algo = DisTrans(Training(local_steps=2), aggregation="none")
    server, clients = _ready(algo, iid)
    start = clients[1]["offset"].clone()
    message = algo.server_message(server, 1)
    assert set(message.tensors) == {"weights"}
    upload, state = algo.local_update(message, clients[1], iid.clients[1], torch.Generator().manual_seed(0))
    assert set(upload.tensors) == {"weights"}
    assert not torch.equal(state["offset"], start)  # trained, and kept by the client for the next round
    algo2 = DisTrans(Training(local_steps=2), aggregation="avg")
    server2, clients2 = _ready(algo2, iid)
    up2, _ = algo2.local_update(algo2.server_message(server2, 1), clients2[1], iid.clients[1],
                                torch.Generator().manual_seed(0))
    assert up2.nbytes - upload.nbytes == 8 * 8 * 4  # the offset's float32 bytes


def test_nn_with_offset_input_learns_the_regression_and_answers_each_client(iid):
    algo = DisTrans(aggregation="nn", server_lr=0.005, nn_input="class+offset")
    server, _ = _ready(algo, iid)
    g = torch.Generator().manual_seed(1)
    counts = [torch.tensor([3.0, 1.0] + [0.0] * 8), torch.tensor([1.0, 1.0] + [0.0] * 8)]
    old = [torch.rand(1, 8, 8, generator=g) for _ in range(2)]
    new = [o + 0.5 for o in old]
    state = algo.aggregate(server, [_upload(0, old[0], counts[0]), _upload(1, old[1], counts[1])], 1)
    # e: the share of each class's samples held by the client (class 0: 3 of 4 on client 0)
    assert state["has_sent"].tolist() == [True, True, False, False]
    assert torch.allclose(state["counts"][:2], torch.stack(counts))
    # an untrained network passes offsets through: the first answer is the client's own offset
    assert torch.allclose(state["sent"][0], old[0], atol=1e-6)
    assert torch.equal(algo.server_message(state, 1).tensors["offset"], state["sent"][1])
    assert "offset" not in algo.server_message(state, 3).tensors

    def distance(s):  # the server's regression loss on the round-2 pairs, under network s
        algo.net_state.set(s["net"])
        e = torch.stack(counts) / torch.stack(counts).sum(0).clamp(min=1)
        with torch.no_grad():
            return (torch.stack(new) - algo.net(e[:, :], torch.stack(old))).flatten(1).norm(dim=1).sum().item()

    before = distance(state)
    state2 = algo.aggregate(state, [_upload(0, new[0], counts[0]), _upload(1, new[1], counts[1])], 2)
    assert distance(state2) < before  # one SGD step on sum_i ||t_i - g(e_i, t_i^prev)|| lowers it
    assert torch.equal(state2["inputs"][0], new[0])


def test_nn_plus_no_switches_on_the_splits_dh(digits):
    skewed = federate(digits, "distrans", 10, seed=0, dh=0.8)
    algo_iid, algo_skew = DisTrans(), DisTrans()
    _ready(algo_iid, federate(digits, "iid", 10, seed=0))
    _ready(algo_skew, skewed)
    assert (algo_iid.mode, algo_skew.mode) == ("nn", "none")
    assert algo_skew.dh == pytest.approx(0.8)
    assert DisTrans(aggregation="avg", dh_threshold=0.0).aggregation == "avg"


def test_offset_network_output_shape_and_zero_start():
    net = OffsetNetwork(10, (3, 6, 6), with_offset=True)
    t = torch.rand(4, 3, 6, 6)
    out = net(torch.rand(4, 10), t)
    assert out.shape == (4, 3, 6, 6) and torch.equal(out, t)


def test_the_class_vector_network_depends_on_the_class_vector_alone():
    torch.manual_seed(0)
    net = OffsetNetwork(10, (3, 6, 6))
    e = torch.eye(10)[:4]
    out = net(e)
    assert out.shape == (4, 3, 6, 6)
    assert not torch.allclose(out[0], out[1])           # different class vectors, different offsets
    assert torch.equal(net(e[:1].repeat(2, 1))[0], net(e[:1].repeat(2, 1))[1])


def test_nn_on_the_class_vector_moves_towards_the_clients_offsets_and_answers_by_class(iid):
    algo = DisTrans(aggregation="nn")
    server, _ = _ready(algo, iid)
    counts = [torch.tensor([3.0, 1.0] + [0.0] * 8), torch.tensor([0.0, 1.0] + [1.0] * 8)]
    targets = [torch.full((1, 8, 8), 0.2), torch.full((1, 8, 8), 0.9)]
    e = torch.stack(counts) / torch.stack(counts).sum(0).clamp(min=1)

    def distance(s):  # the regression loss sum_i ||t_i - g(e_i)|| under network s
        algo.net_state.set(s["net"])
        with torch.no_grad():
            return (torch.stack(targets) - algo.net(e)).flatten(1).norm(dim=1).sum().item()

    state, before = server, distance(server)
    for r in range(1, 4):  # the first round already trains: no earlier answer is needed
        state = algo.aggregate(state, [_upload(0, targets[0], counts[0]), _upload(1, targets[1], counts[1])], r)
        assert distance(state) < before
        before = distance(state)
    algo.net_state.set(state["net"])
    with torch.no_grad():
        assert torch.allclose(state["sent"][:2], algo.net(e), atol=1e-6)  # the answer is g(e_i), not the upload
    assert not torch.allclose(state["sent"][0], targets[0], atol=1e-3)
    assert not torch.allclose(state["sent"][0], state["sent"][1])


@pytest.mark.parametrize("aggregation", ["avg", "nn"])
def test_a_client_tests_with_the_offset_the_server_sent_unless_told_local(iid, aggregation):
    x = iid.x_test[:20]
    outputs = {}
    for test_offset in ("sent", "local"):
        algo = DisTrans(Training(local_steps=2), aggregation=aggregation, test_offset=test_offset)
        server, clients = _ready(algo, iid)
        uploads = []
        for cid in (0, 1):
            upload, clients[cid] = algo.local_update(algo.server_message(server, cid), clients[cid],
                                                     iid.clients[cid], torch.Generator().manual_seed(cid))
            uploads.append((cid, upload))
        server = algo.aggregate(server, uploads, 1)
        sent = algo.server_message(server, 1).tensors["offset"]
        expected = sent if test_offset == "sent" else clients[1]["offset"]
        assert not torch.allclose(sent, clients[1]["offset"])
        algo.load(server["weights"], clients[1])
        algo.model.eval().offset = expected
        with torch.no_grad():
            reference = algo.model(x)
        algo.model.offset = None
        outputs[test_offset] = algo.predict(server, clients[1], x)
        assert torch.allclose(outputs[test_offset], reference)
    assert not torch.allclose(outputs["sent"], outputs["local"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(aggregation="mean"), "aggregation"), (dict(alpha=1.5), "alpha"), (dict(offset_lr=-1.0), "offset_lr"),
    (dict(channels=3), "channels"), (dict(head="mlp"), "head"), (dict(nn_input="offset"), "nn_input"),
    (dict(test_offset="global"), "test_offset")])
def test_bad_settings_are_rejected(iid, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _ready(DisTrans(**kwargs), iid)


# ----------------------------------------------------------------------------- end to end

def test_distrans_learns_a_skewed_split_deterministically_and_resumes(tmp_path):
    config = RunConfig(dataset="digits", model="mlp", partition="distrans", dh=0.6, num_clients=5, num_rounds=4,
                       lr=0.1, algorithm="distrans", algorithm_params={"offset_lr": 0.01}, seed=0)
    first = run(config, use_cache=False, progress=False)
    again = run(config, use_cache=False, progress=False)
    assert first.final["mean_client_accuracy"] > 0.6
    assert [r["mean_client_accuracy"] for r in first.rounds] == [r["mean_client_accuracy"] for r in again.rounds]
    nn_config = config.replace(dh=0.0, partition="iid", algorithm_params={"aggregation": "nn"})
    whole = run(nn_config, use_cache=False, progress=False)
    assert whole.rounds[0]["bytes_up"] > whole.rounds[0]["bytes_down"]  # round 1: offsets go up, none come down
    assert whole.rounds[1]["bytes_down"] > whole.rounds[0]["bytes_down"]  # from round 2 the server answers


def test_distrans_composes_with_augmentations(tiny):
    for augment, model in (("mixup", "mlp"), ("advprop", "mlp_bn")):
        h = run(tiny.replace(algorithm="distrans", augment=augment, model=model, num_rounds=2), use_cache=False,
                progress=False)
        assert 0.0 <= h.final["global_accuracy"] <= 1.0
