"""On a CUDA GPU (skipped without one): two runs of one config give the same bits, with either executor and every
kind of batched step, and say which kernels computed them; a batched step replayed as a CUDA graph is the step
launched eagerly; "auto" batches the clients where the method allows it; runs trained together are
the runs trained alone; a CPU run with worker processes after CUDA training in the same process succeeds.

Self-contained (no fixture of conftest.py), so that ``pytest --noconftest tests/test_cuda.py`` runs on a GPU
machine that has PyTorch and the data but not the book's tools."""
import subprocess
import sys

import pytest
import torch

from fedlab_core import RunConfig, batched, run
from fedlab_core.runs import run_many

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# LeNet-5's convolutions and linear layers on unequal Dirichlet shards, with momentum: cuDNN and cuBLAS both compute
CASE = RunConfig(dataset="fashion_mnist", model="lenet5", max_train_samples=2_000, max_test_samples=2_000,
                 num_clients=8, num_rounds=3, batch_size=32, lr=0.05, momentum=0.9, partition="dirichlet", alpha=0.5,
                 seed=0)


def _numbers(history):
    return [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in history.rounds]


@pytest.mark.parametrize("executor", ["loop", "batched"])
def test_two_runs_of_one_config_are_bit_identical(executor):
    a, b = (run(CASE.replace(executor=executor), use_cache=False, device="cuda", progress=False) for _ in range(2))
    assert _numbers(a) == _numbers(b) and a.final == b.final
    assert a.meta["device"] == "cuda" and a.meta["executor"] == executor
    assert a.meta["deterministic"] == {"algorithms": True, "cudnn_deterministic": True, "cudnn_benchmark": False,
                                       "cublas_workspace": ":4096:8", "tf32": False}


def test_auto_batches_the_clients_where_the_method_allows_it():
    assert run(CASE.replace(num_rounds=1), use_cache=False, device="cuda").meta["executor"] == "batched"
    fraug = run(CASE.replace(num_rounds=1, algorithm="fraug", model="lenet5_bn"), use_cache=False, device="cuda")
    assert fraug.meta["executor"] == "loop"


def test_runs_trained_together_are_the_runs_trained_alone():
    grid = [CASE.replace(seed=seed, lr=lr) for seed in (0, 1) for lr in (0.02, 0.05)]
    together = run_many(grid, use_cache=False, device="cuda")
    for config, history in zip(grid, together):
        alone = run(config, use_cache=False, device="cuda", progress=False)
        assert history.meta["trained_together"] == 4
        assert _numbers(history) == _numbers(alone), (config.seed, config.lr)


AFTER_CUDA = """
import torch
from fedlab_core import RunConfig, run
config = RunConfig(dataset="digits", model="mlp", num_clients=4, num_rounds=2, batch_size=32, lr=0.1, seed=0)
run(config, use_cache=False, device="cuda", progress=False)  # autograd's CUDA threads start here
history = run(config, use_cache=False, device="cpu", progress=False, workers=2)
assert history.meta["workers"] == 2 and history.meta["failed_clients"] == 0, history.meta
print("ok")
"""


@pytest.mark.parametrize("algorithm", ["moon", "distrans", "scaffold", "fedbn", "pfedme", "pfedhn", "fedaws",
                                       "fedproto", "fedfa"])
def test_every_kind_of_batched_step_is_bit_identical_and_its_runs_together_are_alone(algorithm):
    # frozen models (MOON), trained inputs (DisTrans), a gradient correction (SCAFFOLD; pFedHN's clipping),
    # per-client batch norm (FedBN), a step rule of its own with carried tensors (pFedMe), a loss of its own (FedAwS),
    # a frozen model of buffers (FedProto's received prototypes), draws and carried statistics of the loss (FedFA)
    model = "lenet5_bn" if algorithm == "fedbn" else "lenet5"
    config = CASE.replace(algorithm=algorithm, model=model, num_rounds=2, executor="batched")
    a, b = (run(config, use_cache=False, device="cuda", progress=False) for _ in range(2))
    assert a.meta["executor"] == "batched" and _numbers(a) == _numbers(b)
    together = run_many([config, config.replace(seed=1)], use_cache=False, device="cuda")
    assert together[0].meta["trained_together"] == 2 and _numbers(together[0]) == _numbers(a)


def test_a_cpu_run_with_workers_after_cuda_training_succeeds():
    done = subprocess.run([sys.executable, "-c", AFTER_CUDA], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.mark.parametrize("algorithm,changes", [("fedavg", {}), ("fedavg", {"optimizer": "adam", "lr": 0.001}),
                                               ("moon", {}), ("distrans", {}), ("scaffold", {}), ("pfedme", {}),
                                               ("fedbn", {"model": "lenet5_bn"}), ("fedfa", {})], ids=str)
def test_steps_replayed_as_a_cuda_graph_are_the_steps_launched_eagerly(algorithm, changes, monkeypatch):
    config = CASE.replace(algorithm=algorithm, num_rounds=2, executor="batched", **changes)
    graphed = run(config, use_cache=False, device="cuda", progress=False)
    monkeypatch.setitem(batched.GRAPHS, "cuda", False)
    eager = run(config, use_cache=False, device="cuda", progress=False)
    assert graphed.meta["executor"] == "batched" and _numbers(graphed) == _numbers(eager)


def test_a_program_kept_from_round_to_round_and_shared_by_calls_replays_the_bits_of_a_fresh_capture(monkeypatch):
    # 8 clients 4 to a call: two calls a round share one kept program (its graph captured once, in round 1), whose
    # numbers must be those of a program captured anew for every call
    monkeypatch.setitem(batched.WIDTH, "cuda", 4)
    config = CASE.replace(num_rounds=3, executor="batched")
    kept = run(config, use_cache=False, device="cuda", progress=False)
    monkeypatch.setattr(batched, "KEEP", 0)
    fresh = run(config, use_cache=False, device="cuda", progress=False)
    assert kept.meta["executor"] == "batched" and _numbers(kept) == _numbers(fresh)
