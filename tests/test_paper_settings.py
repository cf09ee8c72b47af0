"""Every method runs with its own paper's settings unless a run says otherwise; the tuning picks one rate
per method on validation data; the validation split never touches the test sets."""
import math

import pytest
import torch

from fedlab_core import RunConfig, run
from fedlab_core.algorithms import ALGORITHMS, Message, Training
from fedlab_core.algorithms.fedaws import FedAwS, spreadout_step
from fedlab_core.data import federate, hold_out, load_dataset, monitor_unused, unused_domain_images, unused_training
from fedlab_core.models import MODELS, build_model, meta_model
from fedlab_core.runs import build
from fedlab_core.store import History
from fedlab_core.tuning import (RATES, SECOND_RATE_GRIDS, SECOND_RATES, SEEDS, Tuning, beyond, candidates, settings_table,
                                  tune, tuned_configs, unsound_cells)

CPU = torch.device("cpu")

# Each method's local training as its paper (or, where noted in its docstring, its authors' code) runs it.
PAPER = {
    "fedavg": Training(local_epochs=5, batch_size=10, lr=0.05),
    "fedprox": Training(local_epochs=20, batch_size=10, lr=0.03),
    "fedavgm": Training(local_epochs=1, batch_size=64, lr=0.05),
    "fednova": Training(local_epochs=2, batch_size=32, lr=0.02, momentum=0.9, weight_decay=1e-4),
    "scaffold": Training(local_epochs=1, batch_size=32, lr=0.05),
    "moon": Training(local_epochs=10, batch_size=64, lr=0.01, momentum=0.9, weight_decay=1e-5),
    "fedbn": Training(local_epochs=1, batch_size=32, lr=0.01),
    "pfedme": Training(local_steps=20, batch_size=20, lr=0.005),
    "pfedhn": Training(local_steps=50, batch_size=64, lr=5e-3, momentum=0.9, weight_decay=5e-5),
    "fedaws": Training(local_epochs=5, batch_size=10, lr=0.05),
    "fedproto": Training(local_epochs=1, batch_size=4, lr=0.01, momentum=0.5),
    "fedproto_shared": Training(local_epochs=5, batch_size=32, lr=0.01, weight_decay=1e-5),
    "fedfa": Training(local_epochs=1, batch_size=32, lr=0.01),
    "partialfed": Training(local_epochs=5, batch_size=10, lr=0.05),
    "pfedavg": Training(local_steps=20, batch_size=64, lr=0.01, momentum=0.5),
    "single": Training(local_steps=20, batch_size=64, lr=0.01, momentum=0.5),
    "all": Training(local_steps=20, batch_size=64, lr=0.01, momentum=0.5),
    "distrans": Training(local_epochs=1, batch_size=32, lr=5e-3),
    "fraug": Training(local_steps=20, batch_size=64, lr=0.01, momentum=0.5),
}
PARAMS = {"fedprox": {"mu": 1.0}, "moon": {"mu": 5.0, "temperature": 0.5, "projection_dim": 256},
          "pfedme": {"lam": 15.0, "K": 5, "beta": 1.0, "personal_lr": 0.09, "sample_weighted": False},
          "pfedhn": {"server_lr": 1e-2, "server_momentum": 0.9, "server_weight_decay": 1e-3, "grad_clip": 50.0},
          "scaffold": {"server_lr": 1.0, "sample_weighted": False}, "fedproto": {"mu": 1.0, "distance": "mse"},
          "fedfa": {"p": 0.5, "momentum": 0.99}, "fedavgm": {"server_momentum": 0.9, "server_lr": 1.0},
          "distrans": {"alpha": 0.3, "offset_lr": 1e-3}, "fedaws": {"server_steps": 1},
          "fraug": {"alpha": 1.0, "beta": 1.0, "aux_lr": 0.05, "ema": 0.3}}
MODEL_FOR = {"fedbn": "mlp_bn", "partialfed": "mlp_bn", "fraug": "mlp_bn", "fedfa": "digit"}


def test_every_algorithm_declares_the_settings_of_its_paper():
    assert set(PAPER) == set(ALGORITHMS)
    for name, cls in ALGORITHMS.items():
        assert cls.paper_training == PAPER[name], name
        made = cls()
        for key, value in PARAMS.get(name, {}).items():
            assert getattr(made, key) == value, (name, key)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_run_uses_the_methods_own_settings_unless_it_says_otherwise(name):
    partition = "one_class" if name == "fedaws" else "iid"
    own = RunConfig(dataset="digits", model=MODEL_FOR.get(name, "mlp"), num_clients=4, algorithm=name,
                    partition=partition)
    assert own.training() == PAPER[name]
    assert build(own, CPU, progress=False).algorithm.training == PAPER[name]  # what the client trains with
    set_here = own.replace(lr=0.123, batch_size=7)
    assert build(set_here, CPU, progress=False).algorithm.training == Training(
        **{**PAPER[name].__dict__, "lr": 0.123, "batch_size": 7})


def test_changing_the_algorithm_never_carries_another_methods_rate():
    fedavg = RunConfig(dataset="digits", model="mlp")
    assert fedavg.replace(algorithm="pfedme").training().lr == 0.005
    assert fedavg.replace(algorithm="pfedme").training().local_steps == 20
    assert fedavg.replace(lr=0.2).replace(algorithm="pfedme").training().lr == 0.2  # set on purpose: kept


def test_the_run_records_the_training_it_used(tiny, tmp_path):
    history = run(tiny.replace(algorithm="moon", lr=None), cache_dir=tmp_path, progress=False)
    assert history.meta["training"] == {**PAPER["moon"].__dict__, "local_epochs": 1, "batch_size": 32}


# ------------------------------------------------------------------------------ the validation split

