"""The engine and FedAvg: aggregation by hand, bytes, sampling, order independence, failures."""
import math

import pytest
import torch
from torch import nn

from fedlab_core.algorithms import FedAvg, FlatState, Message, NonFiniteLossError, Training, weighted_mean
from fedlab_core.data import federate, load_dataset
from fedlab_core.algorithms.base import copy_all
from fedlab_core.engine import Simulation, client_generator
from fedlab_core.models import build_model
from fedlab_core.runs import build
from conftest import TinyBN




def _federation(num_clients=3, scheme="iid", **kw):
    return federate(load_dataset("digits"), scheme, num_clients, seed=0, **kw)


def test_weighted_mean_by_hand():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    assert torch.equal(weighted_mean([a, b], [1, 3]), torch.tensor([2.5, 3.5]))


def test_fedavg_aggregate_weights_by_sample_count():
    algo = FedAvg()
    uploads = [(0, Message({"weights": torch.tensor([0.0, 4.0])}, num_samples=10)),
               (1, Message({"weights": torch.tensor([6.0, 0.0])}, num_samples=30))]
    out = algo.aggregate({"weights": torch.zeros(2)}, uploads, 1)
    assert torch.allclose(out["weights"], torch.tensor([4.5, 1.0]))


def test_flat_state_round_trip_includes_bn_buffers():
    model = TinyBN()
    flat = FlatState(model)
    assert "bn.running_mean" in flat.names and "bn.running_var" in flat.names
    assert "bn.num_batches_tracked" not in flat.names  # integer entries are not averaged
    v = torch.arange(flat.size, dtype=torch.float32)
    flat.set(v)
    assert torch.equal(flat.get(), v)
    offset = sum(model.state_dict()[k].numel() for k in flat.names[:flat.names.index("bn.running_mean")])
    assert torch.equal(model.bn.running_mean, v[offset:offset + 8])
    assert torch.equal(flat.view(v, "bn.running_mean"), v[offset:offset + 8])
    assert flat.view(v, "fc.weight").shape == (8, 64)


def test_copy_all_copies_each_pair_whatever_its_types_with_the_bits_of_copy():
    targets = [torch.zeros(3), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.float64)]
    sources = [torch.tensor([-0.0, 1e-45, float("nan")]), torch.tensor([7, 8]), torch.tensor([0.1, -2.0])]
    copy_all(targets, sources)
    assert torch.equal(targets[0].view(torch.int32), sources[0].view(torch.int32))  # -0.0, a subnormal, NaN
    assert targets[1].tolist() == [7, 8]
    assert torch.equal(targets[2], torch.zeros(2, dtype=torch.float64).copy_(sources[2]))  # converted as copy_ does
    with pytest.raises(ValueError):
        copy_all(targets, sources[:2])


def test_fedavg_round_averages_every_float_entry_including_bn_statistics():
    fed = _federation(3)
    torch.manual_seed(0)
    algo = FedAvg(Training(lr=0.1))
    server = algo.init(TinyBN(), fed)
    states, uploads = [], []
    for cid in range(3):
        up, _ = algo.local_update(algo.server_message(server, cid), {}, fed.clients[cid], client_generator(0, 1, cid))
        states.append(dict(algo.model.state_dict()))
        states[-1] = {k: v.clone() for k, v in states[-1].items()}
        uploads.append((cid, up))
    new = algo.aggregate(server, uploads, 1)
    algo.shared.set(new["weights"])
    n = torch.tensor([c.num_train for c in fed.clients], dtype=torch.float32)
    for key in ("fc.weight", "bn.running_mean", "bn.running_var", "out.bias"):
        by_hand = sum(w * s[key] for w, s in zip(n / n.sum(), states))
        assert torch.allclose(algo.model.state_dict()[key], by_hand, atol=1e-6), key
    assert not torch.equal(states[0]["bn.running_mean"], states[1]["bn.running_mean"])


def _sim(fed, algo=None, **kw):
    torch.manual_seed(0)
    model = build_model("mlp", fed.input_shape, fed.num_classes)
    return Simulation(algo or FedAvg(Training(lr=0.1)), fed, model, seed=0, num_rounds=kw.pop("num_rounds", 2),
                      progress=False, **kw)


def test_bytes_counted_per_message():
    fed = _federation(4)
    sim = _sim(fed, num_rounds=1)
    state = sim.run()
    p = sim.algorithm.shared.size
    row = state.rows[0]
    assert row["bytes_down"] == 4 * 4 * p
    assert row["bytes_up"] == 4 * (4 * p + 8 + 8)  # weights + sample count + loss metric


def test_client_sampling_fraction_and_count_are_deterministic():
    fed = _federation(10)
    sim = _sim(fed, fraction=0.3)
    rounds = [sim.sample(r) for r in range(1, 6)]
    assert all(len(s) == 3 for s in rounds) and len({tuple(s) for s in rounds}) > 1
    assert rounds == [_sim(fed, fraction=0.3).sample(r) for r in range(1, 6)]
    assert len(_sim(fed, clients_per_round=7).sample(1)) == 7
    assert _sim(fed).sample(1) == list(range(10))


