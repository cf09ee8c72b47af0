"""Wiring: every setting reaches the part of a run it belongs to, and a client starts from what it was sent.

The maths of each method is pinned elsewhere by hand-computed cases; these tests catch a wrong wire: a
RunConfig field silently dropped on its way (it must change the cache key, what `build` makes where the
field applies, and the run's numbers), a field the command line cannot express, and a client that
ignores part of the server's message.
"""
import copy
import dataclasses
import hashlib
import json

import pytest
import torch

from fedlab_core import RunConfig, run
from fedlab_core import __main__ as cli
from fedlab_core.algorithms import ALGORITHMS, Training
from fedlab_core.runs import build
from fedlab_core.store import cache_key

CPU = torch.device("cpu")
BASE = RunConfig(dataset="digits", model="mlp", num_clients=4, num_rounds=2, lr=0.1, local_epochs=1, batch_size=32,
                 seed=0)

# field -> (changes to BASE that make the field apply, the changed value, the parts of the run it must change)
CASES = {
    "algorithm": ({}, "fedprox", {"algorithm"}),
    "algorithm_params": ({"algorithm": "fedprox"}, {"mu": 0.5}, {"algorithm"}),
    "augment": ({}, "mixup", {"augment"}),
    "augment_params": ({"augment": "mixup"}, {"alpha": 1.0}, {"augment"}),
    "model": ({}, "mlp_bn", {"model"}),
    "dataset": ({"max_train_samples": 600, "max_test_samples": 300}, "fashion_mnist", {"data", "model"}),
    "dataset_params": ({}, {"test_fraction": 0.4}, {"data"}),
    "max_train_samples": ({}, 600, {"data"}),
    "max_test_samples": ({}, 200, {"data"}),
    "partition": ({}, "dirichlet", {"data"}),
    "alpha": ({"partition": "dirichlet"}, 0.1, {"data"}),
    "dh": ({"partition": "distrans", "dh": 0.2}, 0.4, {"data"}),
    "classes_per_client": ({"partition": "pathological"}, 3, {"data"}),
    "beta": ({"partition": "quantity"}, 2.0, {"data"}),
    "min_size": ({"partition": "dirichlet", "alpha": 0.1}, 300, {"data"}),
    "num_clients": ({}, 5, {"data"}),
    "validation": ({}, 0.2, {"data"}),
    "validation_monitor": ({}, 0.2, {"data"}),
    # a share of the clients' training data, or as many images from those no client holds: the clients keep theirs
    "validation_source": ({"validation_monitor": 0.5, "max_train_samples": 600}, "unused", {"data"}),
    "num_rounds": ({}, 3, {"schedule"}),
    "fraction": ({}, 0.5, {"schedule"}),
    "clients_per_round": ({}, 2, {"schedule"}),
    "local_epochs": ({}, 2, {"algorithm"}),
    "local_steps": ({}, 3, {"algorithm"}),
    "batch_size": ({}, 16, {"algorithm"}),
    "optimizer": ({}, "adam", {"algorithm"}),
    "lr": ({}, 0.05, {"algorithm"}),
    "momentum": ({}, 0.9, {"algorithm"}),
    "weight_decay": ({}, 0.01, {"algorithm"}),
    "train_transform": ({}, "flip_rotate", {"algorithm"}),
    "executor": ({}, "batched", {"executor"}),   # the same maths in another order: the floats differ
    "eval_every": ({}, 2, {"schedule"}),
    "stop_at_plateau": ({"num_rounds": 60}, True, {"schedule"}),   # the tiny run plateaus before round 60
    # the tiny run's client curve plateaus at round 49, its global model's at 47
    "plateau_metric": ({"num_rounds": 60, "stop_at_plateau": True}, "global_accuracy", {"schedule"}),
    "patience": ({"num_rounds": 60, "stop_at_plateau": True}, 3, {"schedule"}),   # three passes in a row: later
    "seed": ({}, 1, {"data", "model", "schedule"}),
}


def test_the_table_covers_every_field():
    assert set(CASES) == {f.name for f in dataclasses.fields(RunConfig)}


def _digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _settings(obj) -> str:
    """An object's plain attributes (its settings, as constructed), as text; an algorithm's reference to
    the augmentation, set by the engine, is the augmentation's part."""
    plain = (int, float, str, bool, tuple, list, dict, type(None), Training)
    return repr(sorted((k, v) for k, v in vars(obj).items() if isinstance(v, plain)
                        and k not in ("augment", "num_rounds"))) \
        + type(obj).__name__


def parts(config: RunConfig) -> dict[str, str]:
    """What `build` makes for a config, part by part: the split data, the initial model, the algorithm's
    and augmentation's settings, the round schedule and the executor that trains the clients."""
    sim = build(config, CPU, progress=False)
    fed = sim.federation
    data = [fed.x_test, fed.y_test] + [t for c in fed.clients for t in (c.x_train, c.y_train, c.x_test, c.y_test)]
    return {"data": _digest(*data),
            "model": repr(sim.model) + _digest(*sim.model.state_dict().values()),
            "algorithm": _settings(sim.algorithm),
            "augment": _settings(sim.augment),
            "schedule": repr((sim.num_rounds, sim.fraction, sim.clients_per_round, sim.eval_every, sim.seed,
                              sim.stop_at_plateau, sim.plateau_metric, sim.patience)),
            "executor": repr((sim.executor, sim.batched))}