def test_the_validation_split_is_held_out_of_each_clients_training_data():
    data = load_dataset("digits")
    fed = federate(data, "dirichlet", 4, 0, alpha=0.5, min_size=10)
    held = hold_out(fed, 0.25, seed=3)
    for before, after in zip(fed.clients, held.clients):
        n = before.num_train
        assert after.num_train + len(after.y_test) == n
        # the two parts are disjoint and together are the client's training data, row for row
        rows = torch.cat([after.x_train, after.x_test]).flatten(1)
        assert torch.equal(torch.sort(rows.sum(1)).values, torch.sort(before.x_train.flatten(1).sum(1)).values)
        for c in before.y_train.unique():  # stratified: every class with two samples is on both sides
            if (before.y_train == c).sum() >= 2:
                assert (after.y_test == c).any() and (after.y_train == c).any()
    test_rows = {tuple(r.tolist()) for r in data.x_test.flatten(1)[:200]}
    assert not any(tuple(r.tolist()) in test_rows for r in held.x_test.flatten(1))  # no test image
    assert torch.equal(held.y_test, torch.cat([c.y_test for c in held.clients]))
    assert held.class_counts.sum() == sum(c.num_train for c in held.clients)
    again = hold_out(fed, 0.25, seed=3)
    assert all(torch.equal(a.y_test, b.y_test) for a, b in zip(held.clients, again.clients))


def test_one_class_validation_shares_get_as_many_negatives_as_their_test_sets_held_out_by_other_clients():
    data = load_dataset("digits")
    fed = federate(data, "one_class", 10, 0)
    held = hold_out(fed, 0.25, seed=3, keep_test=True)
    trained_rows = {tuple(r.tolist()) for c in held.clients for r in c.x_train.flatten(1)}
    for before, after in zip(fed.clients, held.clients):
        own = set(before.y_train.tolist())
        positives = sum(y in own for y in after.y_val.tolist())
        assert len(own) == 1 and positives == len(after.y_val) - positives > 0     # half its class, half others
        assert after.num_train + positives == before.num_train                       # held out of its own data
        assert not any(tuple(r.tolist()) in trained_rows for r in after.x_val.flatten(1))  # no client trains on them
    again = hold_out(fed, 0.25, seed=3, keep_test=True)
    assert all(torch.equal(a.y_val, b.y_val) for a, b in zip(held.clients, again.clients))


def test_a_run_with_validation_is_evaluated_on_the_held_out_data(tiny):
    history = run(tiny.replace(validation=0.2, num_rounds=1), use_cache=False, progress=False)
    assert history.meta["samples"]["test"] == sum(history.meta["samples"]["client_test"])
    assert history.meta["samples"]["train"] + history.meta["samples"]["test"] == 1347


def test_a_monitored_validation_set_is_held_out_scored_every_evaluation_and_leaves_the_test_set(tiny):
    fed = federate(load_dataset("digits"), "iid", 4, seed=0)
    held = hold_out(fed, 0.25, seed=3, keep_test=True)
    for before, after in zip(fed.clients, held.clients):
        assert torch.equal(after.y_test, before.y_test)                      # the test set stays
        assert after.num_train + len(after.y_val) == before.num_train
        train_rows = {tuple(r.tolist()) for r in after.x_train.flatten(1)}
        assert not any(tuple(r.tolist()) in train_rows for r in after.x_val.flatten(1))
    assert torch.equal(held.y_test, fed.y_test) and held.class_counts.sum() < fed.class_counts.sum()
    history = run(tiny.replace(validation_monitor=0.2, eval_every=1), use_cache=False, progress=False)
    plain = run(tiny.replace(eval_every=1), use_cache=False, progress=False)
    assert history.meta["samples"]["test"] == plain.meta["samples"]["test"]
    for row in history.rounds:
        assert len(row["client_validation_accuracy"]) == 4
        assert all(0 <= a <= 1 for a in row["client_validation_accuracy"])
    assert "client_validation_accuracy" not in plain.rounds[0]
    with pytest.raises(ValueError, match="^validation_monitor: must be 0 when validation"):
        tiny.replace(validation=0.2, validation_monitor=0.2)


def test_an_unused_validation_set_comes_from_training_images_no_client_holds_shaped_like_each_test_set():
    data = load_dataset("digits", max_train=600, max_test=300, seed=4)
    pool_x, pool_y = unused_training("digits", 600, seed=4)
    assert len(pool_y) == 1347 - 600
    held_rows = {tuple(r.tolist()) for r in data.x_train.flatten(1)}
    assert not any(tuple(r.tolist()) in held_rows for r in pool_x.flatten(1))       # the subset's complement
    for scheme, options in (("dirichlet", {"alpha": 0.3, "min_size": 10}), ("one_class", {})):
        fed = federate(data, scheme, 10 if scheme == "one_class" else 4, 4, **options)
        monitored = monitor_unused(fed, pool_x, pool_y, 1.0, seed=4)
        assert sum(len(c.y_val) for c in monitored.clients) == sum(len(c.y_test) for c in fed.clients)
        for before, after in zip(fed.clients, monitored.clients):
            assert torch.equal(after.x_train, before.x_train) and torch.equal(after.y_test, before.y_test)
            # its validation set follows its test set class by class; one class per client: as many negatives,
            # drawn at random from the other classes
            own = before.y_train[0]
            if scheme == "one_class":
                assert (after.y_val == own).sum() == (before.y_test == own).sum() == (after.y_val != own).sum() > 0
            else:
                assert torch.equal(torch.bincount(after.y_val, minlength=10), torch.bincount(before.y_test, minlength=10))
            assert not any(tuple(r.tolist()) in held_rows for r in after.x_val.flatten(1))
        half = monitor_unused(fed, pool_x, pool_y, 0.5, seed=4)
        assert sum(len(c.y_val) for c in half.clients) == pytest.approx(0.5 * sum(len(c.y_test) for c in fed.clients), abs=10)
        again = monitor_unused(fed, pool_x, pool_y, 1.0, seed=4)
        assert all(torch.equal(a.x_val, b.x_val) for a, b in zip(monitored.clients, again.clients))
    with pytest.raises(ValueError, match="^validation_monitor: 1 times the test set needs"):
        monitor_unused(fed, pool_x[:50], pool_y[:50], 1.0, seed=4)


