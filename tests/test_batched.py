"""The batched executor (fedlab_core.batched) computes the loop's local updates: for every method it batches,
both agree round by round on unequal shards with momentum and weight decay on; its runs are deterministic and
resume from a checkpoint to the same numbers; a run it cannot train falls back to the loop and says so once;
a bad `executor` is refused in one line."""
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from fedlab_core import RunConfig, run
from fedlab_core import __main__ as cli
from fedlab_core.algorithms import ALGORITHMS, Algorithm, NonFiniteLossError
from fedlab_core.engine import Simulation
from fedlab_core import batched
from fedlab_core.runs import build, run_many

CPU = torch.device("cpu")
# unequal Dirichlet shards, two passes of batch 16 (a shorter last batch per pass), momentum and weight decay
CASE = RunConfig(dataset="digits", model="mlp", num_clients=5, num_rounds=3, batch_size=16, lr=0.05, local_epochs=2,
                 momentum=0.9, weight_decay=1e-3, partition="dirichlet", alpha=0.3, seed=0)
BATCHED = sorted(name for name, cls in ALGORITHMS.items() if cls.batched)
# each method's case: FedProx with a proximal pull; SCAFFOLD without momentum, which its option II assumes (with
# momentum 0.9 this case diverges, weights past 13 by round 4, and the executors' 1e-7 differences grow with it)
CHANGES = {"fedprox": {"algorithm_params": {"mu": 0.1}}, "scaffold": {"momentum": 0.0}, "fedbn": {"model": "mlp_bn"},
           "partialfed": {"model": "mlp_bn"},
           "fedfa": {"dataset": "fashion_mnist", "model": "lenet5", "max_train_samples": 400, "max_test_samples": 200,
                     "lr": 0.02}}
# FedFA re-styles convolutional maps (LeNet-5's; the Digits CNN's batch norm on this case's small batches parts even
# FedAvg's two executors by far more than their last bits within a round). Dividing by a map's instance std amplifies
# the last bits: at lr 0.05 the loop itself, at one thread and at two, differs by 1.3e-5 after one round and 9e-3
# after three; at 0.02 its executors agree to 6e-8 every round
# The stated tolerance: parameters (server weights and every client state) within 1e-5 after each round, the
# mean training loss within 1e-5 relative, accuracies equal to 3 decimals. On this CPU the MLP's parameters
# agree bit for bit and LeNet-5's to 3e-8; the losses differ in the last digits (a vectorised reduction).
PARAM_TOL, LOSS_RTOL = 1e-5, 1e-5
# With batch norm the batched executor computes a batch's statistics by its own formula (over the real samples of
# a padded batch): one step agrees to 1e-7, but small batches' normalisation amplifies it, to about 1e-5 of the
# parameters' scale after three rounds here; the stated tolerance is 1e-4 of that scale.
BN_TOL = 1e-4


def _tensors(state) -> torch.Tensor:
    """Every floating-point tensor of a simulation state (server and clients, in nested dicts too: pFedHN's
    hypernetwork and its optimiser), flattened into one vector."""
    def floats(value):
        if isinstance(value, dict):
            return [t for k in value for t in floats(value[k])]
        return [value] if torch.is_tensor(value) and value.is_floating_point() else []
    parts = floats(state.server) + [t for cid in sorted(state.clients) for t in floats(state.clients[cid])]
    return torch.cat([t.reshape(-1) for t in parts])


def _rounds(config: RunConfig) -> tuple[list[dict], list[torch.Tensor]]:
    """The run's log rows and its state's tensors after every round."""
    sim = build(config, CPU, progress=False)
    after = []
    state = sim.run(on_round_end=lambda s: after.append(_tensors(s).clone()))
    return state.rows, after


