"""Runs: validation, determinism, the cache, resume after a kill, the CLI and sweeps."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fedlab_core import RunConfig, run, sweep
from fedlab_core import runs as runs_module
from fedlab_core.sweeps import summarize
import numpy as np
from fedlab_core.data import DATASETS, load_dataset

ROOT = Path(__file__).resolve().parents[1]


def _numbers(history):
    """Every logged number except wall-clock seconds."""
    return [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in history.rounds]


@pytest.mark.parametrize("changes,field", [
    ({"algorithm": "fedsgd2"}, "algorithm"),
    ({"dataset": "imagenet"}, "dataset"),
    ({"partition": "zipf"}, "partition"),
    ({"partition": "dirichlet", "alpha": 0.0}, "alpha"),
    ({"partition": "dirichlet", "alpha": -0.5}, "alpha"),
    ({"partition": "distrans", "dh": 1.5}, "dh"),
    ({"partition": "distrans", "dh": -0.1}, "dh"),
    ({"partition": "distrans", "dh": 0.85}, "dh"),
    ({"partition": "distrans"}, "dh"),
    ({"num_clients": 60_001}, "num_clients"),
    ({"num_clients": 0}, "num_clients"),
    ({"num_clients": 200, "max_train_samples": 100}, "num_clients"),
    ({"num_rounds": 0}, "num_rounds"),
    ({"fraction": 0.0}, "fraction"),
    ({"fraction": 1.5}, "fraction"),
    ({"lr": -0.1}, "lr"),
    ({"lr": 0.0}, "lr"),
    ({"batch_size": 0}, "batch_size"),
    ({"local_epochs": 0}, "local_epochs"),
    ({"optimizer": "lbfgs"}, "optimizer"),
    ({"model": "vgg99"}, "model"),
    ({"augment": "cutmix9"}, "augment"),
    ({"algorithm_params": {"mu": 0.1}}, "algorithm_params"),
    ({"clients_per_round": 11}, "clients_per_round"),
    ({"partition": "domain"}, "partition"),
    ({"partition": "pathological", "classes_per_client": 11}, "classes_per_client"),
])
def test_bad_config_raises_value_error_naming_the_field(changes, field):
    # Construction itself fails, so nothing can be loaded or cached (the CLI test checks the cache folder).
    with pytest.raises(ValueError, match=f"^{field}: "):
        RunConfig(**changes)


def test_two_identical_runs_are_bit_identical(tiny):
    a = run(tiny, use_cache=False, progress=False)
    b = run(tiny, use_cache=False, progress=False)
    assert _numbers(a) == _numbers(b) and a.final == b.final
    c = run(tiny.replace(seed=1), use_cache=False, progress=False)
    assert _numbers(c) != _numbers(a)


def test_cache_returns_the_stored_result_without_rerunning(tiny, tmp_path, monkeypatch):
    first = run(tiny, cache_dir=tmp_path, progress=False)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].endswith(".json")  # no checkpoint or temp file left behind
    monkeypatch.setattr(runs_module, "build", lambda *a, **k: pytest.fail("a cached run was re-run"))
    again = run(tiny, cache_dir=tmp_path, progress=False)
    assert again == first


def test_cache_key_changes_with_config_and_code(tiny, monkeypatch):
    import torch
    cpu = torch.device("cpu")
    from fedlab_core import store
    key = store.cache_key(tiny, cpu)
    assert key == store.cache_key(RunConfig(**tiny.to_dict()), cpu)
    assert key != store.cache_key(tiny.replace(lr=0.2), cpu)
    archived = store.archive_key(tiny, cpu)
    monkeypatch.setattr(store, "code_version", lambda: "other")
    assert key != store.cache_key(tiny, cpu)
    assert store.archive_key(tiny, cpu) == archived          # the archive's key does not depend on the code


def test_history_frame_and_json_round_trip(tiny):
    h = run(tiny, use_cache=False, progress=False)
    df = h.frame()
    assert list(df["round"]) == [1, 2, 3]
    assert {"global_accuracy", "bytes_up", "bytes_down", "train_loss", "seed"} <= set(df.columns)
    assert runs_module.History.from_json(h.to_json()) == h
    assert h.meta["dh"] == 0.0 and len(h.final["client_accuracy"]) == 4


KILLED_RUN = textwrap.dedent("""
    import sys, time
    import torch
    torch.set_num_threads(1)             # the same thread count as the test process: same float sums
    from fedlab_core import RunConfig, run
    from fedlab_core.engine import Simulation
    slow = Simulation.run_round
    def run_round(self, state):          # slow rounds down so the parent can kill mid-run
        row = slow(self, state)
        time.sleep(0.4)
        return row
    Simulation.run_round = run_round
    config = RunConfig(dataset="digits", model="mlp", num_clients=4, num_rounds=8, lr=0.1, seed=5,
                       partition="dirichlet", alpha=0.5, min_size=5)
    run(config, cache_dir=sys.argv[1], checkpoint_every=1, progress=False)