def test_a_run_monitoring_unused_images_trains_and_tests_as_the_run_without_it(tiny):
    plain = run(tiny.replace(max_train_samples=600, eval_every=1), use_cache=False, progress=False)
    monitored = run(tiny.replace(max_train_samples=600, eval_every=1, validation_monitor=1.0,
                                 validation_source="unused"), use_cache=False, progress=False)
    for a, b in zip(plain.rounds, monitored.rounds):            # the same training, scored on one more set
        assert a["client_accuracy"] == b["client_accuracy"] and len(b["client_validation_accuracy"]) == 4
    assert monitored.meta["samples"]["train"] == plain.meta["samples"]["train"]
    for bad, message in ((dict(validation_source="unused"), "^validation_source: 'unused' draws"),
                         (dict(validation_source="unused", validation_monitor=1.0), "^validation_source: 'unused' needs"),
                         (dict(validation_monitor=1.0), "^validation_monitor: a share")):
        with pytest.raises(ValueError, match=message):
            tiny.replace(**bad)


def test_under_the_domain_split_each_client_validates_on_unused_images_of_its_own_domain_shaped_like_its_test_set():
    options = {"samples_per_domain": 40, "test_per_domain": 20}
    data = load_dataset("fashion_mnist_domains", **options)
    fed = federate(data, "domain", 10, 2)                                   # two clients per domain
    pool = unused_domain_images("fashion_mnist_domains", 25, **options)
    monitored = monitor_unused(fed, *pool[:2], 1.0, seed=2, pool_domains=pool[2])
    held = {tuple(r.tolist()) for r in data.x_train.flatten(1)}
    seen = set()
    for before, after in zip(fed.clients, monitored.clients):
        assert torch.equal(after.x_train, before.x_train)
        assert torch.equal(torch.bincount(after.y_val, minlength=10), torch.bincount(before.y_test, minlength=10))
        rows = {tuple(r.tolist()) for r in after.x_val.flatten(1)}
        assert rows <= {tuple(r.tolist()) for r in pool[0][pool[2] == fed.domains.index(before.domain)].flatten(1)}
        assert not rows & held and not rows & seen                           # no client's image, no one else's
        seen |= rows
    with pytest.raises(ValueError, match="^validation_monitor: 2 times client 0's test set needs"):
        monitor_unused(fed, *pool[:2], 2.0, seed=2, pool_domains=pool[2])
    with pytest.raises(ValueError, match="^validation_source: 'unused' under the domain split needs the pool's"):
        monitor_unused(fed, *pool[:2], 1.0, seed=2)
    with pytest.raises(ValueError, match="^validation_source: 'unused' under the domain split draws"):
        unused_domain_images("digits4", 10)
    domains = RunConfig(dataset="fashion_mnist_domains", partition="domain", num_clients=5, model="lenet5_bnfc")
    with pytest.raises(ValueError, match="^validation_source: 'unused' under the domain split needs the embedded"):
        domains.replace(validation_monitor=1.0, validation_source="unused")   # no samples_per_domain: none left out
    domains.replace(validation_monitor=1.0, validation_source="unused", dataset_params=options)


def test_a_domain_run_monitoring_unused_images_trains_and_tests_as_the_run_without_it():
    base = RunConfig(dataset="fashion_mnist_domains", partition="domain", num_clients=5, model="lenet5_bn",
                     dataset_params={"samples_per_domain": 40, "test_per_domain": 20}, num_rounds=2, eval_every=1,
                     local_steps=2, batch_size=16, max_train_samples=0, max_test_samples=0)
    plain = run(base, use_cache=False, progress=False, workers=1)
    monitored = run(base.replace(validation_monitor=1.0, validation_source="unused"), use_cache=False, progress=False,
                    workers=1)
    for a, b in zip(plain.rounds, monitored.rounds):            # the same training, scored on one more set
        assert a["client_accuracy"] == b["client_accuracy"] and len(b["client_validation_accuracy"]) == 5
    assert "client_validation_accuracy" not in plain.rounds[0]
    sim = build(base.replace(validation_monitor=1.0, validation_source="unused"), torch.device("cpu"))
    assert [len(c.y_val) for c in sim.federation.clients] == [len(c.y_test) for c in sim.federation.clients]


# ------------------------------------------------------------------------------------------ the tuning

def test_candidates_multiply_the_paper_rates_and_pair_a_second_rate():
    assert [c["lr"] for c in candidates(RunConfig(algorithm="fedprox"), grid=(1 / 3, 1, 3))] == \
        pytest.approx([0.01, 0.03, 0.09])
    pairs = candidates(RunConfig(algorithm="distrans"), grid=(1, 10))
    offsets = [1e-3 * f for f in SECOND_RATES["distrans"][1]]  # the offset rate's own factors
    assert pairs == [{"lr": lr, "offset_lr": o} for lr in (5e-3, 5e-2) for o in offsets]
    assert max(offsets) >= 1.0  # offsets that move at the book's scale are in reach (see tuning.SECOND_RATES)


def test_tune_picks_the_best_validation_score_on_validation_data_only(tiny, tmp_path):
    base = tiny.replace(lr=None, num_rounds=3)
    tuning = tune(base, {"fedavg": {"algorithm": "fedavg"}, "prox": {"algorithm": "fedprox", "algorithm_params":
                                                                     {"mu": 0.01}}},
                  rounds=2, grid=(0.1, 1.0, 10.0), max_workers=2, cache_dir=tmp_path)
    grid = tuning.grid
    assert len(grid) == 6 and set(grid["method"]) == {"fedavg", "prox"}
    for method, group in grid.groupby("method"):
        best = group.sort_values("validation", ascending=False).iloc[0]
        assert tuning.chosen[method]["lr"] == best["lr"]
        assert group["chosen"].sum() == 1 and group.loc[group["chosen"], "lr"].item() == best["lr"]
    # every candidate ran on the validation split, at the tuning's rounds and seed
    runs = [run(base.replace(num_rounds=2, eval_every=2, validation=0.2, seed=0, lr=lr), cache_dir=tmp_path)
            for lr in grid.loc[grid["method"] == "fedavg", "lr"]]
    assert [h.final["mean_client_accuracy"] for h in runs] == pytest.approx(
        list(grid.loc[grid["method"] == "fedavg", "validation"]))
    with pytest.raises(ValueError, match="^lr: a tuned benchmark"):
        tune(tiny, {"fedavg": {}}, rounds=2)


