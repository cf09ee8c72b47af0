"""Every algorithm and augmentation runs through the same engine, RunConfig and CLI."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedlab_core import RunConfig, run
from fedlab_core.algorithms import ALGORITHMS
from fedlab_core.augment import AUGMENTS

ROOT = Path(__file__).resolve().parents[1]


def _check(history):
    assert len(history.rounds) == 2
    has_global = ALGORITHMS[history.config["algorithm"]].global_model
    for key in ("mean_client_accuracy", "global_accuracy"):
        value = history.final[key]
        if key == "global_accuracy" and not has_global:  # no global model: no number stands in for it
            assert value is None
            continue
        assert value is not None and 0.0 <= value <= 1.0 and not math.isnan(value), key


MODEL_FOR = {"fedbn": "mlp_bn", "partialfed": "mlp_bn", "fraug": "mlp_bn", "fedfa": "digit"}  # they need batch norm or conv layers


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_runs_through_run_config(algorithm, tiny):
    partition = {"partition": "one_class"} if algorithm == "fedaws" else {"partition": "dirichlet", "alpha": 0.5}
    history = run(tiny.replace(algorithm=algorithm, num_rounds=2, local_steps=5, model=MODEL_FOR.get(algorithm, "mlp"),
                               **partition), use_cache=False, progress=False)
    _check(history)
    assert history.config["algorithm"] == algorithm


@pytest.mark.parametrize("augment", sorted(AUGMENTS))
def test_every_augmentation_composes_with_scaffold(augment, tiny):
    model = "mlp_bn" if augment == "advprop" else "mlp"  # AdvProp needs batch norm
    _check(run(tiny.replace(algorithm="scaffold", augment=augment, model=model, num_rounds=2, local_steps=5),
               use_cache=False, progress=False))


def test_cli_accepts_algorithm_and_augment_names_with_parameters(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "fedlab_core", "run", "--algorithm", "fedprox", "--algorithm-param", "mu=0.1",
         "--augment", "mixup", "--augment-param", "alpha=0.4", "--dataset", "digits", "--num-clients", "3",
         "--rounds", "1", "--seed", "0", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "FEDLAB_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["config"]["algorithm_params"] == {"mu": 0.1} and doc["config"]["augment_params"] == {"alpha": 0.4}


def test_unknown_hyperparameter_names_the_algorithm_and_what_it_accepts_or_that_it_takes_none():
    with pytest.raises(ValueError, match="algorithm_params: 'fedprox' has no parameter 'beta'; it accepts: mu"):
        RunConfig(algorithm="fedprox", algorithm_params={"beta": 1})
    with pytest.raises(ValueError, match="^algorithm_params: 'fedavg' takes no parameters; got 'mu'$"):
        RunConfig(algorithm="fedavg", algorithm_params={"mu": 0.01})


@pytest.mark.parametrize("cls", [*ALGORITHMS.values(), *AUGMENTS.values()], ids=lambda c: c.name)
def test_every_setting_is_declared_and_the_defaults_satisfy_their_declaration(cls):
    import inspect

    from fedlab_core.params import _declared

    names, hints = _declared(cls.__init__)
    settings = [n for n in names if n not in cls.not_settings]
    assert all(n in hints for n in settings), "an unannotated setting would go unchecked"
    assert set(cls.constraints) <= set(settings), "a constraint naming no setting checks nothing"
    defaults = {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items() if n in settings}
    cls.check_params(defaults, field=None)


def test_every_loader_option_is_declared():
    from fedlab_core.data import DATASETS, LOADER_CONSTRAINTS, check_dataset_params, load_fashion_mnist_domains
    from fedlab_core.data.sources import LOADERS
    from fedlab_core.params import _declared

    loaders = [*LOADERS.values(), load_fashion_mnist_domains]
    options = {n for loader in loaders for n in _declared(loader)[0]}
    assert set(LOADER_CONSTRAINTS) <= options
    for loader in loaders:
        names, hints = _declared(loader)
        assert all(n in hints for n in names), loader.__name__
    for name, info in DATASETS.items():
        if info.domains:
            assert check_dataset_params(name, {"domains": list(info.domains[:1])}) == {"domains": list(info.domains[:1])}


def test_what_leaves_a_client_beyond_the_weights_is_described_for_the_methods_that_send_more():
    from fedlab_core.algorithms import ALGORITHMS
    from fedlab_core.augment import AUGMENTS

    sends_more = {"distrans", "fraug", "scaffold", "fedproto", "fedproto_shared"}
    for name, cls in ALGORITHMS.items():
        assert isinstance(cls.shares, str) and bool(cls.shares) == (name in sends_more), name
    for name, cls in AUGMENTS.items():
        assert isinstance(cls.shares, str) and bool(cls.shares) == (name in {"fedrdn", "ot_align", "naivemix"}), name