def _numbers(history):
    return [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in history.rounds]


@pytest.mark.parametrize("name", list(CASES))
def test_changing_a_field_changes_the_key_what_build_makes_and_the_run(name):
    changes, value, where = CASES[name]
    before = BASE.replace(**changes)
    after = before.replace(**{name: value})
    assert getattr(before, name) != getattr(after, name), "the case must change the field"
    assert cache_key(before, CPU) != cache_key(after, CPU)
    a, b = parts(before), parts(after)
    changed = {part for part in a if a[part] != b[part]}
    assert where <= changed, f"{name}: expected a change in {sorted(where)}, build changed {sorted(changed)}"
    assert changed <= where, f"{name} changed {sorted(changed - where)} too"
    runs = [run(c, use_cache=False, progress=False) for c in (before, after)]
    assert _numbers(runs[0]) != _numbers(runs[1]), f"{name}: the run's numbers did not change"


def _cli_args(config: RunConfig) -> list[str]:
    """A `run` command line that states every field of `config`."""
    args = ["run"]
    for f in dataclasses.fields(RunConfig):
        value = getattr(config, f.name)
        if f.name in cli.MAPPINGS:
            args += [x for k, v in value.items() for x in (cli.MAPPINGS[f.name], f"{k}={json.dumps(v)}")]
        elif isinstance(value, bool):
            args += [f"--{'' if value else 'no-'}{f.name.replace('_', '-')}"]
        elif value is not None:
            args += [f"--{f.name.replace('_', '-')}", str(value)]
    return args


@pytest.mark.parametrize("name", list(CASES))
def test_the_command_line_expresses_every_field(name):
    changes, value, _ = CASES[name]
    config = BASE.replace(**changes).replace(**{name: value})
    assert cli._config(cli.parser().parse_args(_cli_args(config))) == config


def test_the_command_line_defaults_are_run_configs_own():
    assert cli._config(cli.parser().parse_args(["run"])) == RunConfig()


# --------------------------------------------------------------------------- the server's message

METHODS = [  # (algorithm, its parameters, model, partition)
    *((name, {}, "mlp", "dirichlet") for name in sorted(ALGORITHMS)
      if name not in ("fedbn", "partialfed", "fedfa", "pfedhn", "fedaws", "single", "distrans", "fraug")),
    ("fedbn", {}, "mlp_bn", "dirichlet"), ("fraug", {}, "mlp_bn", "dirichlet"), ("partialfed", {}, "mlp_bn", "dirichlet"),
    ("fedfa", {}, "digit", "dirichlet"), ("pfedhn", {}, "mlp_bn", "dirichlet"), ("fedaws", {}, "mlp", "one_class"),
    ("distrans", {"aggregation": "avg"}, "mlp", "dirichlet"), ("distrans", {"aggregation": "nn"}, "mlp", "dirichlet"),
]


def _perturbed(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t + 0.1 * (1.0 + t.abs().mean())
    return torch.roll(t, 1)  # ids (FedProto's classes): the same values, each in another place


def _upload(sim, message, client_state, cid: int, seed: int = 123):
    """Client `cid`'s upload from `message`, on a fixed stream, leaving the given state untouched."""
    sim._seed_global_streams(seed)
    upload, _ = sim.algorithm.local_update(message, copy.deepcopy(client_state), sim.federation.clients[cid],
                                           torch.Generator().manual_seed(seed))
    return {k: v.clone() for k, v in upload.tensors.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("algorithm,params,model,partition", METHODS,
                         ids=[f"{a}-{p.get('aggregation', '')}".rstrip("-") for a, p, _, _ in METHODS])
def test_a_client_starts_from_every_tensor_the_server_sent(algorithm, params, model, partition):
    config = BASE.replace(algorithm=algorithm, algorithm_params=params, model=model, partition=partition,
                          local_steps=4)
    sim = build(config, CPU, progress=False)
    state = sim.run()  # two rounds: every server-side extra (offsets, prototypes, variances) is filled
    cid = 0
    message = sim.algorithm.server_message(state.server, cid)
    assert message.tensors, f"{algorithm} sends nothing"
    reference = _upload(sim, message, state.clients[cid], cid)
    assert _same(reference, _upload(sim, message, state.clients[cid], cid)), "the local update is not repeatable"
    for key, tensor in message.tensors.items():
        changed = copy.copy(message)
        changed.tensors = {**message.tensors, key: _perturbed(tensor)}
        assert not _same(reference, _upload(sim, changed, state.clients[cid], cid)), \
            f"{algorithm}: the client's upload does not depend on {key!r} of the server's message"


def test_the_methods_that_send_more_than_weights_are_all_covered():
    sent = {}
    for algorithm, params, model, partition in METHODS:
        config = BASE.replace(algorithm=algorithm, algorithm_params=params, model=model, partition=partition,
                              num_rounds=1, local_steps=1)
        sim = build(config, CPU, progress=False)
        state = sim.run()
        sent[(algorithm, params.get("aggregation"))] = set(sim.algorithm.server_message(state.server, 0).tensors)
    extras = {name for name, keys in sent.items() if keys - {"weights"}}
    assert {("scaffold", None), ("fedfa", None), ("fedproto", None), ("pfedhn", None), ("distrans", "avg"),
            ("distrans", "nn")} <= extras