def test_the_absolute_grid_gives_every_method_the_same_rates_and_pairs_the_second_rates_grid():
    assert [c["lr"] for c in candidates(RunConfig(algorithm="fedprox"), rates=RATES)] == list(RATES)
    assert [c["lr"] for c in candidates(RunConfig(algorithm="moon"), rates=RATES)] == list(RATES)
    pairs = candidates(RunConfig(algorithm="distrans"), rates=(0.01, 0.1))
    assert pairs == [{"lr": lr, "offset_lr": o} for lr in (0.01, 0.1) for o in SECOND_RATE_GRIDS["distrans"][1]]
    assert RATES == (0.003, 0.01, 0.03, 0.1, 0.3)


def test_beyond_steps_past_an_edge_in_the_grids_own_rhythm():
    assert beyond(list(RATES), "low") == 0.001 and beyond(list(RATES), "high") == 1.0
    assert beyond([0.001, 0.003, 0.01], "low") == 0.0003
    assert beyond([0.01, 0.1, 1.0, 10.0], "high") == 100.0
    assert beyond([0.01, 0.1], "high") == 1.0


def _scored_by(monkeypatch, score_of):
    """Make the tuning's sweep return, for each config, a run of five evaluated rounds all at score_of(config)."""
    from fedlab_core import tuning as tuning_module

    def fake(configs, **kwargs):
        return [History(c.to_dict(), [{"round": r, "mean_client_accuracy": score_of(c)} for r in range(1, 6)],
                        {"mean_client_accuracy": score_of(c)}, {"seconds": 1.0}) for c in configs]
    monkeypatch.setattr(tuning_module, "sweep", fake)


def test_the_one_standard_error_rule_picks_the_smallest_rate_within_reach_of_the_best_on_the_tuning_seeds(monkeypatch, tiny):
    # lr 0.1 has the best mean but swings with the seed (one seed near a collapse); 0.03 is within one standard
    # error of it and steady: the rule takes 0.03. 0.01 is steady but clearly worse.
    means = {0.01: 0.60, 0.03: 0.70, 0.1: 0.72, 0.3: 0.10}
    swing = {0.01: 0.005, 0.03: 0.005, 0.1: 0.08, 0.3: 0.0}
    seen = []

    def score_of(c):
        seen.append(c.seed)
        return means[c.lr] + swing[c.lr] * (c.seed - 101)
    _scored_by(monkeypatch, score_of)
    t = tune(tiny.replace(lr=None), {"fedavg": {}}, rounds=10, rates=(0.01, 0.03, 0.1, 0.3), seeds=SEEDS, widen=0)
    assert set(seen) == set(SEEDS) and not set(seen) & {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}   # no evaluation seed
    row = t.grid.set_index("lr").loc[0.1]
    assert row["validation"] == pytest.approx(0.72) and row["validation_se"] == pytest.approx(0.08 / 3 ** 0.5)
    assert t.chosen["fedavg"]["lr"] == 0.03
    curves = t.curves()                                   # the tuning chapter's score-against-rate curve
    assert list(curves["lr"]) == [0.01, 0.03, 0.1, 0.3] and list(curves["chosen"]) == [False, True, False, False]
    # one seed: no standard error, the best score wins, as before
    t1 = tune(tiny.replace(lr=None), {"fedavg": {}}, rounds=10, rates=(0.01, 0.03, 0.1, 0.3), seeds=(101,), widen=0)
    assert t1.chosen["fedavg"]["lr"] == 0.1 and t1.grid["validation_se"].isna().all()
    with pytest.raises(ValueError, match="^seeds: "):
        tune(tiny.replace(lr=None), {"fedavg": {}}, rounds=10, seeds=(100, 100))


def test_a_method_given_its_own_horizon_is_tuned_there_and_the_others_at_the_tunings(monkeypatch, tiny):
    seen = {}

    def score_of(c):
        seen.setdefault(c.algorithm, set()).add((c.num_rounds, c.eval_every))
        return 0.5 + c.lr
    _scored_by(monkeypatch, score_of)
    t = tune(tiny.replace(lr=None), {"fedavg": {}, "prox": {"algorithm": "fedprox", "num_rounds": 40}}, rounds=10,
             rates=(0.01, 0.03), seeds=SEEDS, widen=0)
    assert seen == {"fedavg": {(10, 1)}, "fedprox": {(40, 4)}}     # ten evaluations over each method's own rounds
    assert t.grid.groupby("method")["rounds"].unique().to_dict() == {"fedavg": [10], "prox": [40]}
    assert t.rounds == 10
    _scored_by(monkeypatch, lambda c: float("nan") if c.algorithm == "fedprox" else 0.5)   # every prox seed diverges
    t = tune(tiny.replace(lr=None), {"fedavg": {}, "prox": {"algorithm": "fedprox", "num_rounds": 40}}, rounds=10,
             rates=(0.01, 0.03), seeds=SEEDS, widen=0)
    assert t.unsound() == {"prox": "all 2 of its candidates in the 40-round tuning failed: 2 diverged"}