def _agree(config: RunConfig, rounds: int | None = None) -> tuple[list[dict], list[dict]]:
    """Assert the batched and loop runs of `config` agree round by round (the first `rounds`; None: all);
    return both runs' log rows."""
    (loop_rows, loop_params), (rows, params) = _rounds(config), _rounds(config.replace(executor="batched"))
    assert len(loop_rows) == len(rows) == len(loop_params) == len(params)
    norms = config.model in ("mlp_bn", "lenet5_bn")
    for a, b, pa, pb in list(zip(loop_rows, rows, loop_params, params))[:rounds]:
        diff = (pa - pb).abs().max().item()
        tol = BN_TOL * max(1.0, pa.abs().max().item()) if norms else PARAM_TOL
        assert diff <= tol, f"round {a['round']}: parameters differ by {diff}"
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=LOSS_RTOL, nan_ok=True)
        for metric in ("mean_client_accuracy", "global_accuracy"):  # NaN global accuracy: no global model
            assert math.isnan(a[metric]) and math.isnan(b[metric]) or round(a[metric], 3) == round(b[metric], 3)
    return loop_rows, rows


def test_the_case_has_unequal_shards_so_clients_stop_at_different_steps():
    sizes = [c.num_train for c in build(CASE, CPU, progress=False).federation.clients]
    assert len(set(sizes)) == len(sizes), sizes  # and so different numbers of batches and last-batch sizes


# Ten rounds of MOON (mu 5) with momentum 0.9 on this case amplify the last bit of a float: the loop itself at one
# thread and at two parts from round 6 and ends 0.7 points apart; without momentum its parameters agree to 1e-7.
# pFedHN with momentum 0.9 here blows up in round 4 (training loss 0.4 to 17.6, in both executors): from there the
# two runs' 5e-6 differences are chaos; without momentum its parameters agree to 2e-6 after ten rounds
STEADY = {"moon": {"momentum": 0.0}, "pfedhn": {"momentum": 0.0}}


@pytest.mark.parametrize("algorithm", BATCHED)
def test_batched_and_loop_agree_round_by_round_and_within_half_a_point_after_ten_rounds(algorithm):
    # one pair of ten-round runs: its first three rounds within the stated tolerance, its final mean client
    # accuracy within half a point; a method STEADY changes is held to the three rounds with momentum apart
    assert {"fedavg", "fedprox", "single"} <= set(BATCHED)
    config = CASE.replace(algorithm=algorithm, **CHANGES.get(algorithm, {}))
    ten = config.replace(num_rounds=10, **STEADY.get(algorithm, {}))
    if algorithm in STEADY:
        _agree(config)
        loop, batched = (_rounds(c)[0] for c in (ten, ten.replace(executor="batched")))
    else:
        loop, batched = _agree(ten, rounds=CASE.num_rounds)
    assert len(loop) == len(batched) == 10
    assert abs(loop[-1]["mean_client_accuracy"] - batched[-1]["mean_client_accuracy"]) <= 0.005


def test_batched_and_loop_agree_with_convolutions_and_local_steps():
    config = CASE.replace(dataset="fashion_mnist", model="lenet5", max_train_samples=400, max_test_samples=200,
                          num_rounds=2, local_epochs=None, local_steps=12, algorithm="fedprox", algorithm_params={"mu": 0.1})
    _agree(config)


@pytest.mark.parametrize("changes", [
    {"model": "mlp_bn"},
    # 2-d norms after convolutions; one round: training this CNN amplifies the last bit of a float (the loop
    # itself, started 1e-8 away, parts by as much by round 2), as the Digits CNN does from round 1 on 8x8 digits
    {"model": "lenet5_bn", "dataset": "fashion_mnist", "max_train_samples": 600, "max_test_samples": 200,
     "num_clients": 3, "num_rounds": 1, "local_epochs": 1},
])
def test_batched_and_loop_agree_with_batch_norm(changes):  # each client's running statistics, its real samples'
    _agree(CASE.replace(**changes))                          # batch statistics


# MOON with batch norm and momentum 0.9 amplifies the last bit by round 3 here (the loop at one thread and at two:
# 3e-4 apart at round 3, 0.27 at round 4; batched and loop 1e-4, 1e-2); without momentum they agree to 3e-6
@pytest.mark.parametrize("changes", [{"model": "mlp_bn", "momentum": 0.0}, {"algorithm_params": {"projection_dim": 0}}])
def test_moons_global_and_previous_models_are_each_clients_own(changes):  # its frozen models, batch norm in eval mode
    _agree(CASE.replace(algorithm="moon", **changes))