def test_results_do_not_depend_on_client_execution_order():
    fed = _federation(4)
    forward = _sim(fed).run()
    backward_sim = _sim(fed)
    backward_sim.sample = lambda r: [3, 2, 1, 0]
    backward = backward_sim.run()
    assert torch.equal(forward.server["weights"], backward.server["weights"])


class FailsForClientOne(FedAvg):
    def local_update(self, message, client_state, data, rng):
        if data.cid == 1:
            raise RuntimeError("disk full")
        return super().local_update(message, client_state, data, rng)


def test_failing_client_is_logged_and_left_out(caplog):
    fed = _federation(3)
    state = _sim(fed, FailsForClientOne(Training(lr=0.1)), num_rounds=1).run()
    assert state.rows[0]["failed"] == 1 and state.rows[0]["clients"] == 3
    assert "client 1 failed in round 1" in caplog.text and "disk full" in caplog.text
    # the aggregate equals FedAvg over clients 0 and 2 only
    two = federate(load_dataset("digits"), "iid", 3, seed=0)
    two.clients = [two.clients[0], two.clients[2]]
    ref = _sim(two, num_rounds=1)
    ref.sample = lambda r: [0, 1]
    ref_state = ref.initial_state()
    # client 2 draws its stream as client 2: rebuild uploads by hand
    algo = ref.algorithm
    ups = []
    for cid, data in ((0, two.clients[0]), (2, two.clients[1])):
        up, _ = algo.local_update(algo.server_message(ref_state.server, cid), {}, data, client_generator(0, 1, cid))
        ups.append((cid, up))
    assert torch.allclose(algo.aggregate(ref_state.server, ups, 1)["weights"], state.server["weights"])


class NanForClientTwo(FedAvg):
    def loss(self, x, y, client_state):
        loss = super().loss(x, y, client_state)
        return loss * math.nan if self._cid == 2 else loss

    def local_update(self, message, client_state, data, rng):
        self._cid = data.cid
        return super().local_update(message, client_state, data, rng)


def test_nan_loss_stops_the_run_naming_client_and_round():
    with pytest.raises(NonFiniteLossError, match="client 2 in round 1"):
        _sim(_federation(3), NanForClientTwo(Training(lr=0.1))).run()


class Spy(FedAvg):
    """Records everything the server-side hook receives."""

    seen: list = []

    def aggregate(self, server_state, uploads, round_idx):
        Spy.seen.append(uploads)
        return super().aggregate(server_state, uploads, round_idx)


def test_server_receives_only_declared_uploads_and_no_raw_data():
    fed = _federation(3)
    sim = _sim(fed, Spy(Training(lr=0.1)), num_rounds=1)
    sim.run()
    data_ptrs = {t.untyped_storage().data_ptr() for c in fed.clients for t in (c.x_train, c.y_train)}
    for cid, msg in Spy.seen[-1]:
        assert isinstance(msg, Message) and set(msg.tensors) == {"weights"}
        for t in msg.tensors.values():
            assert t.untyped_storage().data_ptr() not in data_ptrs
            assert t.numel() == sim.algorithm.shared.size


def test_local_steps_and_epochs_count_batches():
    fed = _federation(2)
    data = fed.clients[0]
    algo = FedAvg(Training(batch_size=32, local_epochs=2))
    algo.init(build_model("mlp", fed.input_shape, 10), fed)
    batches = list(algo.batches(data, client_generator(0, 1, 0)))
    assert len(batches) == 2 * math.ceil(data.num_train / 32) - (2 if data.num_train % 32 == 1 else 0)
    algo.training = Training(batch_size=32, local_steps=50)
    assert len(list(algo.batches(data, client_generator(0, 1, 0)))) == 50


def test_fedavg_learns_digits(tiny):
    sim = build(tiny.replace(num_rounds=15), torch.device("cpu"), progress=False)
    state = sim.run()
    assert state.rows[-1]["global_accuracy"] > 0.85
    assert state.rows[-1]["mean_client_accuracy"] > 0.85


class LocalBN(FedAvg):
    """The protocol's declared local state (as FedBN uses it): batch-norm entries never leave a client."""

    local_patterns = ("bn.*",)


def test_declared_local_entries_stay_on_the_client_and_are_used_by_predict():
    fed = _federation(3, scheme="dirichlet", alpha=0.3, min_size=20)
    torch.manual_seed(0)
    sim = Simulation(LocalBN(Training(lr=0.1)), fed, TinyBN(), seed=0, num_rounds=2, progress=False)
    state = sim.run()
    algo = sim.algorithm
    assert not any(name.startswith("bn.") for name in algo.shared.names)
    assert algo.local.names == ["bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"]
    assert state.rows[0]["bytes_down"] == 3 * 4 * algo.shared.size   # BN entries are not sent
    locals_ = [state.clients[c]["local"] for c in range(3)]
    assert not torch.equal(locals_[0], locals_[1])                    # each client kept its own
    x = fed.clients[0].x_test[:16]
    own = algo.predict(state.server, state.clients[0], x)
    other = algo.predict(state.server, state.clients[1], x)
    assert not torch.allclose(own, other)                             # predict used the client's BN