def test_a_second_rate_given_to_the_tuning_is_tried_with_every_rate_chosen_by_the_rule_and_reaches_the_runs(
        monkeypatch, tiny):
    # pFedMe's inner rate: 0.09 (its paper value) swings with the seed, 0.03 is steady and within one standard
    # error of it, 0.01 clearly worse; the rule takes 0.03, and the runs tuned_configs makes use it
    means, swing, seen = {0.01: 0.60, 0.03: 0.70, 0.09: 0.72}, {0.01: 0.0, 0.03: 0.005, 0.09: 0.08}, set()

    def score_of(c):
        if c.algorithm == "pfedme":
            inner = c.algorithm_params.get("personal_lr", 0.09)
            seen.add((c.lr, inner))
            return means[inner] + swing[inner] * (c.seed - 101)
        return 0.5
    _scored_by(monkeypatch, score_of)
    extra = {"pfedme": ["personal_lr", [0.01, 0.03, 0.09]]}
    t = tune(tiny.replace(lr=None), {"pfedme": {"algorithm": "pfedme"}, "fedavg": {}}, rounds=10, rates=(0.01, 0.03),
             seeds=SEEDS, widen=0, second_rates=extra)
    assert seen == {(lr, p) for lr in (0.01, 0.03) for p in (0.01, 0.03, 0.09)}
    assert t.chosen == {"pfedme": {"lr": 0.01, "personal_lr": 0.03}, "fedavg": {"lr": 0.01}}
    assert t.table().loc["pfedme", "chosen personal_lr"] == 0.03 and "chosen personal_lr" in t.table()
    configs, tuned = tuned_configs({"pfedme": tiny.replace(algorithm="pfedme", lr=None)}, t)
    assert (configs["pfedme"].lr, configs["pfedme"].algorithm_params) == (0.01, {"personal_lr": 0.03})
    assert tuned["pfedme"] == {"lr", "personal_lr"}
    # without it pFedMe keeps its paper value, as before
    assert "personal_lr" not in tune(tiny.replace(lr=None), {"pfedme": {"algorithm": "pfedme"}}, rounds=10,
                                     rates=(0.01, 0.03), seeds=SEEDS, widen=0).grid
    for bad, message in ((extra, "absolute grids of second rates need the absolute grid"),
                         ({"pfedme": ["lam", [1.0]]}, "pfedme has no second rate 'lam'; its rates: personal_lr"),
                         ({"pfedme": ["personal_lr", [0.1, -0.1]]}, "'pfedme' parameter 'personal_lr' must be a number"),
                         ({"nope": ["personal_lr", [0.1]]}, "unknown algorithm 'nope'")):
        with pytest.raises(ValueError, match="^second_rates: " + message.replace("(", r"\(")):
            tune(tiny.replace(lr=None), {"pfedme": {"algorithm": "pfedme"}}, rounds=10, seeds=SEEDS, second_rates=bad,
                 **({} if bad is extra else {"rates": (0.01,)}))


def test_a_horizon_for_nothing_the_page_runs_or_of_no_rounds_is_refused_in_one_line():
    from fedlab_core.notebook import ParameterError, check_horizons

    check_horizons("HORIZONS", {"fedavg": 360}, ["fedavg", "fedfa"], "algorithm")
    with pytest.raises(ParameterError, match=r"^HORIZONS: 'fedprox' names no algorithm of this page \(it runs "
                                             r"fedavg, fedfa\)$"):
        check_horizons("HORIZONS", {"fedprox": 360}, ["fedfa", "fedavg"], "algorithm")
    for cap in (0, 360.0, True, "360"):
        with pytest.raises(ParameterError, match=r"^TEN_HORIZONS: 'fedavg' maps to .*, not a number of rounds"):
            check_horizons("TEN_HORIZONS", {"fedavg": cap}, ["fedavg"], "algorithm")


def test_near_the_best_the_rule_prefers_rates_that_converge_at_the_horizon(monkeypatch, tiny):
    # lr 0.01 and 0.03 still rise by 6 points over the last third of their curves; 0.1 and 0.3 are flat. The
    # plain rule takes 0.03 (within one standard error of the best, smaller); converging rates first, 0.1. The
    # flat 0.3 scores far worse and is never taken.
    from fedlab_core import tuning as tuning_module

    final = {0.01: 0.70, 0.03: 0.71, 0.1: 0.705, 0.3: 0.50}
    rising = {0.01: 0.2, 0.03: 0.2, 0.1: 0.0, 0.3: 0.0}

    def fake(configs, **kwargs):
        out = []
        for c in configs:
            end = final[c.lr] + 0.01 * (c.seed - 101) + (0.15 if c.algorithm == "fedprox" else 0.0) * (c.lr < 0.05)
            slope = rising[c.lr] + (0.2 if c.algorithm == "fedprox" else 0.0)     # FedProx: no rate converges
            rows = [{"round": r, "mean_client_accuracy": end - slope * (10 - r) / 10} for r in range(1, 11)]
            out.append(History(c.to_dict(), rows, {"mean_client_accuracy": end}, {"seconds": 1.0}))
        return out
    monkeypatch.setattr(tuning_module, "sweep", fake)
    methods = {"fedavg": {}, "fedprox": {"algorithm": "fedprox"}}
    kwargs = dict(rounds=10, rates=(0.01, 0.03, 0.1, 0.3), seeds=SEEDS, widen=0)
    plain = tune(tiny.replace(lr=None), methods, **kwargs)
    assert plain.chosen["fedavg"]["lr"] == 0.03 and "converges" not in plain.table()
    t = tune(tiny.replace(lr=None), methods, converging=True, **kwargs)
    assert list(t.grid[t.grid["method"] == "fedavg"]["converges"]) == [False, False, True, True]
    assert t.chosen["fedavg"]["lr"] == 0.1 and t.table().loc["fedavg", "converges"] == "yes"
    # no rate near the best converges: the plain rule's choice, and the table and the page's sentence say so
    assert not t.grid[t.grid["method"] == "fedprox"]["converges"].any()
    assert t.chosen["fedprox"]["lr"] == plain.chosen["fedprox"]["lr"] == 0.03
    assert t.table().loc["fedprox", "converges"] == "no"
    assert t.convergence() == ("For fedprox, no rate within one standard error of the best converged in the tuning's "
                               "10 rounds: it runs at the plain rule's choice.")
    final[0.3] = 0.71                                                  # a flat rate near the best: taken
    assert tune(tiny.replace(lr=None), {"fedavg": {}}, converging=True, **kwargs).chosen["fedavg"]["lr"] == 0.1
    final.update({0.1: 0.60, 0.3: 0.60})                              # flat rates far worse: never taken
    assert tune(tiny.replace(lr=None), {"fedavg": {}}, converging=True, **kwargs).chosen["fedavg"]["lr"] == 0.03
    assert plain.convergence() == "The tuning does not test whether its runs converge."
    with pytest.raises(ValueError, match="^converging: "):
        tune(tiny.replace(lr=None), methods, rounds=10, converging=True)