# with batch norm (two passes a step, its statistics fixed in the offset step) and momentum 0.9 the loop at one
# thread and at two parts by 1e-3 at round 2 here; without momentum both executors agree to 4e-7
@pytest.mark.parametrize("changes", [
    {"model": "mlp_bn", "momentum": 0.0}, {"algorithm_params": {"joint": True}}, {"algorithm_params": {"aggregation": "avg"}},
    {"algorithm_params": {"offset_lr": 0.5}}])
def test_distrans_offsets_step_with_the_model_for_each_client(changes):
    _agree(CASE.replace(algorithm="distrans", **changes))


def test_batched_and_loop_agree_with_adam():  # its moving averages and bias corrections, weight decay included
    _agree(CASE.replace(optimizer="adam", lr=0.005))


@pytest.mark.parametrize("augment", ["fedrdn", "mixup", "naivemix", "normalize"])
def test_batched_and_loop_agree_with_an_augmentation(augment):
    _agree(CASE.replace(augment=augment))


def test_batched_and_loop_agree_with_a_training_transform():
    _agree(CASE.replace(train_transform="flip_rotate"))  # its draws interleave with the batches' permutations


def test_a_diverging_batched_run_stops_where_the_loop_does():
    errors = []
    for executor in ("loop", "batched"):
        with pytest.raises(NonFiniteLossError) as err:
            run(CASE.replace(lr=50.0, executor=executor), use_cache=False, progress=False, workers=1)
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "client 1 in round 3" in errors[0]


def test_clients_in_chunks_train_as_they_do_together(monkeypatch):
    together = _rounds(CASE.replace(executor="batched"))
    monkeypatch.setattr("fedlab_core.batched.CHUNK", {"cpu": 2})
    chunked = _rounds(CASE.replace(executor="batched"))
    assert all((a - b).abs().max() <= PARAM_TOL for a, b in zip(together[1], chunked[1], strict=True))


def test_steps_padded_to_a_fixed_width_give_each_client_its_own_numbers(monkeypatch):
    plain = _rounds(CASE.replace(executor="batched"))
    monkeypatch.setattr("fedlab_core.batched.WIDTH", {"cpu": 3})  # 5 clients: calls of 3, the second padded by one
    padded = _rounds(CASE.replace(executor="batched"))
    assert _numbers(plain[0]) == _numbers(padded[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], padded[1], strict=True))


