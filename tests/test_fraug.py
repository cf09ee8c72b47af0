"""FRAug: MMD, the two stages of a local step (what each may change), the prototypes' EMA and the schedule by
hand, what travels and what stays, bytes, determinism, resume and learning on real digits."""
import dataclasses
import io
import math

import pytest
import torch

from fedlab_core import RunConfig
from fedlab_core.algorithms.base import Training
from fedlab_core.algorithms.fedbn import batch_norm_entries
from fedlab_core.algorithms.fraug import FRAug, entropy, mmd
from fedlab_core.data import federate, load_dataset
from fedlab_core.engine import Simulation, SimulationState, client_generator
from fedlab_core.models import build_model
from fedlab_core.runs import build


def _fed(num_clients=3):
    return federate(load_dataset("digits"), "iid", num_clients, seed=0)


def _sim(algo, fed=None, num_rounds=1, **kw):
    torch.manual_seed(0)
    return Simulation(algo, fed or _fed(), build_model("mlp_bn", (1, 8, 8), 10), seed=0, num_rounds=num_rounds,
                      progress=False, **kw)


def _ready(algo=None, round_idx=1, cid=0):
    """An initialised FRAug with client `cid`'s round-`round_idx` message loaded, as at the start of local training."""
    sim = _sim(algo or FRAug(Training(lr=0.1, local_steps=2)), num_rounds=4)
    state = sim.initial_state()
    a = sim.algorithm
    a.load(state.server["weights"], state.clients[cid])
    a.gen_state.set(state.server["generator"])
    a.rt_state.set(state.clients[cid]["rtnet"])
    a._prototypes = state.clients[cid]["prototypes"].clone()
    a._lam, *a._loss_weights = a.weights(round_idx)
    a._aux_opt = torch.optim.SGD([*a.generator.parameters(), *a.rtnet.parameters()], lr=a.aux_lr, momentum=0.5)
    a._rng, a._mmd = client_generator(0, round_idx, cid), []
    data = sim.federation.clients[cid]
    return a, state, data.x_train[:32], data.y_train[:32]


def _copy(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _changed(before, module):
    return {k for k, v in module.state_dict().items() if not torch.equal(v, before[k])}


# ------------------------------------------------------------------------------------------------ MMD


def test_mmd_is_zero_on_identical_samples_and_grows_with_a_shift():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g)
    assert mmd(x, x.clone()).item() == pytest.approx(0.0, abs=1e-6)
    y = torch.randn(64, 5, generator=g)
    gaps = [mmd(x, y + shift).item() for shift in (0.0, 0.5, 1.0, 2.0)]
    # the biased estimate is small but not zero for two samples of one distribution (its diagonal terms)
    assert gaps == sorted(gaps) and gaps[-1] > 10 * gaps[0]


def test_mmd_by_hand_on_two_points():
    # x = {0}, y = {1} in 1-D: squared distance 1, mean over the 2 distinct pairs 1, base bandwidth 1/4;
    # k(a, a) = 5 (five kernels at distance 0), k(0, 1) = sum_i exp(-1 / (2^i / 4))
    cross = sum(math.exp(-4 / 2 ** i) for i in range(5))
    assert mmd(torch.zeros(1, 1), torch.ones(1, 1)).item() == pytest.approx(5 + 5 - 2 * cross, rel=1e-6)