def test_the_tuning_never_picks_a_rate_whose_runs_are_degenerate_while_a_sound_one_remains(monkeypatch, tiny):
    # lr 0.1 scores best on every seed, but there every client answers with its own class: each client scores
    # the same at every evaluation (the one-class shortcut, on validation data without negatives). The rule passes
    # over it to the best sound rate, 0.03, and the grid says why; were every rate degenerate, the plain rule's
    # choice would stand.
    from fedlab_core import tuning as tuning_module

    means = {0.01: 0.55, 0.03: 0.60, 0.1: 0.64}
    shortcut = {0.1}

    def fake(configs, **kwargs):
        out = []
        for c in configs:
            constant = c.lr in shortcut
            value = means[c.lr] + (0.3 if constant else 0.002 * (c.seed - 101))
            rows = [{"round": r, "mean_client_accuracy": value if constant else value - 0.01 * (10 - r) / 10,
                     "client_accuracy": [value] * 4 if constant else [value - 0.01 * i for i in range(4)]}
                    for r in range(1, 11)]
            out.append(History(c.to_dict(), rows, {"mean_client_accuracy": rows[-1]["mean_client_accuracy"]},
                               {"seconds": 1.0}))
        return out
    monkeypatch.setattr(tuning_module, "sweep", fake)
    kwargs = dict(rounds=10, rates=(0.01, 0.03, 0.1), seeds=SEEDS, widen=0)
    t = tune(tiny.replace(lr=None), {"fedavg": {}}, **kwargs)
    grid = t.grid.set_index("lr")
    assert grid["validation"].idxmax() == 0.1                                        # the shortcut scores best
    assert grid.loc[0.1, "degenerate"].startswith(f"seed {SEEDS[0]} predicts a constant per client")
    assert (grid.loc[[0.01, 0.03], "degenerate"] == "").all()
    assert t.chosen["fedavg"]["lr"] == 0.03 and t.unsound() == {}
    configs = {("fedavg", "80%"): [RunConfig(partition="distrans", dh=0.8)],
               ("fedavg", "100%"): [RunConfig(partition="one_class")]}
    assert unsound_cells(configs, t, method_of=lambda key: key[0]) == {}
    shortcut.update({0.01, 0.03})                                                  # every rate degenerate
    every = tune(tiny.replace(lr=None), {"fedavg": {}}, **kwargs)
    assert every.chosen["fedavg"]["lr"] == 0.1                                       # the plain rule's choice stands,
    assert every.unsound()["fedavg"].startswith("all 3 of its candidates in the 10-round tuning failed: 3 degenerate")
    # and the cells of that regime are dropped before any evaluation run; another regime's tuning keeps its own
    dropped = unsound_cells(configs, t, method_of=lambda key: key[0], regimes={"one class per client": every})
    assert list(dropped) == [("fedavg", "100%")] and dropped[("fedavg", "100%")].startswith(
        "fedavg (one class per client): all 3 of its candidates")
    assert unsound_cells(configs, every, method_of=lambda key: "moon") == {}          # a method not tuned is kept


def test_a_choice_at_the_grids_edge_is_answered_with_the_next_rate_beyond_it(monkeypatch, tiny):
    _scored_by(monkeypatch, lambda c: -abs(math.log10(c.lr / 3.0)))      # best at lr 3, far above the grid
    t = tune(tiny.replace(lr=None), {"fedavg": {}}, rounds=10, rates=(0.01, 0.03, 0.1), widen=2)
    assert sorted(t.grid["lr"]) == [0.01, 0.03, 0.1, 0.3, 1.0]           # widened twice, then stopped
    assert t.chosen["fedavg"]["lr"] == 1.0 and t.table().loc["fedavg", "at an edge"] == "lr high"
    _scored_by(monkeypatch, lambda c: -abs(math.log10(c.lr / 0.3)))      # best at 0.3: one step beyond is enough
    t = tune(tiny.replace(lr=None), {"fedavg": {}}, rounds=10, rates=(0.01, 0.03, 0.1), widen=3)
    assert sorted(t.grid["lr"]) == [0.01, 0.03, 0.1, 0.3, 1.0] and t.chosen["fedavg"]["lr"] == 0.3
    assert t.table().loc["fedavg", "at an edge"] == "no" and t.table().loc["fedavg", "lr tried"] == "0.01 to 1"
    by_rate = t.by_rate()                                                 # the tuning chapter's heatmap: by rate
    assert list(by_rate.columns) == [0.01, 0.03, 0.1, 0.3, 1.0] and by_rate.loc["fedavg", 0.3] == pytest.approx(0.0)
    _scored_by(monkeypatch, lambda c: -abs(math.log10(c.lr / 0.03)) - abs(math.log10(c.algorithm_params["offset_lr"])))
    t = tune(tiny.replace(lr=None), {"distrans": {"algorithm": "distrans"}}, rounds=10, rates=(0.01, 0.03, 0.1))
    assert t.chosen["distrans"] == {"lr": 0.03, "offset_lr": 1.0}        # the second rate's grid, inside its edges