""")


def test_run_killed_with_sigkill_resumes_to_identical_metrics(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_RUN)
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, str(script), str(cache)], cwd=ROOT)
    deadline = time.time() + 120
    while not list(cache.glob("*.ckpt")):
        assert proc.poll() is None, "the run ended before it wrote a checkpoint"
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # let it get a round or two further
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not list(cache.glob("*.json")), "the run finished before it was killed"
    config = RunConfig(dataset="digits", model="mlp", num_clients=4, num_rounds=8, lr=0.1, seed=5,
                       partition="dirichlet", alpha=0.5, min_size=5)
    resumed = run(config, cache_dir=cache, checkpoint_every=1, progress=False)
    assert 1 <= resumed.meta["resumed_from_round"] < 8
    uninterrupted = run(config, use_cache=False, progress=False)
    assert _numbers(resumed) == _numbers(uninterrupted)
    assert resumed.final == uninterrupted.final


def test_dataset_registry_sizes_match_the_real_files():
    for name in ("digits", "fashion_mnist"):
        data = load_dataset(name)
        assert len(data.y_train) == DATASETS[name].num_train
        assert data.num_classes == DATASETS[name].num_classes


def test_stratified_subsample_keeps_class_balance():
    data = load_dataset("digits", max_train=500, max_test=100, seed=0)
    assert len(data.y_train) == 500 and len(data.y_test) == 100
    counts = data.y_train.bincount()
    assert counts.max() - counts.min() <= 3


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "fedlab_core", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_cli_run_json_prints_exactly_one_json_object(tmp_path):
    out = _cli("run", "--algorithm", "fedavg", "--dataset", "digits", "--partition", "dirichlet", "--alpha", "0.5",
               "--num-clients", "3", "--rounds", "2", "--seed", "0", "--lr", "0.1", "--json",
               env={"FEDLAB_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc) == {"config", "final", "rounds", "meta"}
    assert set(doc["final"]) == {"global_accuracy", "mean_client_accuracy"}
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    assert all(set(r) == {"round", "clients", "failed", "train_loss", "global_accuracy", "mean_client_accuracy",
                          "bytes_up", "bytes_down"}
               for r in doc["rounds"])
    assert all(isinstance(r["bytes_up"], int) and r["bytes_up"] > 0 for r in doc["rounds"])
    assert doc["config"]["partition"] == "dirichlet" and 0.0 <= doc["final"]["global_accuracy"] <= 1.0


def test_cli_partition_json():
    out = _cli("partition", "--dataset", "digits", "--scheme", "distrans", "--dh", "0.8", "--num-clients", "10",
               "--seed", "0", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["dh"] == pytest.approx(0.8)
    assert len(doc["class_counts"]) == 10 and all(sum(1 for v in row if v) == 2 for row in doc["class_counts"])


def test_cli_bad_input_exits_2_names_the_field_and_touches_nothing(tmp_path):
    out = _cli("run", "--dataset", "digits", "--partition", "dirichlet", "--alpha", "-1", "--num-clients", "3",
               "--rounds", "2", "--seed", "0", "--json", env={"FEDLAB_CACHE_DIR": str(tmp_path / "c")})
    assert out.returncode == 2 and out.stdout == ""
    assert "alpha" in out.stderr
    assert not (tmp_path / "c").exists()


def test_sweep_local_matches_sequential_runs(tiny, tmp_path, capfd):
    configs = [tiny.replace(seed=s, num_rounds=2) for s in (0, 1)]
    parallel = sweep(configs, backend="local", max_workers=2, cache_dir=tmp_path)
    said = capfd.readouterr().err.splitlines()   # no terminal here: a line before, and one as each run ends
    assert said[0].startswith("runs: computing 2 of 2 runs (0 from the archive or cache), about ")
    assert said[1].startswith("runs: 1 of 2 done, about ") and said[2].startswith("runs: 2 of 2 done in ")
    for config, h in zip(configs, parallel):
        assert h.config == config.to_dict()
        assert _numbers(h) == _numbers(run(config, use_cache=False, progress=False))


def test_sweep_on_a_local_ray_instance(tiny, tmp_path):
    ray = pytest.importorskip("ray", reason="ray is an optional extra (pip install -e '.[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"working_dir": None})
    try:
        configs = [tiny.replace(seed=s, num_rounds=2) for s in (0, 1)]
        results = sweep(configs, backend="ray", cache_dir=tmp_path)
        assert [h.config["seed"] for h in results] == [0, 1]
        assert _numbers(results[0]) == _numbers(run(configs[0], use_cache=False, progress=False))
    finally:
        ray.shutdown()


def test_sweep_rejects_unknown_backend(tiny):
    with pytest.raises(ValueError, match="backend"):
        sweep([tiny], backend="dask")


def test_trained_returns_the_final_models_and_keeps_them(tiny, tmp_path):
    from fedlab_core.runs import client_features, trained

    config = tiny.replace(algorithm="distrans", num_rounds=2)
    history = run(config, cache_dir=tmp_path, progress=False)       # cached without its state
    sim, state = trained(config, cache_dir=tmp_path)                  # so it runs again, keeping the state
    assert len(list(tmp_path.glob("*.final"))) == 1
    again = trained(config, cache_dir=tmp_path)[1]
    assert torch.equal(again.server["weights"], state.server["weights"])
    # the loaded models reproduce the recorded client accuracies
    accuracies = []
    for cid, data in enumerate(sim.federation.clients):
        logits = sim.algorithm.predict(state.server, state.clients[cid], data.x_test)
        accuracies.append((logits.argmax(1) == data.y_test).float().mean().item())
    assert accuracies == pytest.approx(history.final["client_accuracy"], abs=1e-6)
    z, y, c = client_features(sim, state, per_client=5)
    assert z.shape == (20, 2 * 64) and c.tolist() == sum(([k] * 5 for k in range(4)), [])
    assert torch.equal(y, torch.cat([d.y_test[:5] for d in sim.federation.clients]))


def test_a_diverging_run_raises_or_is_recorded_with_where_it_stopped(tiny, tmp_path):
    from fedlab_core.algorithms import NonFiniteLossError

    config = tiny.replace(lr=1e20, num_rounds=4)
    with pytest.raises(NonFiniteLossError, match="round 1"):
        run(config, cache_dir=tmp_path, progress=False)
    history = run(config, cache_dir=tmp_path, progress=False, on_diverge="record")
    assert "non-finite training loss" in history.meta["diverged"]
    assert history.final["global_accuracy"] is None and history.rounds == []  # JSON's form of NaN; no round finished
    assert run(config, cache_dir=tmp_path, progress=False).meta["diverged"] == history.meta["diverged"]  # cached
    summary = summarize({"lr 1e6": [history]})
    assert np.isnan(summary.loc["lr 1e6", "global_accuracy"]) and np.isnan(summary.loc["lr 1e6", "worst_client_accuracy"])
    assert run(tiny, cache_dir=tmp_path, progress=False).meta["diverged"] is None
    with pytest.raises(ValueError, match="on_diverge"):
        run(tiny, cache_dir=tmp_path, on_diverge="ignore")


def test_a_run_stops_once_its_curve_has_plateaued_and_a_resumed_run_stops_at_the_same_round(tiny, tmp_path):
    import copy

    from fedlab_core.runs import build
    from fedlab_core.verdicts import plateaued

    capped = tiny.replace(num_rounds=80, stop_at_plateau=True)
    h = run(capped, use_cache=False, progress=False, workers=1)
    stop = h.meta["stopped_at_plateau"]
    assert stop == len(h.rounds) < 80 and h.rounds[-1]["round"] == stop
    curve = {r["round"]: r["mean_client_accuracy"] for r in h.rounds}
    assert plateaued(curve) and not plateaued({k: v for k, v in curve.items() if k < stop})  # the first round it could
    assert h.final["mean_client_accuracy"] == h.rounds[-1]["mean_client_accuracy"]
    # stopping changes nothing before the stop, and without the option the run goes on to its cap
    assert _numbers(h) == _numbers(run(tiny.replace(num_rounds=stop), use_cache=False, progress=False, workers=1))
    uncapped = run(capped.replace(stop_at_plateau=False, num_rounds=stop + 2), use_cache=False, progress=False)
    assert len(uncapped.rounds) == stop + 2 and uncapped.meta["stopped_at_plateau"] is None
    # a run resumed from a mid-run state stops at the same round with the same numbers
    device = torch.device("cpu")
    saved = {}
    build(capped, device).run(on_round_end=lambda s: saved.setdefault(s.next_round - 1, copy.deepcopy(s)))
    resumed = build(capped, device).run(saved[stop // 2])
    assert [r["mean_client_accuracy"] for r in resumed.rows] == [r["mean_client_accuracy"] for r in h.rounds]


def test_a_run_can_stop_on_the_global_models_curve_instead(tiny):
    from fedlab_core.verdicts import plateaued

    config = tiny.replace(num_rounds=80, stop_at_plateau=True, plateau_metric="global_accuracy")
    h = run(config, use_cache=False, progress=False, workers=1)
    stop = h.meta["stopped_at_plateau"]
    glob = {r["round"]: r["global_accuracy"] for r in h.rounds}
    assert stop is not None and plateaued(glob) and not plateaued({k: v for k, v in glob.items() if k < stop})
    # the default tests the clients' curve, and the two settings are two runs (two keys)
    default = tiny.replace(num_rounds=80, stop_at_plateau=True)
    assert RunConfig(**{**default.to_dict(), "plateau_metric": "mean_client_accuracy"}) == default
    with pytest.raises(ValueError, match=r"^plateau_metric: .*global_accuracy"):
        tiny.replace(plateau_metric="loss")


def test_a_run_stops_on_its_validation_curve_after_the_test_passes_patience_times_in_a_row(tiny):
    from fedlab_core.convergence import VALIDATION, metric_curve, plateaued, stop_round

    config = tiny.replace(num_rounds=80, stop_at_plateau=True, validation_monitor=0.2, plateau_metric=VALIDATION)
    once = run(config, use_cache=False, progress=False, workers=1)
    patient = run(config.replace(patience=3), use_cache=False, progress=False, workers=1)
    val = {r: v for r, v in metric_curve(patient.rounds, VALIDATION).items() if v is not None}
    first, stop = once.meta["stopped_at_plateau"], patient.meta["stopped_at_plateau"]
    assert first is not None and stop is not None and stop > first
    # it stopped on the validation shares, not the test curve: the three last prefixes pass, the one before does not
    assert all(plateaued({k: v for k, v in val.items() if k <= r}) for r in (stop - 2, stop - 1, stop))
    assert stop_round(val, 3) == stop and stop_round({k: v for k, v in val.items() if k < stop}, 3) is None
    assert [r["client_accuracy"] for r in patient.rounds[:first]] == [r["client_accuracy"] for r in once.rounds]
    with pytest.raises(ValueError, match="^plateau_metric: 'validation_accuracy' reads the monitored validation"):
        tiny.replace(plateau_metric=VALIDATION)
    with pytest.raises(ValueError, match="^patience: "):
        tiny.replace(patience=0)


def test_cli_stop_at_plateau_is_a_flag(tmp_path):
    out = _cli("run", "--dataset", "digits", "--num-clients", "3", "--rounds", "3", "--lr", "0.1",
               "--stop-at-plateau", "--json", env={"FEDLAB_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["config"]["stop_at_plateau"] is True and doc["meta"]["stopped_at_plateau"] is None  # too few rounds
    help_text = _cli("run", "--help").stdout
    assert "--stop-at-plateau, --no-stop-at-plateau" in help_text


def test_clients_without_test_samples_are_left_out_of_the_mean_not_a_crash(tiny, tmp_path):
    from fedlab_core.data.base import digest

    assert digest(torch.zeros(0, 1, 8, 8)) != digest(torch.zeros(0, 1, 8, 7))  # an empty tensor hashes by its shape
    h = run(tiny.replace(num_clients=6, max_test_samples=3, num_rounds=1), cache_dir=tmp_path)
    per_client = np.array(h.final["client_accuracy"], dtype=float)
    empty = np.isnan(per_client)
    assert 3 <= empty.sum() < 6   # three test images for six clients: at least three clients have none
    assert h.final["mean_client_accuracy"] == pytest.approx(per_client[~empty].mean())


def test_an_unwritable_cache_folder_is_refused_before_any_data_loads(tiny, tmp_path, monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("data loaded before the cache folder was checked")

    monkeypatch.setattr(runs_module, "load_dataset", no_data)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FEDLAB_CACHE_DIR", str(blocker / "runs"))
    with pytest.raises(ValueError, match=r"^FEDLAB_CACHE_DIR: cannot write the run cache in .*a-file/runs"):
        run(tiny)
    with pytest.raises(ValueError, match=r"^cache_dir: cannot write"):
        run(tiny, cache_dir=blocker)
    monkeypatch.setattr(runs_module, "load_dataset", load_dataset)
    assert run(tiny, use_cache=False).final["mean_client_accuracy"] >= 0  # no cache: nothing to write, no check


@pytest.mark.parametrize("training", [dict(local_epochs=2), dict(local_steps=7), dict(local_steps=30, batch_size=13)],
                         ids=["two epochs", "seven steps", "steps across passes"])
def test_samples_trained_counts_what_the_clients_trained(training, tiny, monkeypatch):
    from fedlab_core.algorithms import Algorithm

    seen = []
    original = Algorithm.train_step

    def train_step(self, x, y, opt, client_state):
        seen.append(len(x))
        return original(self, x, y, opt, client_state)
    monkeypatch.setattr(Algorithm, "train_step", train_step)
    history = run(tiny.replace(**training), use_cache=False, progress=False, workers=1)
    counted = runs_module.samples_trained(history)
    assert counted == [sum(seen) // tiny.num_rounds] * tiny.num_rounds and sum(counted) == sum(seen)
    if "local_epochs" in training:  # two passes over every client's data, less any trailing batch of one
        assert counted[0] <= 2 * history.meta["samples"]["train"] and counted[0] > 1.9 * history.meta["samples"]["train"]


def test_samples_trained_refuses_a_round_some_clients_sat_out(tiny):
    history = run(tiny.replace(fraction=0.5), use_cache=False, progress=False, workers=1)
    with pytest.raises(ValueError, match="round 1: 2 of 4 clients took part"):
        runs_module.samples_trained(history)