@pytest.mark.parametrize("algorithm", ["fedprox", "moon", "distrans"])
def test_batched_runs_are_bit_identical(algorithm):
    a, b = (_rounds(CASE.replace(algorithm=algorithm, executor="batched")) for _ in range(2))
    assert _numbers(a[0]) == _numbers(b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def _numbers(rows):
    return [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in rows]


class _Stop(Exception):
    pass


@pytest.mark.parametrize("algorithm", ["fedavg", "moon", "distrans"])  # their previous models, their offsets
def test_a_batched_run_resumes_from_its_checkpoint_to_the_same_numbers(algorithm, tmp_path, monkeypatch):
    config = CASE.replace(num_rounds=4, executor="batched", algorithm=algorithm)
    original = Simulation.run_round

    def run_round(self, state):  # the run dies after two rounds, its checkpoint written
        if state.next_round > 2:
            raise _Stop
        return original(self, state)
    with monkeypatch.context() as m:
        m.setattr(Simulation, "run_round", run_round)
        with pytest.raises(_Stop):
            run(config, cache_dir=tmp_path, progress=False, workers=1)
    resumed = run(config, cache_dir=tmp_path, progress=False, workers=1)
    assert resumed.meta["resumed_from_round"] == 2
    whole = run(config, use_cache=False, progress=False, workers=1)
    assert _numbers(resumed.rounds) == _numbers(whole.rounds) and resumed.final == whole.final


@pytest.mark.parametrize("changes, reason", [
    ({"algorithm": "fraug", "model": "mlp_bn"}, "'fraug' has a local step of its own"),
    ({"augment": "advprop", "model": "mlp_bn"}, "augmentation AdvProp"),
])
def test_a_run_it_cannot_batch_trains_in_the_loop_and_says_so_once(changes, reason, caplog):
    config = CASE.replace(num_rounds=2, **changes)
    with caplog.at_level(logging.WARNING, logger="fedlab_core"):
        batched = _rounds(config.replace(executor="batched"))
    said = [r.getMessage() for r in caplog.records if "executor" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and said[0].startswith("executor: ") and reason in said[0], said
    loop = _rounds(config)
    assert _numbers(batched[0]) == _numbers(loop[0])  # the loop's own numbers


def test_every_batched_method_keeps_the_base_local_step():  # its loss may be its own (MOON's), or its step rule
    for name in BATCHED:
        cls = ALGORITHMS[name]
        for method in ("local_update", "train_local", "train_step", "make_optimizer", "batches"):
            if method == "train_step" and cls.step_rule is not Algorithm.step_rule:
                continue  # the loop's form of its step rule (pFedMe's)
            assert getattr(cls, method) is getattr(Algorithm, method), f"{name} overrides {method}"


@pytest.mark.parametrize("algorithm", BATCHED)
def test_every_trained_parameter_of_a_batched_method_is_reached_by_its_loss(algorithm):
    # the batched executor steps every trained parameter (weight decay and momentum included); the loop's optimiser
    # skips one without a gradient, so a parameter the loss never reaches must not be trained (FedAwS's head bias)
    sim = build(CASE.replace(algorithm=algorithm, **CHANGES.get(algorithm, {})), CPU, progress=False)
    state = sim.initial_state()
    a, data = sim.algorithm, sim.federation.clients[0]
    cid = data.cid
    a.start(a.server_message(state.server, cid), state.clients[cid])
    a.model.train()
    x, y = next(iter(a.batches(data, torch.Generator().manual_seed(0))))
    a.loss(x, y, state.clients[cid]).backward()
    unreached = [n for n, p in a.model.named_parameters() if p.requires_grad and p.grad is None]
    assert not unreached, f"{algorithm}: its loss does not reach {unreached}"


def test_a_bad_executor_is_refused_in_one_line(capsys):
    with pytest.raises(ValueError, match=r"^executor: .*loop.*batched") as err:
        RunConfig(executor="vmap")
    assert "\n" not in str(err.value)
    assert cli.main(["run", "--executor", "vmap", "--dataset", "digits"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --executor: "), lines


# ------------------------------------------------------------------ runs trained together (runs.run_many)

GRID = [CASE.replace(executor="batched", seed=seed, lr=lr) for seed in (0, 1) for lr in (0.02, 0.05)]


def test_runs_trained_together_are_the_runs_trained_alone(tmp_path):
    grid = GRID + [GRID[0].replace(momentum=0.5, weight_decay=1e-2)]  # its rates in the same program
    together = run_many(grid + [CASE.replace(executor="batched", algorithm="fedprox", algorithm_params={"mu": 0.1})],
                        cache_dir=tmp_path, progress=False)
    for config, history in zip(grid, together):
        alone = run(config, use_cache=False, progress=False, workers=1)
        assert _numbers(history.rounds) == _numbers(alone.rounds), (config.seed, config.lr, config.momentum)
        assert history.meta["trained_together"] == len(grid) and history.meta["executor"] == "batched"
    assert together[-1].meta["trained_together"] == 1  # another method: a group of its own
    assert run_many(GRID, cache_dir=tmp_path)[1].meta["key"] == together[1].meta["key"]  # read back, not re-run


@pytest.mark.parametrize("keep,captures", [(batched.KEEP, 1), (0, 3)])
def test_the_graph_setting_reaches_the_steps_and_a_program_is_captured_once_a_run(keep, captures, monkeypatch):
    # CUDA graphs need a GPU (tests/test_cuda.py compares their bits with the eager steps'); here the capture is
    # replaced by the eager function, so the run must give the plain run's numbers, having asked for one capture
    # for its one mapped program (five clients, one optimiser kind) over its three rounds; with no program kept,
    # one a round; and a second run, another algorithm object, captures its own
    plain = _rounds(CASE.replace(executor="batched"))
    captured = []
    monkeypatch.setattr(batched, "_captured", lambda fn: captured.append(fn) or fn)
    monkeypatch.setitem(batched.GRAPHS, "cpu", True)
    monkeypatch.setattr(batched, "KEEP", keep)
    graphed = _rounds(CASE.replace(executor="batched"))
    assert len(captured) == captures
    assert _numbers(plain[0]) == _numbers(graphed[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], graphed[1], strict=True))
    _rounds(CASE.replace(executor="batched"))
    assert len(captured) == 2 * captures


def test_a_program_kept_from_round_to_round_is_not_another_runs_or_shape(monkeypatch):
    # programs kept across runs, batch sizes and seeds: each run's numbers are its own, bit for bit
    monkeypatch.setattr(batched, "KEEP", 0)
    fresh = [_rounds(CASE.replace(executor="batched", **c)) for c in ({}, {"batch_size": 8}, {"seed": 1})]
    monkeypatch.setattr(batched, "KEEP", 4)
    batched.PROGRAMS.clear()
    kept = [_rounds(CASE.replace(executor="batched", **c)) for c in ({}, {"batch_size": 8}, {"seed": 1})]
    for a, b in zip(fresh, kept, strict=True):
        assert _numbers(a[0]) == _numbers(b[0])
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def test_batches_stacked_by_one_indexed_copy_are_each_in_its_place():
    # two clients of batch size 3: two full batches and a short one; one short batch
    # (each with a method's draws, FedFA's coin and noise: padded like the batch)
    def batch(value, n):
        return (torch.full((n, 2), value), torch.full((n,), int(value)),
                {"noise": torch.full((n, 2, 4), -value), "coin": torch.full((n,), value > 1)})
    batches = [[batch(1.0, 3), batch(2.0, 3), batch(3.0, 1)], [batch(4.0, 2)]]
    x, y, real, draws = batched._stacked(batches, 3)
    assert x.shape == (2, 3, 3, 2) and y.shape == (2, 3, 3) and real.shape == (2, 3, 3)
    assert list(draws) == ["coin", "noise"] and draws["noise"].shape == (2, 3, 3, 2, 4)
    assert torch.equal(draws["noise"][..., 0, 0], -y.float()) and torch.equal(draws["coin"], y > 1)
    assert y.tolist() == [[[1, 1, 1], [2, 2, 2], [3, 0, 0]], [[4, 4, 0], [0, 0, 0], [0, 0, 0]]]
    assert real.tolist() == [[[True] * 3, [True] * 3, [True, False, False]],
                             [[True, True, False], [False] * 3, [False] * 3]]
    assert torch.equal(x[..., 0], y.float()) and torch.equal(x[..., 1], y.float())


def test_a_grids_rates_step_in_one_program_and_another_optimiser_kind_in_its_own():
    kinds = [("sgd", 0.02, 0.9, 1e-3), ("sgd", 0.05, 0.5, 1e-2), ("sgd", 0.1, 0.0, None), ("adam", 0.001, None, None)]
    algorithms = [SimpleNamespace(training=SimpleNamespace(optimizer=o, lr=lr, momentum=m, weight_decay=wd))
                  for o, lr, m, wd in kinds]
    # longest first within each program; no momentum, or Adam, is another program
    assert batched._calls(algorithms, [[0] * 2, [0] * 3, [0], [0]], CPU) == [[1, 0], [2], [3]]


# their initialisation draws (MOON's head, the offsets); FedFA's draws, statistics and received variances
@pytest.mark.parametrize("algorithm", ["moon", "distrans", "fedfa"])
def test_runs_initialised_by_their_method_trained_together_are_the_runs_trained_alone(algorithm):
    grid = [CASE.replace(executor="batched", algorithm=algorithm, num_rounds=2, seed=seed, **CHANGES.get(algorithm, {}))
            for seed in (0, 1)]
    for config, history in zip(grid, run_many(grid, use_cache=False)):
        alone = run(config, use_cache=False, progress=False, workers=1)
        assert _numbers(history.rounds) == _numbers(alone.rounds), config.seed


def test_a_diverging_run_ends_alone_and_the_others_go_on():
    configs = [GRID[0], GRID[1].replace(lr=50.0)]
    histories = run_many(configs, use_cache=False, on_diverge="record")
    assert histories[1].meta["diverged"] and "client 1 in round 3" in histories[1].meta["diverged"]
    assert not histories[0].meta["diverged"] and len(histories[0].rounds) == CASE.num_rounds
    with pytest.raises(NonFiniteLossError):
        run_many(configs, use_cache=False)


def test_runs_trained_together_resume_from_their_checkpoints(tmp_path, monkeypatch):
    configs = [c.replace(num_rounds=4) for c in GRID[:2]]
    original = Simulation.end_round

    def end_round(self, state, *args):  # the group dies in its third round, two checkpoints written per run
        if state.next_round > 2:
            raise _Stop
        return original(self, state, *args)
    with monkeypatch.context() as m:
        m.setattr(Simulation, "end_round", end_round)
        with pytest.raises(_Stop):
            run_many(configs, cache_dir=tmp_path)
    resumed = run_many(configs, cache_dir=tmp_path)
    whole = run_many(configs, use_cache=False)
    for a, b in zip(resumed, whole, strict=True):
        assert a.meta["resumed_from_round"] == 2 and _numbers(a.rounds) == _numbers(b.rounds)


def test_a_run_it_cannot_batch_takes_its_rounds_in_the_loop_beside_the_batched_ones():
    configs = [GRID[0], CASE.replace(algorithm="fraug", model="mlp_bn", executor="batched")]
    histories = run_many(configs, use_cache=False)
    assert [h.meta["executor"] for h in histories] == ["batched", "loop"]
    alone = run(configs[1], use_cache=False, progress=False, workers=1)
    assert _numbers(histories[1].rounds) == _numbers(alone.rounds)


def test_auto_is_the_loop_on_a_cpu():
    history = run(CASE.replace(num_rounds=1), use_cache=False, progress=False, workers=1)
    assert RunConfig().executor == "auto" and history.meta["executor"] == "loop"


def test_a_subclass_with_a_local_update_of_its_own_is_not_batched():
    class Mine(ALGORITHMS["fedavg"]):  # a lab's student version, say: not batched unless it says so
        def local_update(self, message, client_state, data, rng):
            return super().local_update(message, client_state, data, rng)

    class Claimed(Mine):  # says so, but its step is not the base one
        batched = True
    model = torch.nn.Linear(2, 2)
    assert not Mine.batched and batched.unsupported(Mine(), model) == "'fedavg' has a local step of its own"
    assert batched.unsupported(Claimed(), model).startswith("'fedavg' has a local step of its own (local_update")
    assert batched.unsupported(ALGORITHMS["fedavg"](), model) is None


def test_a_sweep_on_a_gpu_trains_each_grid_together_and_returns_the_runs_in_order(monkeypatch):
    from fedlab_core import sweeps

    asked = []

    def run_many(configs, **kwargs):  # what the GPU would compute, recorded
        asked.append(list(configs))
        return [f"{c.algorithm} {c.seed} {c.lr}" for c in configs]
    monkeypatch.setattr(sweeps, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(sweeps, "run_many", run_many)
    prox = CASE.replace(algorithm="fedprox", algorithm_params={"mu": 0.1})
    configs = [GRID[0], prox, *GRID[1:]]
    out = sweeps.sweep(configs, use_cache=False, device="cuda")
    assert asked == [GRID, [prox]]  # the grid's rates and seeds together, the other method apart
    assert out == [f"{c.algorithm} {c.seed} {c.lr}" for c in configs]


def test_a_client_failing_after_its_start_fails_alone_and_the_others_keep_their_own_context(monkeypatch):
    # SCAFFOLD after a round: each client's control variate, its context, is its own
    sim = build(CASE.replace(executor="batched", algorithm="scaffold", momentum=0.0), CPU, progress=False)
    state = sim.initial_state()
    sim.run_round(state)
    selected, messages = sim.messages(state)
    alone = batched.local_updates([t for t in sim.tasks(state, selected, messages) if t[1].cid != 1])
    drawn = batched._drawn

    def failing(algorithm, data, rng):
        if data.cid == 1:
            raise RuntimeError("no batches for client 1")
        return drawn(algorithm, data, rng)

    monkeypatch.setattr(batched, "_drawn", failing)
    results = batched.local_updates(sim.tasks(state, selected, messages))
    assert not results[1][0] and "client 1" in str(results[1][1])
    others = [r for cid, r in zip(selected, results) if cid != 1]
    for (ok, (upload, client)), (_, (upload_alone, client_alone)) in zip(others, alone, strict=True):
        assert ok and torch.equal(client["control"], client_alone["control"])
        assert all(torch.equal(v, upload_alone.tensors[k]) for k, v in upload.tensors.items())