def test_the_tuning_pictures_show_each_rates_best_candidate_and_where_a_seed_diverged(monkeypatch, tiny):
    # DisTrans: at lr 0.03 offset rate 1 scores best (chosen); at lr 0.01 only offset rate 10 does well; at lr 0.1
    # every candidate diverges (NaN). FedAvg never diverges.
    good = {(0.03, 1.0): 0.8, (0.01, 10.0): 0.7}

    def score_of(c):
        if c.algorithm == "fedavg":
            return 0.6
        return math.nan if c.lr == 0.1 else good.get((c.lr, c.algorithm_params["offset_lr"]), 0.3)
    _scored_by(monkeypatch, score_of)
    t = tune(tiny.replace(lr=None), {"distrans": {"algorithm": "distrans"}, "fedavg": {}}, rounds=10,
             rates=(0.01, 0.03, 0.1), widen=0)
    assert t.chosen["distrans"] == {"lr": 0.03, "offset_lr": 1.0}
    curve = t.curves().set_index(["method", "lr"])
    assert curve.loc[("distrans", 0.01), "validation"] == pytest.approx(0.7)     # the rate's best, not offset 1's
    assert curve.loc[("distrans", 0.03), "chosen"] and math.isnan(curve.loc[("distrans", 0.1), "validation"])
    diverged = t.diverged()
    assert diverged.loc["distrans"].tolist() == [False, False, True] and not diverged.loc["fedavg"].any()
    assert math.isnan(t.by_rate().loc["distrans", 0.1])


def test_the_absolute_grid_scores_the_last_fifth_of_ten_evaluations(tiny, tmp_path):
    from fedlab_core.verdicts import score

    t = tune(tiny.replace(lr=None), {"fedavg": {}}, rounds=10, rates=(0.03, 0.1), widen=0, max_workers=1,
             cache_dir=tmp_path)
    again = run(tiny.replace(num_rounds=10, eval_every=1, validation=0.2, seed=0, lr=0.1), cache_dir=tmp_path)
    assert len([r for r in again.rounds if r["mean_client_accuracy"] is not None]) == 10
    assert t.grid.set_index("lr").loc[0.1, "validation"] == pytest.approx(score(again))


def test_ties_go_to_the_rate_nearest_the_papers(monkeypatch, tiny):
    from fedlab_core import tuning as tuning_module

    def same_score(configs, **kwargs):
        class H:
            final = {"mean_client_accuracy": 0.5}
            rounds = []
            meta = {"seconds": 1.0}
        return [H() for _ in configs]
    monkeypatch.setattr(tuning_module, "sweep", same_score)
    chosen = tune(tiny.replace(lr=None), {"fedavg": {}}, rounds=1, grid=(1 / 3, 1.0, 3.0)).chosen
    assert chosen["fedavg"]["lr"] == pytest.approx(0.05)


def test_precedence_chapter_then_tuned_then_paper():
    import pandas as pd

    tuning = Tuning(pd.DataFrame(), {"fedavg": {"lr": 0.15}, "distrans": {"lr": 0.05, "offset_lr": 0.01}}, 5, (0,), 0.2)
    configs = {"fedavg": RunConfig(), "distrans": RunConfig(algorithm="distrans"),
               "chapter": RunConfig(lr=0.3, local_epochs=1), "moon": RunConfig(algorithm="moon")}
    out, tuned = tuned_configs(configs, tuning, method_of=lambda k: "fedavg" if k == "chapter" else k)
    assert out["fedavg"].lr == 0.15 and tuned["fedavg"] == {"lr"}
    assert out["distrans"].lr == 0.05 and out["distrans"].algorithm_params == {"offset_lr": 0.01}
    assert out["chapter"].lr == 0.3 and tuned["chapter"] == set()      # the chapter's own value wins
    assert out["moon"] == configs["moon"] and tuned["moon"] == set()   # not tuned: its paper's
    table = settings_table(out, tuned)
    assert table.loc["fedavg", "lr"] == "0.15 (tuned)"
    assert table.loc["fedavg", "local work per round"] == "5 epochs, batch 10 (paper)"
    assert table.loc["chapter", "lr"] == "0.3 (chapter)"
    assert table.loc["chapter", "local work per round"] == "1 epoch, batch 10 (chapter/paper)"
    assert table.loc["moon", "lr"] == "0.01 (paper)"
    assert table.loc["moon", "optimiser"] == "sgd, momentum 0.9, weight decay 1e-05 (paper)"
    assert table.loc["distrans", "method parameters"] == "offset_lr=0.01 (tuned)"
    assert table.loc["fedavg", "method parameters"] == "paper defaults"



def test_one_class_per_client_takes_the_tuning_of_its_own_regime_where_it_has_one():
    import pandas as pd

    from fedlab_core.tuning import one_class_per_client, regime

    label = Tuning(pd.DataFrame(), {"distrans": {"lr": 0.01, "offset_lr": 10.0}, "fedavg": {"lr": 0.03}}, 5, (100,), 0.2)
    positives = Tuning(pd.DataFrame(), {"distrans": {"lr": 0.03, "offset_lr": 0.1}, "fedaws": {"lr": 0.1}}, 5, (100,),
                       0.2)
    bench = one_class_per_client("lenet5_bn", 10, 2000, 2000, 1, 32)
    assert bench.partition == "one_class" and bench.dh is None and bench.lr is None and bench.local_epochs == 1
    assert [regime(c) for c in (bench, bench.replace(partition="distrans", dh=0.8),
                                RunConfig(dataset="fashion_mnist_domains", partition="domain", num_clients=5))] \
        == ["one class per client", "label skew", "feature skew"]
    configs = {(m, level): RunConfig(algorithm=m, **split) for m in ("distrans", "fedavg", "fedaws")
               for level, split in (("80%", dict(partition="distrans", dh=0.8)), ("100%", dict(partition="one_class")))}
    out, tuned = tuned_configs(configs, label, method_of=lambda key: key[0],
                               regimes={"one class per client": positives})
    assert out[("distrans", "80%")].algorithm_params == {"offset_lr": 10.0}           # label skew: its own tuning
    assert out[("distrans", "100%")].lr == 0.03 and out[("distrans", "100%")].algorithm_params == {"offset_lr": 0.1}
    assert out[("fedaws", "100%")].lr == 0.1 and tuned[("fedaws", "100%")] == {"lr"}  # tuned where it applies
    assert out[("fedavg", "100%")].lr is None and tuned[("fedavg", "100%")] == set()  # not in that tuning: paper's
    plain, _ = tuned_configs(configs, label, method_of=lambda key: key[0])             # no regime of its own
    assert plain[("distrans", "100%")].algorithm_params == {"offset_lr": 10.0}
    with pytest.raises(ValueError, match="^regimes: unknown regime 'one class'"):
        tuned_configs(configs, label, regimes={"one class": positives})