def test_entropy_is_log_classes_for_uniform_logits_and_zero_for_certain_ones():
    assert entropy(torch.zeros(4, 10)).item() == pytest.approx(math.log(10))
    assert entropy(torch.tensor([[100.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)


# ------------------------------------------------------------------------------- the schedule and the EMA


def test_schedule_by_hand():
    paper = FRAug(gamma=0.1, ramp_rounds=0)   # the code's formula, unscaled
    paper.num_rounds = 10
    assert paper.weights(10) == (1.0, 1.0, 1.0, 1.0)                             # lam reaches 1 at the last round
    assert paper.weights(4) == pytest.approx((math.exp(-0.6), 1.0, 1.0, 1.0))   # losses added (Eq. 1)
    code = FRAug(gamma=0.1, variant="code", ramp_rounds=0)
    code.num_rounds = 10
    assert code.weights(4) == pytest.approx((math.exp(-0.6), 0.5, 0.25, 0.25))  # Lr = min(0.5, 0.549), halved
    assert code.weights(1) == pytest.approx((math.exp(-0.9), 1 - math.exp(-0.9), *[math.exp(-0.9) / 2] * 2))
    flat = FRAug(gamma=0.1, smoothing=False)
    flat.num_rounds = 10
    assert flat.weights(1) == (1.0, 1.0, 1.0, 1.0)
    digits = FRAug(gamma=0.002, variant="code")   # the code's Digits run: 0.5 : 0.25 : 0.25 for all 300 rounds
    digits.num_rounds = 300
    assert {digits.weights(r)[1:] for r in (1, 150, 300)} == {(0.5, 0.25, 0.25)}
    fixed = FRAug(loss_weights=(0.5, 0.25, 0.25))  # the code's Digits balance with the paper's other choices
    fixed.num_rounds = 10
    assert fixed.weights(3)[1:] == (0.5, 0.25, 0.25)


def test_the_scaled_schedule_has_the_codes_300_round_shape_over_any_run_length():
    code_run, short, unscaled = FRAug(gamma=0.01), FRAug(gamma=0.01), FRAug(gamma=0.01, ramp_rounds=0)
    code_run.num_rounds, short.num_rounds, unscaled.num_rounds = 300, 30, 30
    lam = lambda a, r: a.weights(r)[0]
    assert lam(code_run, 300) == lam(short, 30) == 1.0                  # both end at 1
    assert lam(short, 0) == pytest.approx(math.exp(-3.0)) == lam(code_run, 0)   # both start near 0.05
    assert lam(short, 15) == pytest.approx(lam(code_run, 150))          # the same value half way
    assert lam(unscaled, 0) == pytest.approx(math.exp(-0.3))            # unscaled over 30 rounds: 0.74 to 1


def test_prototypes_are_the_ema_of_the_batch_class_means_and_absent_classes_keep_theirs():
    a, _, x, y = _ready()
    a._prototypes[:] = 1.0
    y = torch.where(y == 3, torch.zeros_like(y), y)   # no class 3 in this batch
    with torch.no_grad():
        a.model.train()
        u = a.model.features(x)
    means = {int(c): u[y == c].mean(0) for c in y.unique()}
    opt = torch.optim.SGD(a.model.parameters(), lr=0.0)  # no model change: the EMA sees these embeddings
    a.model_step(x, y, opt)
    for c in range(10):
        expected = 0.7 * torch.ones(u.shape[1]) + 0.3 * means[c] if c in means else torch.ones(u.shape[1])
        assert torch.allclose(a._prototypes[c], expected, atol=1e-5), c


# ------------------------------------------------------------------------------- what each stage changes


def test_the_synthetic_loss_trains_only_the_head():
    a, _, x, y = _ready()
    a._loss_weights = [0.0, 1.0, 1.0]   # the model's loss is the synthetic part alone
    before = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    a.model_step(x, y, torch.optim.SGD(a.model.parameters(), lr=0.5))
    moved = {n for n, p in a.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {"head.weight", "head.bias"}
    a._loss_weights = [1.0, 1.0, 1.0]
    a.model_step(x, y, torch.optim.SGD(a.model.parameters(), lr=0.5))
    assert {n for n, p in a.model.named_parameters() if not torch.equal(p, before[n])} > moved


def test_the_model_step_leaves_generator_and_rtnet_untouched_and_their_step_leaves_the_model():
    a, _, x, y = _ready()
    model, gen, rt = _copy(a.model), _copy(a.generator), _copy(a.rtnet)
    _, u = a.model_step(x, y, torch.optim.SGD(a.model.parameters(), lr=0.1))
    assert _changed(model, a.model) and not _changed(gen, a.generator) and not _changed(rt, a.rtnet)
    model = _copy(a.model)
    a.auxiliary_step(u, y)
    assert not _changed(model, a.model)                                    # statistics included
    assert any("net.0.weight" == k for k in _changed(gen, a.generator))
    assert any("net.0.weight" == k for k in _changed(rt, a.rtnet))


def test_without_rtnet_only_the_generator_learns():
    a, _, x, y = _ready(FRAug(Training(lr=0.1), rtnet=False))
    rt = _copy(a.rtnet)
    _, u = a.model_step(x, y, torch.optim.SGD(a.model.parameters(), lr=0.1))
    a.auxiliary_step(u, y)
    assert not _changed(rt, a.rtnet)


def test_generator_only_trains_the_head_on_the_generators_embeddings_themselves():
    a, _, x, y = _ready(FRAug(Training(lr=0.1), rtnet=False))
    a.generator.eval()
    with torch.no_grad():
        u = a.model.features(x)
        rng_state = a._rng.get_state()
        s = a.synthetic(u, y)
        a._rng.set_state(rng_state)
        v = a.generator(a.draw(len(y)), y)
        torch.randint(10, (1,), generator=a._rng)       # the class-balanced labels' start
        v_c = a.generator(a.draw(len(y)), s["y_c"])
    assert torch.equal(s["u_hat"], v)                    # not u + lam v: the client-agnostic embedding itself
    assert not torch.allclose(s["u_hat"], u + a._lam * v)
    assert torch.equal(s["u_hat_c"], v_c)                # and no prototype anchor


def test_the_synthetic_statistics_measure_the_offsets_the_rtnet_adds_and_what_the_head_makes_of_them():
    sim = _sim(FRAug(Training(lr=0.1, local_steps=2)), num_rounds=4)
    state, a = sim.initial_state(), sim.algorithm
    data = sim.federation.clients[0]
    x, y = data.x_train[:64], data.y_train[:64]
    stats = a.synthetic_statistics(state.server, state.clients[0], x, y, seed=3)
    made = a.samples(state.server, state.clients[0], x, y, seed=3)
    offset = made["transformed"] - made["real"]
    assert stats["real norm"] == pytest.approx(float(made["real"].norm(dim=1).mean()))
    assert stats["offset norm"] == pytest.approx(float(offset.norm(dim=1).mean())) and stats["offset norm"] > 0
    assert stats["cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(made["real"], offset).mean()))
    with torch.no_grad():
        assert stats["head on real"] == pytest.approx(float((a.model.head(made["real"]).argmax(1) == y).float().mean()))

    def rescaled(factor):
        # the client's RTNet with its last batch norm's scale and shift times `factor`: its residuals scale with it
        a.rt_state.set(state.clients[0]["rtnet"])
        with torch.no_grad():
            a.rtnet.net[-1].weight.mul_(factor), a.rtnet.net[-1].bias.mul_(factor)
        return a.synthetic_statistics(state.server, {**state.clients[0], "rtnet": a.rt_state.get()}, x, y, seed=3)

    doubled, none = rescaled(2.0), rescaled(0.0)
    assert doubled["offset norm"] == pytest.approx(2 * stats["offset norm"], rel=1e-5)
    assert doubled["cosine"] == pytest.approx(stats["cosine"], abs=1e-5)
    assert none["offset norm"] == 0 and none["head on synthetic"] == stats["head on real"]


def test_keeping_the_optimiser_carries_momentum_into_the_next_round():
    def two_rounds(keep):
        a, state, _, _ = _ready(FRAug(Training(lr=0.1, momentum=0.5, local_steps=3), keep_optimizer=keep))
        client = state.clients[0]
        for r in (1, 2):
            msg = dataclasses.replace(a.server_message(state.server, 0), metrics={"round": r})
            up, client = a.local_update(msg, client, a.federation.clients[0], client_generator(0, r, 0))
        return up.tensors, client

    (fresh, fresh_state), (kept, kept_state) = two_rounds(False), two_rounds(True)
    assert "momentum" not in fresh_state
    assert kept_state["momentum"]["model"].abs().sum() > 0 and kept_state["momentum"]["aux"].abs().sum() > 0
    assert not torch.equal(fresh["weights"], kept["weights"])   # round 2 starts with round 1's momentum


def test_each_auxiliary_network_follows_the_gradient_of_its_own_loss():
    # alpha = 0: G's loss is the cross-entropy alone; its step must match plain SGD on that loss
    a, _, x, y = _ready(FRAug(Training(lr=0.1), alpha=0.0, prototypes=False, aux_lr=0.1))
    _, u = a.model_step(x, y, torch.optim.SGD(a.model.parameters(), lr=0.0))
    rng_state = a._rng.get_state()
    gen_state, rt_state = _copy(a.generator), _copy(a.rtnet)
    a.auxiliary_step(u, y)
    stepped = {n: p.detach().clone() for n, p in a.generator.named_parameters()}
    a.generator.load_state_dict(gen_state), a.rtnet.load_state_dict(rt_state)
    a._rng.set_state(rng_state)
    a.generator.train(), a.rtnet.train()
    s = a.synthetic(u, y)
    loss = torch.nn.functional.cross_entropy(a.model.head(s["u_hat"]), y)
    grads = torch.autograd.grad(loss, list(a.generator.parameters()))
    for (n, p), g in zip(a.generator.named_parameters(), grads):
        assert torch.allclose(stepped[n], p - 0.1 * g, atol=1e-6), n


# ------------------------------------------------------------------------------------------- the round


def test_only_the_model_without_batch_norm_and_the_generator_travel():
    fed = _fed(3)
    sim = _sim(FRAug(Training(lr=0.1, local_steps=3)), fed, num_rounds=2)
    state = sim.run()
    a = sim.algorithm
    bn = set(batch_norm_entries(a.model))
    assert set(a.local.names) == bn - {n for n in bn if n.endswith("num_batches_tracked")}
    assert not set(a.shared.names) & bn
    msg = a.server_message(state.server, 0)
    assert set(msg.tensors) == {"weights", "generator"}
    # bytes: down the shared weights, the generator and the round; up the same plus the sample count and loss
    per_client = 4 * (a.shared.size + a.gen_state.size)
    assert state.rows[0]["bytes_down"] == 3 * (per_client + 8)
    assert state.rows[0]["bytes_up"] == 3 * (per_client + 16)
    for cid, client in state.clients.items():   # RTNet and prototypes stay on the client, and differ per client
        assert set(client) == {"local", "rtnet", "prototypes"}
        assert client["prototypes"].abs().sum() > 0
    assert not torch.equal(state.clients[0]["rtnet"], state.clients[1]["rtnet"])
    assert "mmd_real_synthetic" in state.rows[0] and state.rows[0]["mmd_real_synthetic"] > 0


def test_the_server_averages_the_generator_by_sample_count():
    a, state, _, _ = _ready()
    from fedlab_core.algorithms.base import Message
    g1, g2 = torch.ones(a.gen_state.size), 3 * torch.ones(a.gen_state.size)
    w = state.server["weights"]
    uploads = [(0, Message({"weights": w, "generator": g1}, num_samples=10)),
               (1, Message({"weights": w, "generator": g2}, num_samples=30))]
    server = a.aggregate(state.server, uploads, 1)
    assert torch.allclose(server["generator"], torch.full_like(g1, 2.5)) and server["round"] == 1
    assert a.server_message(server, 0).metrics["round"] == 2


def test_the_code_variant_keeps_all_of_batch_norm_local_as_the_codes_server_does():
    # the code's "no_bn_running_stats" mode skips every "bn" key: 'no_bn' is a substring of its name
    locals_ = {}
    for variant in ("paper", "code"):
        sim = _sim(FRAug(variant=variant))
        sim.initial_state()
        locals_[variant] = set(sim.algorithm.local.names)
        assert not set(sim.algorithm.shared.names) & set(batch_norm_entries(sim.algorithm.model))
    assert locals_["code"] == locals_["paper"] and any(n.endswith(".weight") for n in locals_["code"])


def test_a_client_uses_the_generator_the_server_sent():
    a, state, x, y = _ready()
    sent = a.server_message(state.server, 0)
    other = dict(sent.tensors, generator=torch.zeros_like(sent.tensors["generator"]))
    runs = []
    for tensors in (sent.tensors, other):
        msg = dataclasses.replace(sent, tensors=tensors)
        upload, _ = a.local_update(msg, {k: v.clone() for k, v in state.clients[0].items()},
                                   a.federation.clients[0], client_generator(0, 1, 0))
        runs.append(upload.tensors["weights"])
    assert not torch.equal(*runs)


def test_refuses_a_model_without_batch_norm():
    with pytest.raises(ValueError, match="batch-norm"):
        Simulation(FRAug(), _fed(), build_model("mlp", (1, 8, 8), 10), seed=0, num_rounds=1, progress=False)


def _numbers(state):
    nan = lambda v: "nan" if isinstance(v, float) and math.isnan(v) else v
    return [{k: nan(v) for k, v in r.items() if not k.endswith("seconds")} for r in state.rows]


def test_runs_repeat_and_resume_bit_identically_and_learn():
    fed = _fed(4)
    make = lambda rounds: _sim(FRAug(Training(lr=0.1, local_steps=3)), fed, num_rounds=rounds, clients_per_round=2)
    full, again = make(3).run(), make(3).run()
    assert _numbers(full) == _numbers(again)
    killed = make(3)   # the schedule depends on R: the run is stopped after its first of three rounds
    first = killed.initial_state()
    killed.run_round(first)
    buffer = io.BytesIO()
    torch.save(dataclasses.asdict(first), buffer)
    buffer.seek(0)
    resumed = make(3).run(SimulationState(**torch.load(buffer, weights_only=False)))
    assert _numbers(resumed) == _numbers(full)
    state = _sim(FRAug(Training(lr=0.1)), _fed(4), num_rounds=6, eval_every=6).run()
    assert state.rows[-1]["mean_client_accuracy"] > 0.6


def test_the_same_numbers_whatever_the_worker_count():
    config = RunConfig(dataset="digits", model="mlp_bn", algorithm="fraug", num_clients=3, num_rounds=2,
                       local_steps=3, batch_size=32, lr=0.1, seed=1)
    rows = [_numbers(build(config, torch.device("cpu"), progress=False, workers=w).run()) for w in (1, 2)]
    assert rows[0] == rows[1]


@pytest.mark.parametrize("name,value", [("alpha", 3.0), ("beta", 3.0), ("latent", 7), ("aux_lr", 0.2), ("gamma", 0.5),
                                        ("variant", "code"), ("smoothing", False), ("rtnet", False),
                                        ("prototypes", False), ("ema", 0.9), ("ramp_rounds", 0),
                                        ("loss_weights", (0.5, 0.25, 0.25)), ("rt_full", True)])
def test_every_parameter_changes_what_a_client_uploads(name, value):
    def upload(**params):
        a, state, _, _ = _ready(FRAug(Training(lr=0.1, local_steps=3), **params), round_idx=2)
        msg = dataclasses.replace(a.server_message(state.server, 0), metrics={"round": 2})
        up, _ = a.local_update(msg, state.clients[0], a.federation.clients[0], client_generator(0, 2, 0))
        return up.tensors

    base, changed = upload(), upload(**{name: value})
    assert any(base[k].shape != changed[k].shape or not torch.equal(base[k], changed[k]) for k in base), name


# ------------------------------------------------------------------------ Table 1: the head fine-tuning study

def test_head_finetuning_trains_on_a_tenth_reads_its_run_like_any_other_and_tunes_the_head_on_all(tmp_path, monkeypatch):
    from fedlab_core.finetune import head_finetuning

    monkeypatch.setenv("FEDLAB_CACHE_DIR", str(tmp_path))
    config = RunConfig(dataset="digits", model="mlp", num_clients=3, num_rounds=2, local_steps=3, batch_size=32,
                       lr=0.1, momentum=0.5, seed=0)
    table = head_finetuning(config, fraction=0.1, epochs=3)
    fed = build(config, torch.device("cpu"), progress=False).federation
    assert list(table["finetuned_on"]) == [c.num_train for c in fed.clients]           # all of each client's data
    assert all(abs(t - 0.1 * n) <= 10 for t, n in zip(table["trained_on"], table["finetuned_on"]))
    assert table[["before", "after"]].apply(lambda s: s.between(0, 1)).all().all()
    assert (table["after"] != table["before"]).any()
    # a chapter whose runs monitor validation sets of unused images still trains on a tenth of each client's data
    unused = head_finetuning(config.replace(max_train_samples=600, validation_monitor=1.0, validation_source="unused"),
                             fraction=0.1, epochs=1)
    assert all(abs(t - 0.1 * n) <= 10 for t, n in zip(unused["trained_on"], unused["finetuned_on"]))
    monkeypatch.setattr(Simulation, "run_round", lambda *a, **k: pytest.fail("the Single run was trained again"))
    again = head_finetuning(config, fraction=0.1, epochs=3)      # the run and its final state come from the cache
    assert again.equals(table)
    with pytest.raises(ValueError, match="^fraction"):
        head_finetuning(config, fraction=1.0)
