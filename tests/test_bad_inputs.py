"""Bad inputs fail before any work, in one line naming the field; damaged cache files recover; a run in
which every client fails stops and is never cached; cache files load as data, never as code."""
import io
import json
import logging
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedlab_core import RunConfig, run
from fedlab_core import __main__ as cli
from fedlab_core import runs as runs_module
from fedlab_core.algorithms import ClientsFailedError, FedAvg
from fedlab_core.engine import Simulation

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ["--dataset", "digits", "--model", "mlp", "--num-clients", "3", "--rounds", "2", "--lr", "0.1"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder every run of the test uses (the CLI reads it from the environment)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("FEDLAB_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def no_work(monkeypatch):
    """Any attempt to load data or build a run fails the test: a bad input must be refused before."""
    def refuse(*args, **kwargs):
        pytest.fail("a bad input reached data loading")
    monkeypatch.setattr(runs_module, "build", refuse)
    monkeypatch.setattr(runs_module, "load_dataset", refuse)
    import fedlab_core.data as data_module
    monkeypatch.setattr(data_module, "load_dataset", refuse)


def _cli(argv, capsys):
    status = cli.main(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*")) if folder.exists() else []


# ------------------------------------------------------------------------------------------------ CLI

CLI_CASES = [  # (arguments of `run`, a fragment the one-line message must contain)
    (["--algorithm", "fedprox", "--algorithm-param", "mu=abc"], "--algorithm-param: 'fedprox' parameter 'mu' must be a number >= 0; got 'abc'"),
    (["--algorithm", "fedprox", "--algorithm-param", "mu=-1"], "--algorithm-param: 'fedprox' parameter 'mu' must be a number >= 0"),
    (["--algorithm", "fedprox", "--algorithm-param", "beta=1"], "--algorithm-param: 'fedprox' has no parameter 'beta'; it accepts: mu"),
    (["--algorithm", "fedavg", "--algorithm-param", "mu=0.1"], "--algorithm-param: 'fedavg' takes no parameters; got 'mu'"),
    (["--algorithm", "fedprox", "--algorithm-param", "mu"], "--algorithm-param: expected KEY=VALUE, got 'mu'"),
    (["--algorithm", "fedavgm", "--algorithm-param", "server_momentum=abc"], "'fedavgm' parameter 'server_momentum' must be a number in [0, 1)"),
    (["--algorithm", "scaffold", "--algorithm-param", "server_lr=x"], "'scaffold' parameter 'server_lr' must be a number > 0"),
    (["--algorithm", "distrans", "--algorithm-param", "aggregation=bogus"], "'distrans' parameter 'aggregation' must be one of 'none', 'avg', 'nn', 'nn+no'"),
    (["--algorithm", "distrans", "--algorithm-param", "alpha=1.5"], "'distrans' parameter 'alpha' must be a number in [0, 1]"),
    (["--algorithm", "moon", "--algorithm-param", "temperature=0"], "'moon' parameter 'temperature' must be a number > 0"),
    (["--algorithm", "pfedme", "--algorithm-param", "K=2.5"], "'pfedme' parameter 'K' must be an integer >= 1"),
    (["--algorithm", "pfedhn", "--algorithm-param", "server_optimizer=rmsprop"], "must be one of 'sgd', 'adam'"),
    (["--algorithm", "scaffold", "--algorithm-param", "sample_weighted=maybe"], "'scaffold' parameter 'sample_weighted' must be true or false"),
    (["--algorithm", "partialfed", "--algorithm-param", "keep_patterns=head.*"], "'partialfed' parameter 'keep_patterns' must be a list of strings"),
    (["--algorithm", "partialfed", "--algorithm-param", 'keep_patterns=["zzz*"]'], "pattern 'zzz*' matches no entry of MLP"),
    (["--algorithm", "fraug", "--model", "resnet18_imagenet"], "--model: 'resnet18_imagenet' needs its weights file"),
    (["--algorithm", "fedbn", "--dataset", "fashion_mnist", "--model", "auto"], "--model: 'lenet5' cannot be used here: 'fedbn' keeps each client's batch-norm layers local, and LeNet5 has no batch-norm layer"),
    (["--algorithm", "fedfa"], "'fedfa' re-styles the statistics of convolutional feature maps, and MLP has no convolutional block"),
    (["--algorithm", "fedfa", "--model", "digit", "--algorithm-param", 'layers=["conv.99"]'], "'conv.99' is not a module of DigitModel"),
    (["--augment", "advprop"], "'advprop' normalises adversarial examples with auxiliary batch norm, and MLP has no batch-norm layer"),
    (["--augment", "ot_align", "--augment-param", "variant=bogus"], "--augment-param: 'ot_align' parameter 'variant' must be one of 'sound', 'channel', 'joint', 'paper-code'"),
    (["--augment", "ot_align", "--augment-param", "variant=joint", "--augment-param", "solver=exact"], "--augment-param: solver belongs to the sound and channel variants"),
    (["--augment", "fedrdn", "--augment-param", "draw=per_epoch"], "'fedrdn' parameter 'draw' must be one of 'per_image', 'per_batch'"),
    (["--augment", "mixup", "--augment-param", "alpha=-1"], "'mixup' parameter 'alpha' must be a number >= 0"),
    (["--augment", "naivemix", "--augment-param", "lam=2"], "'naivemix' parameter 'lam' must be a number in [0, 1]"),
    (["--augment", "cutmix9"], "--augment: must be one of"),
    (["--dataset-param", "bogus=1"], "--dataset-param: 'digits' has no parameter 'bogus'; it accepts: root, test_fraction, seed"),
    (["--dataset-param", "test_fraction=1.5"], "--dataset-param: 'digits' parameter 'test_fraction' must be a number in [0, 1)"),
    (["--dataset", "fashion_mnist_domains", "--model", "lenet5", "--dataset-param", 'domains=["x"]'], "'domains' must be a non-empty list of 'original'"),
    (["--model", "lenet5"], "--model: 'lenet5' cannot take 'digits' images of shape (1, 8, 8)"),
    (["--dataset", "pacs", "--model", "alexnet_bn", "--dataset-param", "image_size=32"], "AlexNetBN needs image_size >= 63"),
    (["--model", "vgg99"], "--model: must be one of 'auto', "),
    (["--dataset", "imagenet"], "--dataset: must be one of"),
    (["--partition", "zipf"], "--partition: must be one of"),
    (["--partition", "dirichlet", "--alpha", "0"], "--alpha: must be a number > 0 and finite; got 0.0"),
    (["--partition", "distrans", "--dh", "1.5"], "--dh: must be a number in [0, 1]"),
    (["--partition", "distrans"], "--dh: partition 'distrans' needs exactly one of --dh or --classes-per-client"),
    (["--partition", "pathological", "--classes-per-client", "11"], "--classes-per-client: must lie in [1, 10]"),
    (["--partition", "domain"], "--partition: 'domain' needs a dataset with domains"),
    (["--optimizer", "lbfgs"], "--optimizer: must be one of 'sgd', 'adam'"),
    (["--lr", "0"], "--lr: must be a number > 0 and finite (or leave the option out); got 0.0"),
    (["--lr", "nan"], "--lr: must be a number > 0 and finite (or leave the option out); got nan"),
    (["--lr", "inf"], "--lr: must be a number > 0 and finite (or leave the option out); got inf"),
    (["--momentum", "1.5"], "--momentum: must be a number in [0, 1)"),
    (["--weight-decay", "-1"], "--weight-decay: must be a number >= 0 and finite"),
    (["--validation", "1.0"], "--validation: must be a number in [0, 1)"),
    (["--num-clients", "0"], "--num-clients: must be an integer >= 1; got 0"),
    (["--num-clients", "200", "--max-train-samples", "100"], "--num-clients: 200 clients need at least 200 training samples"),
    (["--max-train-samples", "-5"], "--max-train-samples: must be an integer >= 0"),
    (["--fraction", "1.5"], "--fraction: must be a number in (0, 1]"),
    (["--clients-per-round", "4"], "--clients-per-round: must be <= --num-clients (3)"),
    (["--batch-size", "0"], "--batch-size: must be an integer >= 1"),
    (["--eval-every", "0"], "--eval-every: must be an integer >= 1"),
    (["--local-epochs", "0"], "--local-epochs: must be an integer in [1, 1000]"),
    (["--local-epochs", "1000000"], "--local-epochs: must be an integer in [1, 1000] (or leave the option out); got 1000000"),
    (["--rounds", "0"], "--rounds: must be an integer >= 1; got 0"),
    (["--num-rounds=0"], "--num-rounds: must be an integer >= 1; got 0"),
    (["--num-clients", "700", "--max-train-samples", "600"], "--num-clients: 700 clients need at least 700 training samples, but --max-train-samples keeps 600"),
    (["--num-clients", "5000"], "--num-clients: 5000 clients need at least 5000 training samples, but 'digits' provides 1347"),
    (["--partition", "iid", "--alpha", "0.1"], "--alpha: partition 'iid' does not use it (only 'dirichlet' does); leave it out"),
    (["--partition", "iid", "--min-size", "3"], "--min-size: partition 'iid' does not use it (only 'dirichlet' and 'quantity' do)"),
    (["--partition", "dirichlet", "--dh", "0.5"], "--dh: partition 'dirichlet' does not use it (only 'distrans' does)"),
    (["--seed", "-1"], "--seed: must be an integer >= 0"),
    (["--device", "tpu9"], "device: unknown device 'tpu9'; use auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:7"], "device: 'cuda:7' asked for"),
    (["--checkpoint-every", "-1"], "checkpoint_every: must be an integer >= 0"),
    (["--rounds", "abc"], "argument --num-rounds/--rounds: invalid int value: 'abc'"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
]


@pytest.mark.parametrize("args,message", CLI_CASES, ids=[" ".join(a)[:60] for a, _ in CLI_CASES])
def test_cli_refuses_a_bad_input_in_one_line_naming_the_field_and_writes_nothing(args, message, cache, no_work,
                                                                                 capsys):
    try:
        status, out, err = _cli(["run", *DIGITS, *args], capsys)
    except SystemExit as exit_:  # argparse's own errors exit from inside parse_args
        status, out, err = exit_.code, *capsys.readouterr()
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert message in err, err
    assert _files(cache) == []


API_CASES = [  # (RunConfig arguments, the field the message starts with)
    ({"momentum": "a"}, "momentum"), ({"fraction": None}, "fraction"), ({"dh": "0.8", "partition": "distrans"}, "dh"),
    ({"algorithm_params": None}, "algorithm_params"), ({"augment_params": [1]}, "augment_params"),
    ({"dataset_params": None}, "dataset_params"), ({"lr": True}, "lr"), ({"lr": "0.1"}, "lr"),
    ({"num_clients": 2.0}, "num_clients"), ({"num_rounds": True}, "num_rounds"), ({"seed": 1.5}, "seed"),
    ({"algorithm": None}, "algorithm"), ({"model": 5}, "model"), ({"dataset_params": {"bogus": 1}}, "dataset_params"),
    ({"algorithm": "fedprox", "algorithm_params": {"mu": [1]}}, "algorithm_params"),
    ({"augment": "fedrdn", "augment_params": {"variant": 3}}, "augment_params"),
    ({"algorithm": "fedbn"}, "model"), ({"dh": math.nan, "partition": "distrans"}, "dh"),
]


@pytest.mark.parametrize("changes,field", API_CASES, ids=[str(c)[:50] for c, _ in API_CASES])
def test_python_api_refuses_a_bad_value_naming_the_field(changes, field, tiny):
    with pytest.raises(ValueError, match=f"^{field}: "):
        tiny.replace(**changes)


@pytest.mark.parametrize("kwargs,field", [({"device": "tpu9"}, "device"), ({"device": "cuda:7"}, "device"),
                                          ({"checkpoint_every": -1}, "checkpoint_every"),
                                          ({"checkpoint_every": 1.5}, "checkpoint_every"),
                                          ({"on_diverge": "ignore"}, "on_diverge")])
def test_run_options_are_checked_before_any_work(kwargs, field, tiny, tmp_path, no_work):
    with pytest.raises(ValueError, match=f"^{field}: "):
        run(tiny, cache_dir=tmp_path, **kwargs)
    assert _files(tmp_path) == []


def test_cuda_without_a_gpu_is_refused_before_any_work(tiny, tmp_path, no_work, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="^device: 'cuda' asked for, but PyTorch sees no CUDA GPU"):
        run(tiny, cache_dir=tmp_path, device="cuda")
    assert _files(tmp_path) == []


def test_equal_settings_are_one_config_and_one_cache_entry(tiny):
    a = tiny.replace(lr=1, algorithm="fedprox", algorithm_params={"mu": 1})
    b = tiny.replace(lr=1.0, algorithm="fedprox", algorithm_params={"mu": 1.0})
    assert a == b and isinstance(a.lr, float) and isinstance(a.algorithm_params["mu"], float)
    assert runs_module.cache_key(a, torch.device("cpu")) == runs_module.cache_key(b, torch.device("cpu"))


def test_methods_built_by_hand_check_their_arguments_too():
    from fedlab_core.algorithms import FedProx
    from fedlab_core.augment import FedRDN

    with pytest.raises(ValueError, match="'fedprox' parameter 'mu' must be a number >= 0; got 'abc'"):
        FedProx(mu="abc")
    with pytest.raises(ValueError, match="'fedrdn' parameter 'variant' must be one of"):
        FedRDN(variant="bogus")
    assert FedProx(mu=1).mu == 1


# ----------------------------------------------------------------------------------- failures at run time

def test_run_time_failures_are_one_line_with_status_1_and_nothing_cached(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDLAB_DATA_DIR", str(tmp_path / "no-data"))
    status, out, err = _cli(["run", "--dataset", "cifar10", "--rounds", "1"], capsys)
    assert status == 1 and out == "" and err.count("\n") == 1
    assert "error: Dataset 'cifar10' was not found; looked for its files in" in err and "How to get it" in err
    status, out, err = _cli(["run", *DIGITS, "--lr", "1e10"], capsys)  # diverges in round 1
    assert status == 1 and err.count("\n") == 1
    assert "error: non-finite training loss at client 0 in round 1" in err and "lower learning rate" in err
    assert not list(cache.glob("*.json"))


def test_a_damaged_data_file_is_named_in_one_line(cache, tmp_path, capsys):
    from test_sources import make_idx_set  # the IDX writer of the loaders' tests

    folder = tmp_path / "data" / "fashion-mnist"
    make_idx_set(folder, gz=True)
    damaged = folder / "train-images-idx3-ubyte.gz"
    damaged.write_bytes(damaged.read_bytes()[:40])  # truncated
    args = ["run", "--dataset", "fashion_mnist", "--dataset-param", f"root={tmp_path / 'data'}", "--rounds", "1",
            "--num-clients", "2", "--model", "mlp"]
    status, out, err = _cli(args, capsys)
    assert status == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert f"error: {damaged}: " in err and "replace it with a good copy" in err
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(b"plain bytes, not gzip")
    damaged.unlink()
    make_idx_set(tmp_path / "fresh")
    (tmp_path / "fresh" / "train-images-idx3-ubyte").rename(folder / "train-images-idx3-ubyte")
    status, _, err = _cli(args, capsys)
    assert status == 1 and f"{folder / 't10k-labels-idx1-ubyte.gz'}: Not a gzipped file" in err
    assert not list(cache.glob("*.json"))


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(cache, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("weights")
    monkeypatch.setattr(runs_module, "build", broken)
    status, _, err = _cli(["run", *DIGITS], capsys)
    assert status == 1 and err == "error: unexpected KeyError: 'weights' (run again with --debug for the traceback)\n"
    status, _, err = _cli(["run", *DIGITS, "--debug"], capsys)
    assert status == 1 and "Traceback (most recent call last)" in err and err.endswith("(run again with --debug "
                                                                                        "for the traceback)\n")


def test_a_round_in_which_every_client_fails_stops_the_run_and_nothing_is_cached(tiny, tmp_path, monkeypatch):
    def broken_loss(self, x, y, client_state):
        raise TypeError("unsupported operand type(s) for *: 'str' and 'Tensor'")
    monkeypatch.setattr(FedAvg, "loss", broken_loss)
    with pytest.raises(ClientsFailedError, match=r"every client sampled in round 1 failed, so the run stops "
                                                 r"\(clients 0, 1, 2, 3: TypeError: unsupported operand"):
        run(tiny, cache_dir=tmp_path, progress=False)
    assert not list(tmp_path.glob("*.json"))
    assert not list(tmp_path.glob("*.ckpt"))


def test_one_failing_client_is_left_out_logged_and_counted(tiny, tmp_path, monkeypatch, caplog):
    original = FedAvg.train_local

    def train_local(self, data, rng, client_state):
        if data.cid == 2:
            raise RuntimeError("out of memory")
        return original(self, data, rng, client_state)
    monkeypatch.setattr(FedAvg, "train_local", train_local)
    history = run(tiny, cache_dir=tmp_path, progress=False)
    assert [r["failed"] for r in history.rounds] == [1, 1, 1] and history.meta["failed_clients"] == 3
    assert "client 2 failed in round 1" in caplog.text


def test_cli_json_reports_failed_clients_per_round_and_the_samples_used(cache, capsys):
    status, out, _ = _cli(["run", *DIGITS, "--max-train-samples", "5000", "--max-test-samples", "100",
                           "--checkpoint-every", "1", "--json"], capsys)
    assert status == 0
    doc = json.loads(out)
    assert all(r["failed"] == 0 and r["clients"] == 3 for r in doc["rounds"])
    # max_train_samples above the data's size: recorded as asked, used as there is
    assert doc["config"]["max_train_samples"] == 5000 and doc["meta"]["samples"]["train"] == 1347
    assert doc["meta"]["samples"]["test"] == 100 and sum(doc["meta"]["samples"]["client_test"]) == 100
    assert doc["meta"]["key"] and doc["meta"]["torch"] == torch.__version__


def test_cli_checkpoints_every_round_by_default(cache, capsys, monkeypatch):
    written = []
    monkeypatch.setattr(runs_module, "_write_state", lambda path, key, state: written.append(state.next_round - 1))
    assert _cli(["run", *DIGITS, "--rounds", "3"], capsys)[0] == 0
    assert written == [1, 2]  # not the last round: the result replaces the checkpoint
    written.clear()
    assert _cli(["run", *DIGITS, "--rounds", "5", "--checkpoint-every", "2"], capsys)[0] == 0
    assert written == [2, 4]


def test_cli_in_a_subprocess_prints_one_line_and_exits_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fedlab_core", "run", "--algorithm", "fedprox", "--algorithm-param",
                          "mu=abc", "--dataset", "digits"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "FEDLAB_CACHE_DIR": str(tmp_path / "c")})
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "error: --algorithm-param: 'fedprox' parameter 'mu' must be a number >= 0; got 'abc'\n"
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------------- the cache's files

def _numbers(history):
    return [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in history.rounds], history.final


@pytest.mark.parametrize("damage", [lambda text: text[: len(text) // 2], lambda text: "",
                                    lambda text: text.replace('"seed": 0', '"seed": 1')],
                         ids=["truncated", "empty", "another run's"])
def test_a_damaged_cached_result_is_set_aside_reported_and_recomputed(damage, tiny, tmp_path, caplog):
    first = run(tiny, cache_dir=tmp_path, progress=False)
    path = tmp_path / f"{first.meta['key']}.json"
    path.write_text(damage(path.read_text()))
    again = run(tiny, cache_dir=tmp_path, progress=False)
    assert _numbers(again) == _numbers(first) and again.meta["resumed_from_round"] == 0
    assert (tmp_path / f"{path.name}.damaged").exists()  # kept, not deleted
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "computed again" in warnings[0]
    assert "\n" not in warnings[0]
    assert run(tiny, cache_dir=tmp_path, progress=False) == again  # the recomputed result is cached


class _Stop(Exception):
    pass


def _interrupted_run(config, cache_dir, monkeypatch, after_round=2):
    """A run stopped after `after_round` rounds, leaving its checkpoint behind."""
    original = Simulation.run_round

    def run_round(self, state):
        if state.next_round > after_round:
            raise _Stop
        return original(self, state)
    with monkeypatch.context() as m:
        m.setattr(Simulation, "run_round", run_round)
        with pytest.raises(_Stop):
            run(config, cache_dir=cache_dir, progress=False)


def test_a_damaged_checkpoint_is_set_aside_and_the_run_starts_over(tiny, tmp_path, monkeypatch, caplog):
    config = tiny.replace(num_rounds=4)
    _interrupted_run(config, tmp_path, monkeypatch)
    (ckpt,) = tmp_path.glob("*.ckpt")
    ckpt.write_bytes(ckpt.read_bytes()[:200])
    history = run(config, cache_dir=tmp_path, progress=False)
    assert history.meta["resumed_from_round"] == 0
    assert _numbers(history) == _numbers(run(config, use_cache=False, progress=False))
    assert (tmp_path / f"{ckpt.name}.damaged").exists()
    assert any(str(ckpt) in r.getMessage() and "cannot be read" in r.getMessage() for r in caplog.records)


def test_an_intact_checkpoint_resumes(tiny, tmp_path, monkeypatch):
    config = tiny.replace(num_rounds=4)
    _interrupted_run(config, tmp_path, monkeypatch)
    history = run(config, cache_dir=tmp_path, progress=False)
    assert history.meta["resumed_from_round"] == 2
    assert _numbers(history) == _numbers(run(config, use_cache=False, progress=False))


class _Payload:
    """Unpickling this would run code: it creates a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("form", ["pickle", "torch.save"])
def test_a_crafted_pickle_in_the_cache_is_refused_not_run(form, tiny, tmp_path, monkeypatch, caplog):
    config = tiny.replace(num_rounds=4)
    _interrupted_run(config, tmp_path, monkeypatch)
    (ckpt,) = tmp_path.glob("*.ckpt")
    marker = tmp_path / "code-ran"
    if form == "pickle":
        ckpt.write_bytes(pickle.dumps({"key": ckpt.stem, "state": _Payload(marker)}))
    else:
        buffer = io.BytesIO()
        torch.save({"key": ckpt.stem, "state": _Payload(marker)}, buffer)
        ckpt.write_bytes(buffer.getvalue())
    history = run(config, cache_dir=tmp_path, progress=False)
    assert not marker.exists()
    assert history.meta["resumed_from_round"] == 0
    assert (tmp_path / f"{ckpt.name}.refused").exists()
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "holds objects other than tensors and plain values, so it was not loaded" in message


def test_a_crafted_or_damaged_final_state_is_refused_and_the_run_is_kept_again(tiny, tmp_path):
    from fedlab_core.runs import trained

    config = tiny.replace(num_rounds=2)
    _, state = trained(config, cache_dir=tmp_path)
    (final,) = tmp_path.glob("*.final")
    marker = tmp_path / "code-ran"
    final.write_bytes(pickle.dumps({"key": final.stem, "state": _Payload(marker)}))
    _, again = trained(config, cache_dir=tmp_path)
    assert not marker.exists() and (tmp_path / f"{final.name}.refused").exists()
    assert torch.equal(again.server["weights"], state.server["weights"])
    final.write_bytes(b"")
    _, third = trained(config, cache_dir=tmp_path)
    assert (tmp_path / f"{final.name}.damaged").exists()
    assert torch.equal(third.server["weights"], state.server["weights"])


def test_cli_interrupt_says_whether_a_checkpoint_was_kept(cache, capsys, monkeypatch):
    from fedlab_core.store import cache_key

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs_module, "run", interrupted)
    assert cli.main(["run", *DIGITS]) == 130
    assert capsys.readouterr().err.strip() == ("error: interrupted before any checkpoint was written; the same command "
                                               "starts again from round 1")
    config = cli._config(cli.parser().parse_args(["run", *DIGITS]))
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"{cache_key(config, torch.device('cpu'))}.ckpt").write_bytes(b"")
    assert cli.main(["run", *DIGITS]) == 130
    assert capsys.readouterr().err.strip() == ("error: interrupted; the last checkpoint is kept, and the same command "
                                               "resumes from it")


def test_cli_help_says_what_an_unset_default_means():
    text = cli.parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "None" not in text
    assert "local learning rate (default: the method's own, its paper's setting)" in " ".join(text.split())


def test_a_partition_option_the_scheme_ignores_is_reset_so_one_split_has_one_key(tiny):
    plain = tiny.replace(partition="iid")
    for ignored in ({"alpha": 0.1}, {"beta": 3.0}, {"min_size": 2}, {"dh": 0.5}, {"classes_per_client": 2}):
        config = plain.replace(**ignored)
        assert config == plain, ignored
        assert runs_module.cache_key(config, torch.device("cpu")) == runs_module.cache_key(plain, torch.device("cpu"))
    # the scheme that reads an option keeps it
    assert tiny.replace(partition="dirichlet", alpha=0.1).alpha == 0.1
    assert tiny.replace(partition="pathological", classes_per_client=3).classes_per_client == 3


def _summary(validation=0.0, resumed=0):
    return {"config": {"validation": validation},
            "rounds": [{"round": 1, "global_accuracy": 0.5, "mean_client_accuracy": 0.4, "failed": 0,
                        "bytes_up": 1e6, "bytes_down": 1e6}],
            "final": {"global_accuracy": 0.5, "mean_client_accuracy": 0.4},
            "meta": {"samples": {"train": 80, "test": 20}, "key": "abc", "resumed_from_round": resumed}}


def test_cli_summary_names_validation_samples_and_says_when_a_run_resumed():
    assert "80 training and 20 test samples" in cli._human("run", _summary())
    assert "80 training and 20 validation samples" in cli._human("run", _summary(validation=0.2))
    assert "resumed" not in cli._human("run", _summary())
    assert cli._human("run", _summary(resumed=3)).endswith("resumed from the checkpoint after round 3")


def test_cli_says_a_resumed_run_resumed(cache, capsys, monkeypatch):
    argv = ["run", *DIGITS, "--rounds", "4"]
    _interrupted_run(cli._config(cli.parser().parse_args(argv)), cache, monkeypatch)  # a checkpoint after round 2
    status, out, _ = _cli(argv, capsys)
    assert status == 0 and out.rstrip().endswith("resumed from the checkpoint after round 2")
    status, out, _ = _cli(["run", *DIGITS, "--rounds", "3"], capsys)  # a run that was never interrupted
    assert status == 0 and "resumed" not in out