# ----------------------------------------------------------------------------------- the fixes

def test_fedaws_takes_its_server_steps():
    fed = federate(load_dataset("digits"), "iid", 2, 0)
    algo = FedAwS(server_lr=0.1, server_steps=3)
    server = algo.init(build_model("mlp", fed.input_shape, 10), fed)
    weights = server["weights"].clone()  # class embeddings bunched together: the spread-out term acts
    algo.shared.view(weights, "head.weight").copy_(1 + 0.05 * torch.randn(10, 64, generator=torch.Generator().manual_seed(0)))
    server = {**server, "weights": weights}
    # no client holds a class this round: the embeddings are the old ones, then three spread-out steps
    uploads = [(c, Message({"weights": server["weights"], "class_counts": torch.zeros(10)}, num_samples=5))
               for c in range(2)]
    out = algo.aggregate(server, uploads, 1)["weights"]
    expected = algo.shared.view(server["weights"], "head.weight")
    for _ in range(3):
        expected = spreadout_step(expected, 0.1, 0.9)
    assert torch.allclose(algo.shared.view(out, "head.weight"), expected, atol=1e-6)
    once = FedAwS(server_lr=0.1)
    once.init(build_model("mlp", fed.input_shape, 10), fed)
    assert not torch.allclose(once.shared.view(once.aggregate(server, uploads, 1)["weights"], "head.weight"),
                              expected, atol=1e-6)


def test_every_models_blocks_end_its_convolutional_stages():
    for name in MODELS:
        model = meta_model(name, (3, 64, 64), 10)
        modules = dict(model.named_modules())
        convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
        assert bool(model.blocks) == bool(convs), name
        for block in model.blocks:
            assert isinstance(modules[block], (torch.nn.ReLU, torch.nn.MaxPool2d, torch.nn.Sequential)), (name, block)


def test_each_flow_is_tuned_on_its_own_and_its_runs_get_its_rate(monkeypatch, tiny):
    from fedlab_core.tuning import flow_label, per_flow

    flows = {"alone": {}, "+ FedRDN": {"augment": "fedrdn"}}
    methods = per_flow({"fedavg": {"algorithm": "fedavg"}}, flows)
    assert methods == {"fedavg | alone": {"algorithm": "fedavg"},
                       "fedavg | + FedRDN": {"algorithm": "fedavg", "augment": "fedrdn"}}
    # a validation score that prefers 0.03 without the flow and 0.1 with it: each flow keeps its own choice
    _scored_by(monkeypatch, lambda c: -abs(c.lr - (0.1 if c.augment == "fedrdn" else 0.03)))
    t = tune(tiny.replace(lr=None), methods, rounds=10, rates=(0.01, 0.03, 0.1, 0.3))
    assert t.chosen == {"fedavg | alone": {"lr": 0.03}, "fedavg | + FedRDN": {"lr": 0.1}}
    configs = {("fedavg", f): [tiny.replace(lr=None, seed=s, **flow) for s in (0, 1)] for f, flow in flows.items()}
    out, tuned = tuned_configs(configs, t, method_of=flow_label)
    assert [c.lr for c in out[("fedavg", "alone")]] == [0.03, 0.03]
    assert [c.lr for c in out[("fedavg", "+ FedRDN")]] == [0.1, 0.1] and tuned[("fedavg", "+ FedRDN")] == {"lr"}


def test_a_level_with_a_longer_horizon_is_tuned_at_it_and_its_runs_get_that_rate(monkeypatch, tiny):
    from fedlab_core.tuning import at_horizons, horizon_label

    horizons = {"0%": 30}                        # one level of a page trains 30 rounds, the others 10
    methods = at_horizons({"fedavg": {"algorithm": "fedavg"}}, horizons)
    assert methods == {"fedavg": {"algorithm": "fedavg"},
                       "fedavg at 30 rounds": {"algorithm": "fedavg", "num_rounds": 30}}
    # a validation score that prefers 0.1 at 10 rounds and 0.03 at 30: each horizon keeps its own choice
    seen = set()

    def score_of(c):
        seen.add(c.num_rounds)
        return -abs(c.lr - (0.03 if c.num_rounds == 30 else 0.1))
    _scored_by(monkeypatch, score_of)
    t = tune(tiny.replace(lr=None), methods, rounds=10, rates=(0.01, 0.03, 0.1, 0.3))
    assert seen == {10, 30} and t.chosen == {"fedavg": {"lr": 0.1}, "fedavg at 30 rounds": {"lr": 0.03}}
    configs = {("fedavg", level): [tiny.replace(lr=None, seed=s, num_rounds=horizons.get(level, 10)) for s in (0, 1)]
               for level in ("0%", "80%")}
    out, tuned = tuned_configs(configs, t, method_of=lambda key: horizon_label(key[0], horizons.get(key[1])))
    assert [(c.lr, c.num_rounds) for c in out[("fedavg", "0%")]] == [(0.03, 30)] * 2
    assert [(c.lr, c.num_rounds) for c in out[("fedavg", "80%")]] == [(0.1, 10)] * 2
    assert at_horizons({"fedavg": {}}, {}) == {"fedavg": {}}     # no horizon: the methods as given
